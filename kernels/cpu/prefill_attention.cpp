// Long prefill chunks of bfloat16 attention on the CPU: flash attention over the paged cache with
// blocked matrix products (oneDNN's batch-reduce GEMM micro-kernel, as torch exports it: AMX tiles
// where the CPU has them, AVX512-BF16 pair dot products elsewhere), for chunks too long for the
// row-by-row kernel in paged_attention.cpp.
//
// Why not torch's SDPA: a chunk after cached context first needs its keys gathered and a mask
// built, and SDPA's causal blocking (256 query rows x 512 keys at 1,024 rows) computes ~1.5x the
// scores the causal triangle needs, each through a float32 exp that took 38% of its time (perf,
// 2026-11-24: rounds F and I in the git history of bench/README.md); on an AVX512-BF16 CPU without
// AMX it took 2.4-3x this kernel's time. Here every chunk reads its keys in place through the
// block table, the tiles are 128 keys wide with the query heads of a KV head stacked into one
// matrix (so a KV tile is read once for the whole group), and the softmax works in base 2 with a
// degree-5 polynomial (relative error ~2e-6, far under the bfloat16 rounding of the probabilities
// it feeds).
//
// Two phases, one parallel loop each: (1) each KV head's keys and values of every long chunk are
// copied, a tile of keys at a time, into the pair-interleaved ("VNNI") layout the micro-kernel
// multiplies (K transposed); (2) each work item (chunk, KV head, tile of query rows) runs the
// online softmax over the key tiles its rows can see. Items are taken largest first and handed
// out one at a time, because a causal chunk's last rows see many more keys than its first.
//
// Built only where the compiler targets AVX512-BF16 (the probabilities' conversion); `available()`
// also asks torch's micro-kernel for one small product in that layout, which it refuses where
// oneDNN is off or older than the layout. Callers check it and otherwise use SDPA.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#include <omp.h>
#endif

