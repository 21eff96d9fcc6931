// Paged attention on the CPU: every query row of a step (decode rows and prefill chunks alike)
// attends to its request's keys read in place through the block table, in float32. One call per
// layer; no gather, no padding, no mask tensor.
//
// Decode rows (one query row per request) take `decode`, two passes over the context (below), or
// in bfloat16 on CPUs with AMX, `decode_tiles`: the same two passes as tile products.
// Chunks of several rows take the tile path, `attend`, with an online softmax: work is split over
// (request, KV head, tile of up to kRowTile query rows), so the query heads of a KV head and the
// rows of a tile reuse each chunk of keys while it is in cache. Keys are taken 16 at a time
// through the block table (any block size) and converted to float32 once per work item; scores,
// softmax and the weighted sum of values work on 16-lane vectors (one AVX-512 register), lanes
// past a row's causal limit masked to a probability of 0.
//
// Two per-layer options (kernels/attention/backend.py), 0 meaning none: a sliding window of W
// keys (a row at position p sees p-W+1 .. p), for which a row starts reading at its first visible
// key, so that the blocks before it are never touched; and a softcap c, scores s becoming
// c * tanh(s / c) before the mask and the softmax. Neither costs the plain layers anything: the
// tile path takes them in a separate instance, the decode path only moves where its key loop
// starts and caps in a softmax pass of its own.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <ATen/native/CPUBlas.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kRowTile = 16;

inline float to_float(float x) { return x; }
inline float to_float(double x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Sixteen float32 lanes: one AVX-512 register (the compiler splits it on narrower CPUs).
typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
constexpr int kLanes = 16;

// exp(x) for x <= 0 (softmax arguments), all lanes at once: 2^(x log2 e) split into an integer
// power (exponent bits) and the degree-6 Taylor polynomial of 2^f for the remainder |f| <= 1/2
// (relative error ~2e-7, about float32's own rounding of the sums it feeds).
inline f16v exp_nonpositive(f16v x) {
    x = x < -87.0f ? f16v{} - 87.0f : x;
    const f16v t = x * 1.4426950408889634f;
    const f16v shifted = t + 0.5f;
    f16v whole = __builtin_convertvector(__builtin_convertvector(shifted, i16v), f16v);
    whole = whole > shifted ? whole - 1.0f : whole;  // floor(t + 1/2): the nearest integer
    const f16v f = t - whole;
    f16v p = f * 1.5403530393381606e-4f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const i16v bits = (__builtin_convertvector(whole, i16v) + 127) << 23;
    return p * reinterpret_cast<const f16v&>(bits);
}

typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

// Sixteen values as float32 lanes, for the types that have a vector conversion: bfloat16 is the
// top half of a float32, so widening its bits and shifting them up is exact. (c10's BFloat16
// conversion is a scalar loop that does not vectorize.)
inline f16v load16(const float* src) {
    f16v v;
    std::memcpy(&v, src, sizeof(v));
    return v;
}
inline f16v load16(const c10::BFloat16* src) {
#if defined(__AVX512F__)  // one widening load and a shift; the generic code splits the widening
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    return reinterpret_cast<f16v>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)));
#else
    u16x16 raw;
    std::memcpy(&raw, src, sizeof(raw));
    const u32x16 bits = __builtin_convertvector(raw, u32x16) << 16;
    return reinterpret_cast<const f16v&>(bits);
#endif
}

template <typename T>
constexpr bool kVectorLoads = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// Whether decode scores of T take `vdpbf16ps`: bfloat16 keys and queries multiplied as they are
// stored, pairs of dims a lane, with no widening of either.
#if defined(__AVX512BF16__)
template <typename T>
constexpr bool kDotBf16 = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kDotBf16 = false;
#endif

// A row of `dim` values converted to float32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t dim) {
    int64_t d = 0;
    if constexpr (kVectorLoads<T>) {
        for (; d + kLanes <= dim; d += kLanes) {
            const f16v v = load16(src + d);
            std::memcpy(dst + d, &v, sizeof(v));
        }
    }
    for (; d < dim; ++d) dst[d] = to_float(src[d]);
}

// tanh of all lanes: (1 - e) / (1 + e) with e = exp(-2|x|), which exp_nonpositive covers; below
// |x| = 1/4, where 1 - e loses digits to cancellation, the Taylor series to x^9 (its first
// omitted term is under 3e-9 there).
inline f16v tanh16(f16v x) {
    const f16v a = x < 0.0f ? -x : x;
    const f16v e = exp_nonpositive(-2.0f * a);
    const f16v far = (1.0f - e) / (1.0f + e);
    const f16v a2 = a * a;
    f16v near = a2 * (62.0f / 2835.0f) - 17.0f / 315.0f;
    near = near * a2 + 2.0f / 15.0f;
    near = near * a2 - 1.0f / 3.0f;
    near = (near * a2 + 1.0f) * a;
    const f16v t = a < 0.25f ? near : far;
    return x < 0.0f ? -t : t;
}

// Scores capped to softcap * tanh(s / softcap); lanes at -inf (masked) stay there.
inline f16v capped(f16v s, float softcap) {
    const f16v c = softcap * tanh16(s / softcap);
    return s > -std::numeric_limits<float>::infinity() ? c : s;
}

inline float lane_max(f16v v) {
    float m = v[0];
    for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
    return m;
}