namespace {

constexpr int64_t kKeyTile = 128;      // keys per tile: eight 16-lane vectors of a score row
constexpr int64_t kRowsPerItem = 128;  // query rows (tokens x heads of the group) per work item, at most

// The head dims the kernel takes (its vector loops go 16 lanes at a time; the key packing
// buffer holds 512); kernels/cpu/prefill_attention_op.py asks the same function.
bool takes_head_dim(int64_t dim) { return dim % 16 == 0 && dim <= 512; }

// The first key a row at position `pos` sees: the window's first, or the context's (0: no window).
inline int64_t first_visible(int64_t pos, int64_t window) {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

#if defined(__AVX512BF16__)

using at::BFloat16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct LongChunk {
    int64_t start;      // first query row in the step
    int64_t q_len;      // query rows
    int64_t ctx;        // keys, the chunk's own included
    int64_t first_key;  // keys before it are seen by no row (sliding window)
    int64_t first_tile, tiles;
    int64_t packed;  // offset of its packed tiles (KV head major)
    const int32_t* table;
};

struct Item {
    int32_t chunk, kv_head, row0, row1;  // row0, row1: query rows (tokens) of the chunk
    int64_t cost;                        // key tiles it visits, for the order
};

// 2^x for x <= 0 on sixteen lanes: an integer power (scalef) times the degree-5 Taylor polynomial
// of 2^f on the remainder |f| <= 1/2.
inline __m512 exp2_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

inline void store_bf16(BFloat16* dst, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// The lanes [lo, hi) of the 16 starting at `base`.
inline __mmask16 lanes(int64_t lo, int64_t hi, int64_t base) {
    const uint32_t a = static_cast<uint32_t>(std::clamp<int64_t>(lo - base, 0, 16));
    const uint32_t b = static_cast<uint32_t>(std::clamp<int64_t>(hi - base, 0, 16));
    return static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
}

constexpr int kVecsPerTile = kKeyTile / 16;

// A row's visible keys of a tile [lo, hi), as lane masks of its vectors.
inline void visible_lanes(int64_t lo, int64_t hi, __mmask16* valid) {
    for (int v = 0; v < kVecsPerTile; ++v) valid[v] = lanes(lo, hi, 16 * v);
}

// The largest visible score of a row, scaled by `c` (-inf when none is visible).
inline float row_max(const float* s, const __mmask16* valid, float c) {
    __m512 top = _mm512_set1_ps(kNegInf);
    for (int v = 0; v < kVecsPerTile; ++v) top = _mm512_mask_max_ps(top, valid[v], top, _mm512_loadu_ps(s + 16 * v));
    return _mm512_reduce_max_ps(top) * c;
}

// A row's probabilities 2^(c s - m) into `p` (bfloat16, 0 where not visible); returns their sum.
inline float row_probs(const float* s, const __mmask16* valid, float c, float m, BFloat16* p) {
    const __m512 cv = _mm512_set1_ps(c), shift = _mm512_set1_ps(-m);
    __m512 sum = _mm512_setzero_ps();
    for (int v = 0; v < kVecsPerTile; ++v) {
        const __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(s + 16 * v), cv, shift);
        const __m512 e = _mm512_maskz_mov_ps(valid[v], exp2_nonpositive(x));
        sum = _mm512_add_ps(sum, e);
        store_bf16(p + 16 * v, e);
    }
    return _mm512_reduce_add_ps(sum);
}

inline const BFloat16* key_row(const BFloat16* cache, const int32_t* table, int64_t pos, int64_t block_size,
                               int64_t kv_heads, int64_t dim, int64_t head) {
    const int64_t slot = static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size;
    return cache + (slot * kv_heads + head) * dim;
}

// Key tile `tile` of one KV head: K as B of S = Q K^T ([dim/2][keys][2]: the pairs of a key's
// dims side by side) and V as B of O = P V ([keys/2][dim][2]: pairs of keys side by side). Keys
// before `first_key` or past the context are zeros (their scores are masked; zero values keep a
// probability of 0 times them at 0).
void pack_tile(const BFloat16* k_cache, const BFloat16* v_cache, const LongChunk& c, int64_t head, int64_t tile,
               int64_t block_size, int64_t kv_heads, int64_t dim, BFloat16* kt, BFloat16* vt) {
    uint32_t* k_words = reinterpret_cast<uint32_t*>(kt);
    const int64_t half_dim = dim / 2;
    for (int64_t n = 0; n < kKeyTile; ++n) {
        const int64_t pos = tile * kKeyTile + n;
        if (pos < c.first_key || pos >= c.ctx) {
            for (int64_t d2 = 0; d2 < half_dim; ++d2) k_words[d2 * kKeyTile + n] = 0;
            continue;
        }
        uint32_t words[256];
        std::memcpy(words, key_row(k_cache, c.table, pos, block_size, kv_heads, dim, head), dim * sizeof(BFloat16));
        for (int64_t d2 = 0; d2 < half_dim; ++d2) k_words[d2 * kKeyTile + n] = words[d2];
    }
    uint16_t* v_out = reinterpret_cast<uint16_t*>(vt);
    for (int64_t n = 0; n < kKeyTile; ++n) {
        const int64_t pos = tile * kKeyTile + n;
        uint16_t* dst = v_out + (n / 2) * dim * 2 + n % 2;
        if (pos < c.first_key || pos >= c.ctx) {
            for (int64_t d = 0; d < dim; ++d) dst[2 * d] = 0;
            continue;
        }
        const uint16_t* src =
            reinterpret_cast<const uint16_t*>(key_row(v_cache, c.table, pos, block_size, kv_heads, dim, head));
        for (int64_t d = 0; d < dim; ++d) dst[2 * d] = src[d];
    }
}

struct Scratch {
    std::vector<BFloat16> a, p;         // the item's query rows; a tile's probabilities
    std::vector<float> s, o;            // a tile's scores; the output rows
    std::vector<float> m, l;            // per row (padded to 16): the running max and sum,
    std::vector<float> top, sum, corr;  // the max with this tile, its sum, the factor for the output so far
    Scratch(int64_t rows, int64_t dim)
        : a(rows * dim), p(rows * kKeyTile), s(rows * kKeyTile), o(rows * dim), m(padded(rows)), l(padded(rows)),
          top(padded(rows)), sum(padded(rows)), corr(padded(rows)) {}
    static int64_t padded(int64_t rows) { return (rows + 15) / 16 * 16; }
};

// For 16 rows at once: the new running max (`top`), the factor for what was summed under the old
// one, and the running sum. A row that has seen nothing yet keeps -inf and a factor of 1.
inline void update_rows(float* m, float* l, const float* top, const float* sum, float* corr) {
    const __m512 old = _mm512_loadu_ps(m);
    const __m512 now = _mm512_loadu_ps(top);
    const __mmask16 same = _mm512_cmp_ps_mask(old, now, _CMP_EQ_OQ);
    const __m512 f = exp2_nonpositive(_mm512_mask_mov_ps(_mm512_sub_ps(old, now), same, _mm512_setzero_ps()));
    _mm512_storeu_ps(corr, f);
    _mm512_storeu_ps(m, now);
    _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), f, _mm512_loadu_ps(sum)));
}

void attend_item(const Item& item, const LongChunk& c, const BFloat16* q, BFloat16* out, const BFloat16* packed,
                 int64_t heads, int64_t group, int64_t dim, float c2, int64_t window, Scratch& w) {
    const int64_t rows = (item.row1 - item.row0) * group;
    const int64_t head0 = item.kv_head * group;
    for (int64_t t = item.row0; t < item.row1; ++t) {  // the group's heads of a token are adjacent
        std::memcpy(w.a.data() + (t - item.row0) * group * dim, q + ((c.start + t) * heads + head0) * dim,
                    group * dim * sizeof(BFloat16));
    }
    std::fill(w.m.begin(), w.m.end(), kNegInf);  // the padding rows too: they stay at -inf
    std::fill(w.l.begin(), w.l.end(), 0.0f);
    std::fill(w.top.begin(), w.top.end(), kNegInf);
    std::fill(w.sum.begin(), w.sum.end(), 0.0f);
    const int64_t pos0 = c.ctx - c.q_len + item.row0;  // the first row's position
    const int64_t pos_last = c.ctx - c.q_len + item.row1 - 1;
    const int64_t tile0 = first_visible(pos0, window) / kKeyTile;
    const int64_t tile_size = 2 * kKeyTile * dim;
    bool first = true;
    for (int64_t tile = std::max(tile0, c.first_tile); tile <= pos_last / kKeyTile; ++tile) {
        const BFloat16* kt = packed + c.packed + (item.kv_head * c.tiles + tile - c.first_tile) * tile_size;
        const BFloat16* vt = kt + kKeyTile * dim;
        at::native::cpublas::brgemm(rows, kKeyTile, dim, dim, kKeyTile, kKeyTile, false, w.a.data(), kt, w.s.data());
        const int64_t key0 = tile * kKeyTile;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t pos = pos0 + r / group;
            // first_visible(pos) - key0, clamped at 0, folded into one max (per row and tile).
            const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1 - key0) : 0;
            const int64_t hi = std::min<int64_t>(kKeyTile, pos + 1 - key0);
            BFloat16* p = w.p.data() + r * kKeyTile;
            if (hi <= lo) {  // this row sees none of the tile
                std::memset(p, 0, kKeyTile * sizeof(BFloat16));
                w.top[r] = w.m[r];
                w.sum[r] = 0.0f;
                continue;
            }
            __mmask16 valid[kVecsPerTile];
            visible_lanes(lo, hi, valid);
            const float* s = w.s.data() + r * kKeyTile;
            w.top[r] = std::max(w.m[r], row_max(s, valid, c2));  // the row's new max
            w.sum[r] = row_probs(s, valid, c2, w.top[r], p);
        }
        for (int64_t r = 0; r < rows; r += 16) {
            update_rows(w.m.data() + r, w.l.data() + r, w.top.data() + r, w.sum.data() + r, w.corr.data() + r);
        }
        if (!first) {
            for (int64_t r = 0; r < rows; ++r) {
                if (w.corr[r] == 1.0f) continue;
                const __m512 f = _mm512_set1_ps(w.corr[r]);
                float* o = w.o.data() + r * dim;
                for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), f));
            }
        }
        at::native::cpublas::brgemm(rows, dim, kKeyTile, kKeyTile, dim, dim, !first, w.p.data(), vt, w.o.data());
        first = false;
    }
    for (int64_t r = 0; r < rows; ++r) {  // every row saw at least its own key: l > 0
        const int64_t t = item.row0 + r / group, head = head0 + r % group;
        const __m512 inv = _mm512_set1_ps(1.0f / w.l[r]);
        const float* o = w.o.data() + r * dim;
        BFloat16* dst = out + ((c.start + t) * heads + head) * dim;
        for (int64_t d = 0; d < dim; d += 16) store_bf16(dst + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
    }
}