inline float lane_sum(f16v v) {
    float s = 0.0f;
    for (int i = 0; i < kLanes; ++i) s += v[i];
    return s;
}

// The lane sums of sixteen vectors, as the sixteen lanes of one: pairs of vectors are folded
// into one holding twice the keys at half the partial sums each, four times over, so that key j
// ends in lane j (15 adds instead of 16 horizontal reductions).
inline f16v fold16(f16v x, f16v y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
}
inline f16v fold8(f16v x, f16v y) {
    return __builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
}
inline f16v fold4(f16v x, f16v y) {
    return __builtin_shufflevector(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
}
inline f16v fold2(f16v x, f16v y) {
    return __builtin_shufflevector(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           __builtin_shufflevector(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

inline f16v lane_sums(const f16v* p) {
    f16v a[8], b[4], c[2];
    for (int k = 0; k < 8; ++k) a[k] = fold16(p[2 * k], p[2 * k + 1]);
    for (int k = 0; k < 4; ++k) b[k] = fold8(a[2 * k], a[2 * k + 1]);
    for (int k = 0; k < 2; ++k) c[k] = fold4(b[2 * k], b[2 * k + 1]);
    return fold2(c[0], c[1]);
}

// Where token `pos` of a request (its block table) starts in a cache laid out as
// [blocks, block_size, kv_heads, dim]; each KV head's row follows at head * dim.
inline int64_t token_start(const int32_t* table, int64_t pos, int64_t block_size, int64_t token_stride) {
    return (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * token_stride;
}

struct WorkItem {
    int32_t req;
    int32_t kv_head;
    int32_t row0;  // first and past-the-last query row of the tile, relative to the request
    int32_t row1;
};

// kVecs > 0: the head dim in 16-lane vectors, fixed at compile time (its loops unroll into
// registers); 0: read at run time. A head dim that is not a multiple of 16 is zero-padded.
// kShaped: whether `window` or `softcap` may be set (the instance without them does none of
// their work).
template <typename T, int kVecs, bool kShaped>
void attend(const T* q, const T* k_cache, const T* v_cache, T* out, const int32_t* tables, int64_t max_blocks,
            const int32_t* cu_q, const int32_t* seqlens_k, const std::vector<WorkItem>& items, int64_t heads,
            int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int64_t window, float softcap) {
    const int64_t vecs = kVecs > 0 ? kVecs : (dim + kLanes - 1) / kLanes;
    const int64_t padded = vecs * kLanes;
    const int64_t group = heads / kv_heads;
    const int64_t token_stride = kv_heads * dim;  // between keys of a block
    const i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<f16v> qv_buf(kRowTile * group * vecs);
        float* qf = reinterpret_cast<float*>(qv_buf.data());  // [row][head][padded dim], scaled
        // Zeros past the head dim stay zeros: only the first `dim` lanes of a row are written.
        std::vector<f16v> acc(kRowTile * group * vecs), kf(kLanes * vecs), vf(kLanes * vecs);
        std::vector<float> mx(kRowTile * group), sum(kRowTile * group);
        float* kflat = reinterpret_cast<float*>(kf.data());  // [key][padded dim]
        float* vflat = reinterpret_cast<float*>(vf.data());
        for (int64_t w = begin; w < end; ++w) {
            const WorkItem& item = items[w];
            const int64_t q_start = cu_q[item.req];
            const int64_t q_len = cu_q[item.req + 1] - q_start;
            const int64_t first_pos = seqlens_k[item.req] - q_len;  // position of the request's row 0
            const int64_t rows = item.row1 - item.row0;
            for (int64_t i = 0; i < rows; ++i) {
                for (int64_t g = 0; g < group; ++g) {
                    const T* src = q + ((q_start + item.row0 + i) * heads + item.kv_head * group + g) * dim;
                    float* dst = qf + (i * group + g) * padded;
                    for (int64_t d = 0; d < dim; ++d) dst[d] = to_float(src[d]) * scale;
                }
            }
            std::fill(acc.begin(), acc.begin() + rows * group * vecs, f16v{});
            std::fill(mx.begin(), mx.begin() + rows * group, -std::numeric_limits<float>::infinity());
            std::fill(sum.begin(), sum.begin() + rows * group, 0.0f);
            const int64_t keys = first_pos + item.row1;  // what the tile's last row sees
            // The tile's first row sees the earliest keys: with a window, none of its rows sees
            // the ones before that row's window, which are skipped.
            int64_t first_key = 0;
            if constexpr (kShaped) {
                if (window > 0) first_key = std::max<int64_t>(0, first_pos + item.row0 + 1 - window);
            }
            const int32_t* table = tables + item.req * max_blocks;
            for (int64_t base = first_key; base < keys; base += kLanes) {
                const int64_t n = std::min<int64_t>(kLanes, keys - base);
                if (n < kLanes) {  // keys past the context: zeros, so that masked lanes stay finite
                    std::fill(kf.begin() + n * vecs, kf.end(), f16v{});
                    std::fill(vf.begin() + n * vecs, vf.end(), f16v{});
                }
                for (int64_t j = 0; j < n; ++j) {
                    const int64_t pos = base + j;
                    const int64_t offset = token_start(table, pos, block_size, token_stride) + item.kv_head * dim;
                    const T* kr = k_cache + offset;
                    const T* vr = v_cache + offset;
                    float* kd = kflat + j * padded;
                    float* vd = vflat + j * padded;
                    load_row(kr, kd, kVecs > 0 ? kVecs * kLanes : dim);
                    load_row(vr, vd, kVecs > 0 ? kVecs * kLanes : dim);
                }
                for (int64_t i = 0; i < rows; ++i) {
                    const int64_t row_pos = first_pos + item.row0 + i;
                    // The row sees lanes [before, visible): up to its position, and from its
                    // window's first key.
                    const int64_t visible = std::min<int64_t>(n, row_pos + 1 - base);
                    int64_t before = 0;
                    if constexpr (kShaped) {
                        if (window > 0) before = std::max<int64_t>(0, row_pos + 1 - window - base);
                    }
                    if (visible <= before) continue;
                    i16v in_view = lane < static_cast<int32_t>(visible);
                    if constexpr (kShaped) in_view &= lane >= static_cast<int32_t>(before);
                    for (int64_t g = 0; g < group; ++g) {
                        const int64_t h = i * group + g;
                        const f16v* qv = qv_buf.data() + h * vecs;
                        f16v partial[kLanes];
                        for (int j = 0; j < kLanes; ++j) {
                            const f16v* kr = kf.data() + j * vecs;
                            f16v p = qv[0] * kr[0];
                            for (int64_t c = 1; c < vecs; ++c) p += qv[c] * kr[c];
                            partial[j] = p;
                        }
                        f16v score = lane_sums(partial);
                        if constexpr (kShaped) {
                            if (softcap > 0.0f) score = capped(score, softcap);
                        }
                        score = in_view ? score : f16v{} - std::numeric_limits<float>::infinity();
                        const float chunk_max = std::max(mx[h], lane_max(score));
                        const float correction = std::exp(mx[h] - chunk_max);
                        f16v prob = exp_nonpositive(score - chunk_max);
                        prob = in_view ? prob : f16v{};
                        mx[h] = chunk_max;
                        sum[h] = sum[h] * correction + lane_sum(prob);
                        f16v* a = acc.data() + h * vecs;
                        for (int64_t c = 0; c < vecs; ++c) a[c] *= correction;
                        for (int j = 0; j < kLanes; ++j) {
                            const float pj = prob[j];
                            const f16v* vr = vf.data() + j * vecs;
                            for (int64_t c = 0; c < vecs; ++c) a[c] += pj * vr[c];
                        }
                    }
                }
            }
            for (int64_t i = 0; i < rows; ++i) {
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t h = i * group + g;
                    const float inv = 1.0f / sum[h];
                    const float* a = reinterpret_cast<const float*>(acc.data() + h * vecs);
                    T* dst = out + ((q_start + item.row0 + i) * heads + item.kv_head * group + g) * dim;
                    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(a[d] * inv);
                }
            }
        }
    });
}

// The decode path's softmax over one row of `padded` scores, in place: their exponentials less
// the maximum (whose lanes are in `top`), capped first when kCap. Returns 1 / their sum. Capping
// is monotonic, so the capped maximum is the maximum's cap.
template <bool kCap>
inline float exp_scores(float* sc, int64_t padded, f16v top, float softcap) {
    if constexpr (kCap) top = capped(top, softcap);
    const float mx = lane_max(top);
    f16v total{};
    for (int64_t base = 0; base < padded; base += kLanes) {
        // Lanes past the context hold -inf (capping keeps it): exp_nonpositive clamps them to
        // ~1e-38, which vanishes in a sum of at least 1 and is never read in pass two.
        f16v s = load16(sc + base);
        if constexpr (kCap) s = capped(s, softcap);
        const f16v p = exp_nonpositive(s - mx);
        total += p;
        std::memcpy(sc + base, &p, sizeof(p));
    }
    return 1.0f / lane_sum(total);
}

struct DecodeItem {
    int32_t req;
    int32_t head0;  // first and past-the-last KV head
    int32_t head1;
};

// Decode rows: one query row per request, in two passes over the context instead of an online
// softmax. Pass one computes every score (head dim and group fixed at compile time, so a KV
// head's query heads and accumulators stay in registers and each key is converted once for all
// the heads that read it); the softmax then runs over whole vectors of scores; pass two adds up
// the values, kGroup x kVecs independent FMA chains per key. An item covers a request's KV heads
// [head0, head1), taking all of them for each chunk of 16 keys in turn, so that it reads each
// block's rows whole: decode waits on memory, and items of one KV head each (reading 1/kv_heads
// of every token's row) took 21% longer a step at 2,048 tokens of context. Within a chunk both
// passes go token by token, each token's heads in turn, so that the rows are read in address
// order: sweeping one head's 16 rows and then the next (strided reads) took ~30% longer at
// 1,056 tokens on Zen 4, where the compute and the memory stalls add up rather than overlap.
// Prefetching the next chunk's rows by hand did not measurably help.
// In bfloat16 on CPUs with AVX512-BF16, pass one multiplies keys and queries as stored
// (`vdpbf16ps`: exact products of dim pairs, float32 sums) and scales the sums, which saves the
// widening of every key (about a tenth of the attention at 16 x 1,056 tokens). Pass two done
// the same way (probabilities rounded to bf16, two value rows interleaved) cut the arithmetic
// by a further third with one layer's cache in L3, but made the 30-layer step no faster: not kept.
//
// A sliding window only moves where both passes start (a decode row sees every key from its
// window's first to itself, so no lane needs masking for it); a softcap is applied in the
// softmax pass (exp_scores), out of the two passes over the keys.
template <typename T, int kVecs, int kGroup>
void decode(const T* q, const T* k_cache, const T* v_cache, T* out, const int32_t* tables, int64_t max_blocks,
            const int32_t* cu_q, const int32_t* seqlens_k, const std::vector<DecodeItem>& items, int64_t heads,
            int64_t kv_heads, int64_t block_size, float scale, int64_t window, float softcap) {
    constexpr int64_t dim = kVecs * kLanes;
    const int64_t token_stride = kv_heads * dim;
    const i16v lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const f16v minus_inf = f16v{} - std::numeric_limits<float>::infinity();
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores;       // [KV head][group][keys rounded up to 16]
        std::vector<f16v> qs, top, acc;  // [KV head][group][vecs]; [..][group]; [..][group][vecs]
        std::vector<f16v> partials;      // [KV head][group][16 keys]: a chunk's score sums before folding
        std::vector<float> inv_sum;      // [KV head][group]
        for (int64_t w = begin; w < end; ++w) {
            const DecodeItem& item = items[w];
            const int64_t row = cu_q[item.req];
            const int64_t keys = seqlens_k[item.req];
            const int64_t first = window > 0 ? std::max<int64_t>(0, keys - window) : 0;  // first key read
            const int64_t padded = (keys - first + kLanes - 1) / kLanes * kLanes;  // scores from `first` on
            const int64_t n_heads = item.head1 - item.head0;
            if (static_cast<int64_t>(scores.size()) < n_heads * kGroup * padded) {
                scores.resize(n_heads * kGroup * padded);
            }
            qs.assign(n_heads * kGroup * kVecs, f16v{});
            top.assign(n_heads * kGroup, minus_inf);
            acc.assign(n_heads * kGroup * kVecs, f16v{});
            partials.resize(n_heads * kGroup * kLanes);
            inv_sum.resize(n_heads * kGroup);
            const int32_t* table = tables + item.req * max_blocks;
            // Where key `pos` of the item's first KV head lies (a token's heads are contiguous).
            const auto token_at = [&](int64_t pos) {
                return token_start(table, pos, block_size, token_stride) + item.head0 * dim;
            };
            for (int64_t h = 0; h < n_heads; ++h) {
                for (int g = 0; g < kGroup; ++g) {
                    const T* src = q + (row * heads + (item.head0 + h) * kGroup + g) * dim;
                    if constexpr (kDotBf16<T>) {  // as stored, 32 dims a vector; scaled after the sums
                        std::memcpy(qs.data() + (h * kGroup + g) * kVecs, src, dim * sizeof(T));
                    } else {
                        for (int c = 0; c < kVecs; ++c) qs[(h * kGroup + g) * kVecs + c] = load16(src + c * kLanes) * scale;
                    }
                }
            }
            int64_t offsets[kLanes];  // the chunk's keys
            for (int64_t base = first; base < keys; base += kLanes) {
                const int64_t n = std::min<int64_t>(kLanes, keys - base);
                for (int64_t j = 0; j < n; ++j) offsets[j] = token_at(base + j);
                const i16v in_view = lane < static_cast<int32_t>(n);
                for (int64_t j = 0; j < kLanes; ++j) {
                    for (int64_t h = 0; h < n_heads; ++h) {
                        f16v* part = partials.data() + h * kGroup * kLanes + j;
                        if (j >= n) {  // past the context: zeros, masked below
                            for (int g = 0; g < kGroup; ++g) part[g * kLanes] = f16v{};
                            continue;
                        }
                        const T* kr = k_cache + offsets[j] + h * dim;
                        const f16v* qh = qs.data() + h * kGroup * kVecs;
                        if constexpr (kDotBf16<T>) {
#if defined(__AVX512BF16__)
                            constexpr int kPairs = kVecs / 2;  // vectors of 32 bf16 dims
                            __m512bh kv[kPairs];
                            for (int c = 0; c < kPairs; ++c) {
                                kv[c] = (__m512bh)_mm512_loadu_si512(kr + c * 2 * kLanes);
                            }
                            for (int g = 0; g < kGroup; ++g) {
                                const __m512bh* qg = reinterpret_cast<const __m512bh*>(qh + g * kVecs);
                                __m512 p = _mm512_dpbf16_ps(_mm512_setzero_ps(), kv[0], qg[0]);
                                for (int c = 1; c < kPairs; ++c) p = _mm512_dpbf16_ps(p, kv[c], qg[c]);
                                part[g * kLanes] = reinterpret_cast<const f16v&>(p);
                            }
#endif
                        } else {
                            f16v kv[kVecs];
                            for (int c = 0; c < kVecs; ++c) kv[c] = load16(kr + c * kLanes);
                            for (int g = 0; g < kGroup; ++g) {
                                f16v p = qh[g * kVecs] * kv[0];
                                for (int c = 1; c < kVecs; ++c) p += qh[g * kVecs + c] * kv[c];
                                part[g * kLanes] = p;
                            }
                        }
                    }
                }
                for (int64_t hg = 0; hg < n_heads * kGroup; ++hg) {
                    f16v s = lane_sums(partials.data() + hg * kLanes);
                    if constexpr (kDotBf16<T>) s *= scale;
                    s = in_view ? s : minus_inf;
                    f16v& t = top[hg];
                    t = t > s ? t : s;
                    std::memcpy(scores.data() + hg * padded + (base - first), &s, sizeof(s));
                }
            }
            for (int64_t hg = 0; hg < n_heads * kGroup; ++hg) {
                float* sc = scores.data() + hg * padded;
                inv_sum[hg] = softcap > 0.0f ? exp_scores<true>(sc, padded, top[hg], softcap)
                                             : exp_scores<false>(sc, padded, top[hg], softcap);
            }
            for (int64_t base = first; base < keys; base += kLanes) {
                const int64_t n = std::min<int64_t>(kLanes, keys - base);
                for (int64_t j = 0; j < n; ++j) offsets[j] = token_at(base + j);
                for (int64_t j = 0; j < n; ++j) {
                    for (int64_t h = 0; h < n_heads; ++h) {
                        const T* vr = v_cache + offsets[j] + h * dim;
                        f16v vv[kVecs];
                        for (int c = 0; c < kVecs; ++c) vv[c] = load16(vr + c * kLanes);
                        const float* probs = scores.data() + h * kGroup * padded + (base - first) + j;
                        f16v* a = acc.data() + h * kGroup * kVecs;
                        for (int g = 0; g < kGroup; ++g) {
                            const float p = probs[g * padded];
                            for (int c = 0; c < kVecs; ++c) a[g * kVecs + c] += p * vv[c];
                        }
                    }
                }
            }
            for (int64_t h = 0; h < n_heads; ++h) {
                for (int g = 0; g < kGroup; ++g) {
                    T* dst = out + (row * heads + (item.head0 + h) * kGroup + g) * dim;
                    for (int c = 0; c < kVecs; ++c) {
                        const f16v o = acc[(h * kGroup + g) * kVecs + c] * inv_sum[h * kGroup + g];
                        for (int l = 0; l < kLanes; ++l) dst[c * kLanes + l] = static_cast<T>(o[l]);
                    }
                }
            }
        }
    });
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// Decode rows in bfloat16 on AMX tiles. On this path's CPUs a decode step streams the cache from
// memory, and the vector code above neither overlaps that wait with its arithmetic nor gets
// near the read bandwidth (11-15 of 26-32 GB/s at 16 requests x 1,056 tokens): every
// instruction it saves is time saved. The tiles take both products:
//
//   scores^T [16 keys][16 columns] += K [16 keys][32 dims] . Q^T [32 dims][16 columns]
//     K is read in place (one tile load of 16 cache rows, the block's token stride apart; a
//     block holds whole 16-key chunks when its size is a multiple of 16), and a column is one
//     (KV head, query head) pair of the item, the others' Q^T entries zero;
//   out [16 columns][16 dims] += P^T [16 columns][32 keys] . V [32 keys][16 dims]
//     P^T is the transposed softmax in bf16, one copy per KV head with only that head's
//     columns set; V is repacked per 32 keys into the key-pair-interleaved layout the tile
//     product reads (its 16 dims come out in unpack order, put back when the row is written).
//
// The softmax runs on the scores' rows (all columns at once) in float32 between the two.
// Probabilities are rounded to bf16 for the second product, as in flash attention on a GPU.
// It takes window-less layers only, and items whose columns fit one tile (heads x group <= 16,
// split otherwise).

// Where lane i of the low/high unpack of two rows' 32 dims lands: dims 0-15 and 16-31.
alignas(64) constexpr int32_t kFromUnpackedLow[16] = {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23};
alignas(64) constexpr int32_t kFromUnpackedHigh[16] = {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31};

// Rows become columns in a 16 x 16 float block: blocks of b lanes trade places, b = 8, 4, 2, 1.
template <int b>
inline void swap_blocks(f16v* t) {
    for (int i = 0; i < kLanes; ++i) {
        if (i & b) continue;
        const f16v x = t[i], y = t[i + b];
        if constexpr (b == 8) {
            t[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
            t[i + b] = __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
        } else if constexpr (b == 4) {
            t[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
            t[i + b] = __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
        } else if constexpr (b == 2) {
            t[i] = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
            t[i + b] = __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
        } else {
            t[i] = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
            t[i + b] = __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
        }
    }
}

inline void transpose16(f16v* t) {
    swap_blocks<8>(t);
    swap_blocks<4>(t);
    swap_blocks<2>(t);
    swap_blocks<1>(t);
}

// Linux lends the tile registers to a process that asks (once; oneDNN asks too, but perhaps later).
bool tiles_permitted() {
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return permitted;
}

// Palette 1, tiles 0-5 all 16 rows of 64 bytes: 0-3 the output (or 0 the scores), 4-5 operands.
struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16};
};

template <int kVecs, int kGroup>
void decode_tiles(const c10::BFloat16* q, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                  c10::BFloat16* out, const int32_t* tables, int64_t max_blocks, const int32_t* cu_q,
                  const int32_t* seqlens_k, const std::vector<DecodeItem>& items, int64_t heads, int64_t kv_heads,
                  int64_t block_size, float scale, float softcap) {
    constexpr int64_t dim = kVecs * kLanes;
    constexpr int kSlices = kVecs / 2;        // 32-dim slices of a row: one K tile each
    constexpr int kHeadsPerTile = 16 / kGroup;  // KV heads whose columns share the tiles
    const int64_t token_stride = kv_heads * dim;
    const int64_t k_row_bytes = token_stride * static_cast<int64_t>(sizeof(c10::BFloat16));
    const __m512i from_low = _mm512_load_si512(kFromUnpackedLow);
    const __m512i from_high = _mm512_load_si512(kFromUnpackedHigh);
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
        const TileConfig config;
        _tile_loadconfig(&config);
        std::vector<f16v> scores;     // [keys, rounded up to 32][column]
        std::vector<uint16_t> q_t;    // [head][slice][16 dim pairs][16 columns][2], bf16 bits
        std::vector<uint16_t> p_t;    // [head][16 columns][p_stride]: only the head's columns set
        int64_t p_stride = 0;
        alignas(64) uint16_t v_pairs[4][16][32];  // 32 keys x 64 dims of one head, interleaved
        alignas(64) float o[4][16][16];           // [dim tile][column][dim, in unpack order]
        const auto run = [&](const DecodeItem& item, int64_t head0, int64_t n_heads) {
            const int64_t row = cu_q[item.req];
            const int64_t keys = seqlens_k[item.req];
            const int64_t padded = (keys + 31) / 32 * 32;
            const int64_t columns = n_heads * kGroup;
            const int32_t* table = tables + item.req * max_blocks;
            if (static_cast<int64_t>(scores.size()) < padded) scores.resize(padded);
            if (p_stride < padded) {  // rows outside a head's columns must stay zero: start over
                p_stride = std::max<int64_t>(padded, 2 * p_stride);
                p_t.assign(static_cast<size_t>(kHeadsPerTile) * 16 * p_stride, 0);
            }
            q_t.assign(n_heads * kSlices * 512, 0);
            for (int64_t col = 0; col < columns; ++col) {
                const uint16_t* src = reinterpret_cast<const uint16_t*>(q + (row * heads + head0 * kGroup + col) * dim);
                for (int c = 0; c < kSlices; ++c) {
                    uint16_t* b = q_t.data() + ((col / kGroup) * kSlices + c) * 512;
                    for (int r = 0; r < 16; ++r) {
                        b[r * 32 + col * 2] = src[c * 32 + 2 * r];
                        b[r * 32 + col * 2 + 1] = src[c * 32 + 2 * r + 1];
                    }
                }
            }
            // Scores, 16 keys a tile.
            for (int64_t base = 0; base < keys; base += kLanes) {
                const c10::BFloat16* k0 = k_cache + token_start(table, base, block_size, token_stride) + head0 * dim;
                _tile_zero(0);
                for (int64_t h = 0; h < n_heads; ++h) {
                    for (int c = 0; c < kSlices; ++c) {
                        _tile_loadd(4, k0 + h * dim + c * 32, k_row_bytes);
                        _tile_loadd(5, q_t.data() + (h * kSlices + c) * 512, 64);
                        _tile_dpbf16ps(0, 4, 5);
                    }
                }
                _tile_stored(0, scores.data() + base, 64);
            }
            // Softmax down every column; rows past the context get no weight.
            f16v top = f16v{} - std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j < keys; ++j) {
                f16v s = scores[j] * scale;
                if (softcap > 0.0f) s = capped(s, softcap);
                scores[j] = s;
                top = top > s ? top : s;
            }
            f16v total{};
            for (int64_t j = 0; j < keys; ++j) {
                scores[j] = exp_nonpositive(scores[j] - top);
                total += scores[j];
            }
            for (int64_t j = keys; j < padded; ++j) scores[j] = f16v{};
            const f16v inv = 1.0f / total;
            for (int64_t base = 0; base < padded; base += kLanes) {
                f16v t[kLanes];
                std::copy(scores.begin() + base, scores.begin() + base + kLanes, t);
                transpose16(t);
                for (int64_t col = 0; col < columns; ++col) {
                    const __m256bh p = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(t[col]));
                    std::memcpy(p_t.data() + ((col / kGroup) * 16 + col) * p_stride + base, &p, sizeof(p));
                }
            }
            // Weighted values, 64 dims (four output tiles) at a time, 32 keys a step.
            for (int64_t d0 = 0; d0 < dim; d0 += 64) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
                for (int64_t base = 0; base < keys; base += 32) {
                    const int64_t n = std::min<int64_t>(32, keys - base);
                    int64_t at[32];  // each key's row; keys past the context read as zeros
                    for (int64_t j = 0; j < n; j += kLanes) {
                        const int64_t first = token_start(table, base + j, block_size, token_stride);
                        for (int64_t i = 0; i < kLanes; ++i) at[j + i] = first + i * token_stride;
                    }
                    for (int64_t h = 0; h < n_heads; ++h) {
                        const int64_t offset = (head0 + h) * dim + d0;
                        const auto half_row = [&](int64_t j, int64_t half) {
                            return j < n ? _mm512_loadu_si512(v_cache + at[j] + offset + half * 32) : _mm512_setzero_si512();
                        };
                        for (int64_t r = 0; r < 16; ++r) {
                            for (int64_t half = 0; half < 2; ++half) {
                                const __m512i a = half_row(2 * r, half), b = half_row(2 * r + 1, half);
                                _mm512_store_si512(v_pairs[2 * half][r], _mm512_unpacklo_epi16(a, b));
                                _mm512_store_si512(v_pairs[2 * half + 1][r], _mm512_unpackhi_epi16(a, b));
                            }
                        }
                        _tile_loadd(4, p_t.data() + h * 16 * p_stride + base, p_stride * 2);
                        _tile_loadd(5, v_pairs[0], 64);
                        _tile_dpbf16ps(0, 4, 5);
                        _tile_loadd(5, v_pairs[1], 64);
                        _tile_dpbf16ps(1, 4, 5);
                        _tile_loadd(5, v_pairs[2], 64);
                        _tile_dpbf16ps(2, 4, 5);
                        _tile_loadd(5, v_pairs[3], 64);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, o[0], 64);
                _tile_stored(1, o[1], 64);
                _tile_stored(2, o[2], 64);
                _tile_stored(3, o[3], 64);
                for (int64_t col = 0; col < columns; ++col) {
                    c10::BFloat16* dst = out + (row * heads + head0 * kGroup + col) * dim + d0;
                    const __m512 norm = _mm512_set1_ps(inv[col]);
                    for (int half = 0; half < 2; ++half) {
                        const __m512 low = _mm512_load_ps(o[2 * half][col]), high = _mm512_load_ps(o[2 * half + 1][col]);
                        const __m512 first = _mm512_mul_ps(_mm512_permutex2var_ps(low, from_low, high), norm);
                        const __m512 second = _mm512_mul_ps(_mm512_permutex2var_ps(low, from_high, high), norm);
                        _mm512_storeu_si512(dst + half * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first)));
                    }
                }
            }
        };
        for (int64_t w = begin; w < end; ++w) {
            const DecodeItem& item = items[w];
            for (int64_t h = item.head0; h < item.head1; h += kHeadsPerTile) {
                run(item, h, std::min<int64_t>(kHeadsPerTile, item.head1 - h));
            }
        }
        _tile_release();
        // torch's brgemm (the prefill kernel) skips configuring tiles it believes still set.
        at::native::cpublas::brgemm_release();
    });
}
#endif

// The decode path's instances: float32 and bfloat16, head dims 64 and 128, 1 to 8 query heads per
// KV head; anything else goes through the tile path. Returns whether it took the items.
template <typename T>
bool try_decode(int64_t group, int64_t dim, const T* q, const T* k_cache, const T* v_cache, T* out,
                const int32_t* tables, int64_t max_blocks, const int32_t* cu_q, const int32_t* seqlens_k,
                const std::vector<DecodeItem>& items, int64_t heads, int64_t kv_heads, int64_t block_size,
                float scale, int64_t window, float softcap) {
    if (items.empty()) return true;
    if constexpr (kVectorLoads<T>) {
        bool taken = true;
        const auto run = [&](auto vecs_tag, auto group_tag) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if constexpr (std::is_same_v<T, c10::BFloat16>) {
                if (window == 0 && block_size % kLanes == 0 && tiles_permitted()) {
                    decode_tiles<decltype(vecs_tag)::value, decltype(group_tag)::value>(
                        q, k_cache, v_cache, out, tables, max_blocks, cu_q, seqlens_k, items, heads, kv_heads,
                        block_size, scale, softcap);
                    return;
                }
            }
#endif
            decode<T, decltype(vecs_tag)::value, decltype(group_tag)::value>(
                q, k_cache, v_cache, out, tables, max_blocks, cu_q, seqlens_k, items, heads, kv_heads, block_size,
                scale, window, softcap);
        };
        const auto for_group = [&](auto vecs_tag) {
            switch (group) {
                case 1: run(vecs_tag, std::integral_constant<int, 1>{}); break;
                case 2: run(vecs_tag, std::integral_constant<int, 2>{}); break;
                case 3: run(vecs_tag, std::integral_constant<int, 3>{}); break;
                case 4: run(vecs_tag, std::integral_constant<int, 4>{}); break;
                case 5: run(vecs_tag, std::integral_constant<int, 5>{}); break;
                case 6: run(vecs_tag, std::integral_constant<int, 6>{}); break;
                case 7: run(vecs_tag, std::integral_constant<int, 7>{}); break;
                case 8: run(vecs_tag, std::integral_constant<int, 8>{}); break;
                default: taken = false;
            }
        };
        if (dim == 64) {
            for_group(std::integral_constant<int, 4>{});
        } else if (dim == 128) {
            for_group(std::integral_constant<int, 8>{});
        } else {
            taken = false;
        }
        return taken;
    }
    return false;
}