#endif  // __AVX512BF16__

#if defined(__AVX512BF16__)
// One 16 x 16 product of 2-deep pairs (A all ones, B the pair layout of 0..31 per column) through
// the micro-kernel: whether it runs here, and gives the sums it should.
bool micro_kernel_works() {
    std::vector<BFloat16> a(16 * 2, BFloat16(1.0f)), b(2 * 16);
    for (int n = 0; n < 16; ++n) {
        b[2 * n] = BFloat16(static_cast<float>(n));
        b[2 * n + 1] = BFloat16(static_cast<float>(n + 16));
    }
    std::vector<float> c(16 * 16, -1.0f);
    try {
        at::native::cpublas::brgemm(16, 16, 2, 2, 16, 16, false, a.data(), b.data(), c.data());
        at::native::cpublas::brgemm_release();
    } catch (const c10::Error&) {
        return false;
    }
    for (int m = 0; m < 16; ++m) {
        for (int n = 0; n < 16; ++n) {
            if (c[m * 16 + n] != static_cast<float>(2 * n + 16)) return false;
        }
    }
    return true;
}
#endif

bool available() {
#if defined(__AVX512BF16__)
    static const bool works = micro_kernel_works();
    return works;
#else
    return false;
#endif
}

}  // namespace

// out, q: [tokens, heads, dim] bfloat16; k_cache, v_cache: [blocks, block_size, kv_heads, dim];
// block_tables [requests, max_blocks], cu_seqlens_q [requests + 1], seqlens_k [requests]: int32,
// as paged_attention.cpp takes them (the new K/V already stored). Writes the rows of the requests
// with more than `min_query_len` query rows, causal, each row seeing the last `window` keys up to
// its own (0: all); the other rows of `out` are left to the caller.
void prefill_attention(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                       const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                       const torch::Tensor& cu_seqlens_q, const torch::Tensor& seqlens_k, double scale,
                       int64_t min_query_len, int64_t window) {
    TORCH_CHECK(available(), "prefill_attention: this CPU or build has no bfloat16 micro-kernel");
#if defined(__AVX512BF16__)
    TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "prefill_attention: q, out and the caches must be contiguous");
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 &&
                    k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
                "prefill_attention: bfloat16 only");
    TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt &&
                    cu_seqlens_q.scalar_type() == at::kInt && seqlens_k.scalar_type() == at::kInt,
                "prefill_attention: block tables and lengths are contiguous int32");
    const int64_t heads = q.size(1), dim = q.size(2);
    const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
    TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "prefill_attention: head shapes do not match");
    TORCH_CHECK(takes_head_dim(dim), "prefill_attention: head dim a multiple of 16 up to 512");
    TORCH_CHECK(window >= 0 && min_query_len >= 0, "prefill_attention: window and min_query_len not negative");
    const int64_t group = heads / kv_heads;
    const int64_t tokens_per_item = std::max<int64_t>(1, kRowsPerItem / group);
    const auto cu = cu_seqlens_q.contiguous(), seq = seqlens_k.contiguous();
    const int32_t* cu_p = cu.data_ptr<int32_t>();
    const int32_t* seq_p = seq.data_ptr<int32_t>();
    const int32_t* tables = block_tables.data_ptr<int32_t>();

    std::vector<LongChunk> chunks;
    std::vector<Item> items;
    int64_t packed_size = 0;
    for (int64_t r = 0; r < seqlens_k.size(0); ++r) {
        const int64_t q_len = cu_p[r + 1] - cu_p[r];
        if (q_len <= min_query_len) continue;
        const int64_t ctx = seq_p[r];
        TORCH_CHECK(ctx >= q_len, "prefill_attention: a request has fewer keys than query rows");
        LongChunk c{cu_p[r], q_len, ctx, first_visible(ctx - q_len, window), 0, 0, packed_size,
                    tables + r * block_tables.size(1)};
        c.first_tile = c.first_key / kKeyTile;
        c.tiles = (ctx + kKeyTile - 1) / kKeyTile - c.first_tile;
        packed_size += kv_heads * c.tiles * 2 * kKeyTile * dim;
        const auto index = static_cast<int32_t>(chunks.size());
        chunks.push_back(c);
        for (int64_t row0 = 0; row0 < q_len; row0 += tokens_per_item) {
            const int64_t row1 = std::min(q_len, row0 + tokens_per_item);
            const int64_t last = ctx - q_len + row1 - 1;
            const int64_t from = first_visible(ctx - q_len + row0, window);
            for (int64_t h = 0; h < kv_heads; ++h) {
                items.push_back({index, static_cast<int32_t>(h), static_cast<int32_t>(row0),
                                 static_cast<int32_t>(row1), last / kKeyTile - from / kKeyTile + 1});
            }
        }
    }
    if (chunks.empty()) return;
    std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });

    const auto packed = at::empty({packed_size}, q.options());
    BFloat16* packed_p = packed.data_ptr<BFloat16>();
    const BFloat16* k_p = k_cache.data_ptr<BFloat16>();
    const BFloat16* v_p = v_cache.data_ptr<BFloat16>();
    const BFloat16* q_p = q.data_ptr<BFloat16>();
    BFloat16* out_p = out.data_ptr<BFloat16>();
    std::vector<std::pair<int32_t, int64_t>> tiles;  // (chunk, KV head x tiles + tile)
    for (size_t i = 0; i < chunks.size(); ++i) {
        for (int64_t t = 0; t < kv_heads * chunks[i].tiles; ++t) tiles.emplace_back(static_cast<int32_t>(i), t);
    }
    const int64_t tile_size = 2 * kKeyTile * dim;
    const float c2 = static_cast<float>(scale) * 1.4426950408889634f;  // scores to base-2 exponents
    const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (size_t i = 0; i < tiles.size(); ++i) {
            const LongChunk& c = chunks[tiles[i].first];
            const int64_t head = tiles[i].second / c.tiles, tile = tiles[i].second % c.tiles;
            BFloat16* kt = packed_p + c.packed + tiles[i].second * tile_size;
            pack_tile(k_p, v_p, c, head, c.first_tile + tile, block_size, kv_heads, dim, kt, kt + kKeyTile * dim);
        }
        Scratch scratch(tokens_per_item * group, dim);
#pragma omp for schedule(dynamic, 1)
        for (size_t i = 0; i < items.size(); ++i) {
            attend_item(items[i], chunks[items[i].chunk], q_p, out_p, packed_p, heads, group, dim, c2, window, scratch);
        }
        at::native::cpublas::brgemm_release();
    }
#endif
}

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
    m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor cu_seqlens_q, Tensor seqlens_k, float scale, int min_query_len, int window) -> ()",
          &prefill_attention);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("prefill_attention", &prefill_attention, "long prefill chunks over the KV block table (CPU, bfloat16)");
    m.def("available", &available, "whether this CPU and build run prefill_attention");
    m.def("takes_head_dim", &takes_head_dim, "whether prefill_attention takes this head dim");
}