// The decode items in an order that gives every thread about as many keys to read.
// at::parallel_for hands thread t the t-th run of ceil(n / threads) consecutive items (ATen's
// OpenMP backend), and an item's work is its request's visible keys. The scheduler keeps the
// requests oldest first, which says nothing of their lengths: 16 decode rows of which the first 8
// read 2,048 keys and the rest 128 took 36-42 ms a 30-layer pass on 2 threads, interleaved 23 ms.
// Longest first, each item goes to the run with the fewest keys so far that still has room.
std::vector<DecodeItem> balanced(const std::vector<DecodeItem>& items, const int32_t* seqlens_k, int64_t window,
                                 int64_t threads) {
    const int64_t n = static_cast<int64_t>(items.size());
    if (n <= 1 || threads <= 1) return items;
    const int64_t per_run = (n + std::min(threads, n) - 1) / std::min(threads, n);
    const int64_t runs = (n + per_run - 1) / per_run;
    const auto keys = [&](const DecodeItem& item) {
        const int64_t k = seqlens_k[item.req];
        return window > 0 ? std::min(k, window) : k;
    };
    std::vector<int64_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return keys(items[a]) > keys(items[b]); });
    std::vector<std::vector<DecodeItem>> run_items(runs);
    std::vector<int64_t> load(runs, 0);
    for (const int64_t i : order) {
        int64_t best = -1;
        for (int64_t r = 0; r < runs; ++r) {
            const int64_t room = std::min(per_run, n - r * per_run);
            if (static_cast<int64_t>(run_items[r].size()) < room && (best < 0 || load[r] < load[best])) best = r;
        }
        run_items[best].push_back(items[i]);
        load[best] += keys(items[i]);
    }
    std::vector<DecodeItem> out;
    out.reserve(n);
    for (const auto& run : run_items) out.insert(out.end(), run.begin(), run.end());
    return out;
}

}  // namespace

// out, q: [tokens, heads, dim]; k_cache, v_cache: [blocks, block_size, kv_heads, dim];
// block_tables: [requests, max_blocks] int32; cu_seqlens_q: [requests + 1] int32;
// seqlens_k: [requests] int32 (context length including the new tokens). Requests with more
// than max_query_len query rows are skipped: their rows of `out` are left to the caller.
// window: keys a row sees, its own included (0: all up to it); softcap: scores capped to
// softcap * tanh(s / softcap) (0: not capped).
void paged_attention(const torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                     const torch::Tensor& v_cache, const torch::Tensor& block_tables, const torch::Tensor& cu_seqlens_q,
                     const torch::Tensor& seqlens_k, double scale,
                     int64_t max_query_len, int64_t window, double softcap) {
    TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "paged_attention: q, out and the caches must be contiguous");
    TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt, "block_tables: contiguous int32");
    TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && seqlens_k.scalar_type() == at::kInt,
                "cu_seqlens_q and seqlens_k: int32");
    TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == out.scalar_type(),
                "q, out and the caches must share a dtype");
    const int64_t heads = q.size(1), dim = q.size(2);
    const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
    TORCH_CHECK(heads % kv_heads == 0 && k_cache.size(3) == dim, "paged_attention: head shapes do not match");
    TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention: window and softcap must not be negative");
    const float cap = static_cast<float>(softcap);
    const int64_t requests = seqlens_k.size(0);
    auto cu = cu_seqlens_q.contiguous();
    auto seq = seqlens_k.contiguous();
    const int32_t* cu_p = cu.data_ptr<int32_t>();
    const int32_t* seq_p = seq.data_ptr<int32_t>();
    std::vector<WorkItem> items;
    std::vector<int32_t> decodes;  // requests with one query row
    for (int32_t r = 0; r < requests; ++r) {
        const int32_t q_len = cu_p[r + 1] - cu_p[r];
        if (q_len > max_query_len) continue;
        if (q_len == 1) {
            decodes.push_back(r);
            continue;
        }
        for (int32_t row0 = 0; row0 < q_len; row0 += kRowTile) {
            for (int32_t h = 0; h < kv_heads; ++h) {
                items.push_back({r, h, row0, std::min<int32_t>(q_len, row0 + kRowTile)});
            }
        }
    }
    // A decode item takes all of a request's KV heads, or one when there are too few requests to
    // keep every thread busy.
    const int32_t heads_per_item =
        static_cast<int64_t>(decodes.size()) >= 2 * at::get_num_threads() ? static_cast<int32_t>(kv_heads) : 1;
    std::vector<DecodeItem> decode_items;
    for (const int32_t r : decodes) {
        for (int32_t h = 0; h < kv_heads; h += heads_per_item) decode_items.push_back({r, h, h + heads_per_item});
    }
    decode_items = balanced(decode_items, seq_p, window, at::get_num_threads());
    const int64_t group = heads / kv_heads;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
        if (!try_decode<scalar_t>(group, dim, q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                  v_cache.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                  block_tables.data_ptr<int32_t>(), block_tables.size(1), cu_p, seq_p, decode_items,
                                  heads, kv_heads, block_size, static_cast<float>(scale), window, cap)) {
            for (const DecodeItem& d : decode_items) {
                for (int32_t h = d.head0; h < d.head1; ++h) items.push_back({d.req, h, 0, 1});
            }
        }
        const bool shaped = window > 0 || cap > 0.0f;
        auto run = [&](auto vecs_tag) {
            const auto with = [&](auto shaped_tag) {
                attend<scalar_t, decltype(vecs_tag)::value, decltype(shaped_tag)::value>(
                    q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                    out.data_ptr<scalar_t>(), block_tables.data_ptr<int32_t>(), block_tables.size(1), cu_p, seq_p,
                    items, heads, kv_heads, dim, block_size, static_cast<float>(scale), window, cap);
            };
            if (shaped) {
                with(std::true_type{});
            } else {
                with(std::false_type{});
            }
        };
        if (dim == 64) {
            run(std::integral_constant<int, 4>{});
        } else if (dim == 128) {
            run(std::integral_constant<int, 8>{});
        } else {
            run(std::integral_constant<int, 0>{});
        }
    });
}

// Also a torch operator, for C++ callers that hold no Python (kernels/cpu/layer_stack.cpp).
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
    m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
          "Tensor cu_seqlens_q, Tensor seqlens_k, float scale, int max_query_len, int window, float softcap) -> ()",
          &paged_attention);
}

// Whether bfloat16 decode rows go through the AMX tile path (built for AMX, tiles lent by the OS).
bool decodes_on_tiles() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    return tiles_permitted();
#else
    return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("paged_attention", &paged_attention, "paged attention over the KV block table (CPU)");
    m.def("decodes_on_tiles", &decodes_on_tiles, "whether bfloat16 decode rows use AMX tiles");
}
