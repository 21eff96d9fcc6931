// Weight-only int8 linear layers on the CPU: int8 weights with float32 scales per output column
// and group of input dims (a group of the whole row: per-channel; of 32: GGUF's Q8_0), bf16 or
// float32 activations, float32 sums. Decode is bound by reading the weights; these are half the
// bytes of bf16's.
//
// The layout is bf16_linear's, in int8: 16 output columns x 2 input dims a 32-byte step (column
// block b, input pair p, column c, then the pair), columns padded to a multiple of 32 with zeros,
// two column blocks a work item. The scales: [column block][group][16] float32.
//
// bf16 activations (AVX512-BF16): each 32-byte step is widened to 32 bf16 in registers (an int8
// is exact in bf16) and multiplied by `vdpbf16ps` as bf16_linear does, the pair's products exact
// in float32; a group's sum is then scaled into the column's float32 total. So a row's numbers are
// the float32 matmul of the de-quantized weights up to the order of the sums. The widening is
// done again for every tile of rows, which prefill pays for (~5 instructions per 8 rows' 16).
// float32 activations: the same steps widened to float32 and multiplied with FMAs, pairs summed at
// the end. Without AVX512-BF16 (or for a check of the vector code) a portable loop over the same
// layout, which the compiler vectorizes for the build's target.
//
// The vector code is compiled for AVX512 whatever the build's target (function attributes) and
// chosen at run time from the CPU's own flags, so an image built for x86-64-v3 still takes it.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDSERVE_X86 1
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#endif

namespace {

constexpr int64_t kCols = 16;       // output columns of a vector
constexpr int64_t kBlockCols = 32;  // two column blocks: a work item's columns
constexpr int64_t kStep = 32;       // bytes of one input pair of one column block
constexpr int64_t kRowBlock = 256;  // rows of a work item
// As in bf16_linear: at decode row counts a work item multiplies from cache for little
// arithmetic, so the next item's weights are asked for meanwhile.
constexpr int64_t kPrefetchRows = 64;

bool vector_path() {
#if defined(PAGEDSERVE_X86)
    static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                            __builtin_cpu_supports("avx512bf16");
    return has;
#else
    return false;
#endif
}

int64_t padded_columns(int64_t n) { return (n + kBlockCols - 1) / kBlockCols * kBlockCols; }

struct Weights {
    const int8_t* q;       // [padded / 16][pairs][16][2]
    const float* scales;   // [padded / 16][groups][16]
    const float* bias;     // [n] or null
    int64_t n, k, pairs, groups, group_pairs;
};

// ---- portable ------------------------------------------------------------------------------

template <typename T>
void portable_block(const T* x, int64_t rows, const Weights& w, T* out, int64_t block) {
    const int64_t col0 = block * kCols;
    if (col0 >= w.n) return;
    const int64_t cols = std::min(kCols, w.n - col0);
    const int8_t* q = w.q + block * w.pairs * kStep;
    const float* s = w.scales + block * w.groups * kCols;
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * w.k;
        float total[kCols] = {};
        for (int64_t g = 0; g < w.groups; ++g) {
            float sum[kCols] = {};
            for (int64_t p = g * w.group_pairs; p < (g + 1) * w.group_pairs; ++p) {
                const float x0 = static_cast<float>(xr[2 * p]), x1 = static_cast<float>(xr[2 * p + 1]);
                const int8_t* step = q + p * kStep;
                for (int64_t c = 0; c < kCols; ++c) sum[c] += x0 * step[2 * c] + x1 * step[2 * c + 1];
            }
            for (int64_t c = 0; c < kCols; ++c) total[c] += sum[c] * s[g * kCols + c];
        }
        for (int64_t c = 0; c < cols; ++c) {
            out[r * w.n + col0 + c] = static_cast<T>(total[c] + (w.bias ? w.bias[col0 + c] : 0.0f));
        }
    }
}

template <typename T>
void portable_item(const T* x, int64_t rows, const Weights& w, T* out, int64_t block) {
    portable_block(x, rows, w, out, block);
    portable_block(x, rows, w, out, block + 1);
}

#if defined(PAGEDSERVE_X86)
// ---- AVX512: bf16 activations ----------------------------------------------------------------

// The columns from `col` on that exist, of a vector's 16.
AVX512_TARGET inline __mmask16 existing(int64_t n, int64_t col) {
    const int64_t left = n - col;
    return static_cast<__mmask16>(left <= 0 ? 0 : left >= kCols ? 0xFFFF : (1u << left) - 1);
}

AVX512_TARGET inline __m512 bias_at(const float* bias, int64_t col, __mmask16 mask) {
    return bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + col);
}

// One 32-byte step as 32 bf16 in the pair order `vdpbf16ps` reads.
AVX512_TARGET inline __m512bh widen_bf16(const int8_t* step) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

// Rows [0, R) of x against column blocks `block` and `block + 1`. kGrouped: more than one group
// (a group's sums are scaled into the totals after it), else the scale is applied once at the end.
// R is 8 without groups and 4 with them: their sums take another set of registers.
template <int R, bool kGrouped, bool kPrefetch>
AVX512_TARGET void tile_bf16(const at::BFloat16* x, const Weights& w, at::BFloat16* out, int64_t block) {
    const int8_t* q0 = w.q + block * w.pairs * kStep;
    const int8_t* q1 = q0 + w.pairs * kStep;
    const float* s0 = w.scales + block * w.groups * kCols;
    const float* s1 = s0 + w.groups * kCols;
    const int32_t* xp = reinterpret_cast<const int32_t*>(x);
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
        __m512 g0[R], g1[R];
        for (int r = 0; r < R; ++r) g0[r] = g1[r] = _mm512_setzero_ps();
        __m512* acc0 = kGrouped ? g0 : a0;
        __m512* acc1 = kGrouped ? g1 : a1;
        const int64_t end = (g + 1) * w.group_pairs;
        for (int64_t p = g * w.group_pairs; p < end; ++p) {
            if constexpr (kPrefetch) {  // the next item's two blocks, a 64-byte line per two pairs
                if ((p & 1) == 0) {
                    _mm_prefetch(reinterpret_cast<const char*>(q1 + (w.pairs + p) * kStep), _MM_HINT_T1);
                    _mm_prefetch(reinterpret_cast<const char*>(q1 + (2 * w.pairs + p) * kStep), _MM_HINT_T1);
                }
            }
            const __m512bh u = widen_bf16(q0 + p * kStep);
            const __m512bh v = widen_bf16(q1 + p * kStep);
            for (int r = 0; r < R; ++r) {
                const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[r * w.pairs + p]));
                acc0[r] = _mm512_dpbf16_ps(acc0[r], b, u);
                acc1[r] = _mm512_dpbf16_ps(acc1[r], b, v);
            }
        }
        if constexpr (kGrouped) {
            const __m512 sc0 = _mm512_loadu_ps(s0 + g * kCols), sc1 = _mm512_loadu_ps(s1 + g * kCols);
            for (int r = 0; r < R; ++r) {
                a0[r] = _mm512_fmadd_ps(g0[r], sc0, a0[r]);
                a1[r] = _mm512_fmadd_ps(g1[r], sc1, a1[r]);
            }
        }
    }
    const int64_t col0 = block * kCols;
    const __mmask16 m0 = existing(w.n, col0), m1 = existing(w.n, col0 + kCols);
    const __m512 b0 = bias_at(w.bias, col0, m0), b1 = bias_at(w.bias, col0 + kCols, m1);
    const __m512 sc0 = _mm512_loadu_ps(s0), sc1 = _mm512_loadu_ps(s1);
    for (int r = 0; r < R; ++r) {
        const __m512 y0 = kGrouped ? _mm512_add_ps(a0[r], b0) : _mm512_fmadd_ps(a0[r], sc0, b0);
        const __m512 y1 = kGrouped ? _mm512_add_ps(a1[r], b1) : _mm512_fmadd_ps(a1[r], sc1, b1);
        auto* dst = reinterpret_cast<uint16_t*>(out + r * w.n + col0);
        _mm256_mask_storeu_epi16(dst, m0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y0)));
        _mm256_mask_storeu_epi16(dst + kCols, m1, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y1)));
    }
}

template <int R, bool kGrouped, bool kPrefetch>
AVX512_TARGET void rows_bf16(int64_t rows, const at::BFloat16* x, const Weights& w, at::BFloat16* out,
                             int64_t block) {
    for (; rows >= R; rows -= R, x += R * w.k, out += R * w.n) tile_bf16<R, kGrouped, kPrefetch>(x, w, out, block);
    if constexpr (R > 1) {
        if (rows > 0) rows_bf16<R / 2, kGrouped, kPrefetch>(rows, x, w, out, block);
    }
}

template <bool kPrefetch>
AVX512_TARGET void item_bf16(int64_t rows, const at::BFloat16* x, const Weights& w, at::BFloat16* out,
                             int64_t block) {
    if (w.groups > 1) {
        rows_bf16<4, true, kPrefetch>(rows, x, w, out, block);
    } else {
        rows_bf16<8, false, kPrefetch>(rows, x, w, out, block);
    }
}

// ---- AVX512: float32 activations --------------------------------------------------------------

// Rows [0, R) against one column block. A step widens to two float32 vectors, columns 0-7 and
// 8-15 with their two inputs side by side, multiplied by the row's input pair repeated; each
// column's two lanes are added at the end.
template <int R>
AVX512_TARGET void tile_f32(const float* x, const Weights& w, float* out, int64_t block) {
    const int8_t* q = w.q + block * w.pairs * kStep;
    const float* s = w.scales + block * w.groups * kCols;
    // A column's scale to both of its lanes.
    const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
        __m512 glo[R], ghi[R];
        for (int r = 0; r < R; ++r) glo[r] = ghi[r] = _mm512_setzero_ps();
        const int64_t end = (g + 1) * w.group_pairs;
        for (int64_t p = g * w.group_pairs; p < end; ++p) {
            const int8_t* step = q + p * kStep;
            const __m512 wlo =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step))));
            const __m512 whi =
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16))));
            for (int r = 0; r < R; ++r) {
                double pair;  // the row's two inputs, repeated across the vector
                std::memcpy(&pair, x + r * w.k + 2 * p, sizeof(pair));
                const __m512 b = _mm512_castpd_ps(_mm512_set1_pd(pair));
                glo[r] = _mm512_fmadd_ps(b, wlo, glo[r]);
                ghi[r] = _mm512_fmadd_ps(b, whi, ghi[r]);
            }
        }
        const __m512 sc = _mm512_loadu_ps(s + g * kCols);
        const __m512 slo = _mm512_permutexvar_ps(dup_lo, sc), shi = _mm512_permutexvar_ps(dup_hi, sc);
        for (int r = 0; r < R; ++r) {
            lo[r] = _mm512_fmadd_ps(glo[r], slo, lo[r]);
            hi[r] = _mm512_fmadd_ps(ghi[r], shi, hi[r]);
        }
    }
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const int64_t col0 = block * kCols;
    const __mmask16 m = existing(w.n, col0);
    const __m512 bias = bias_at(w.bias, col0, m);
    for (int r = 0; r < R; ++r) {
        const __m512 y = _mm512_add_ps(_mm512_permutex2var_ps(lo[r], even, hi[r]),
                                       _mm512_permutex2var_ps(lo[r], odd, hi[r]));
        _mm512_mask_storeu_ps(out + r * w.n + col0, m, _mm512_add_ps(y, bias));
    }
}

template <int R>
AVX512_TARGET void rows_f32(int64_t rows, const float* x, const Weights& w, float* out, int64_t block) {
    for (; rows >= R; rows -= R, x += R * w.k, out += R * w.n) tile_f32<R>(x, w, out, block);
    if constexpr (R > 1) {
        if (rows > 0) rows_f32<R / 2>(rows, x, w, out, block);
    }
}

AVX512_TARGET void item_f32(int64_t rows, const float* x, const Weights& w, float* out, int64_t block) {
    rows_f32<4>(rows, x, w, out, block);
    if ((block + 1) * kCols < w.n) rows_f32<4>(rows, x, w, out, block + 1);
}
#endif

// x [M, K] bf16 or float32; q [n, K] int8 and scales [n, groups] float32 as int8_layout.pack
// lays them out (views of the padded blocks, as bf16_linear's packed weight is: their sizes say
// the layer's shape); bias [n] float32 or none. Returns [M, n] in x's dtype. `vector`: the
// AVX512 code (where the CPU has it), else the portable loop.
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                  const std::optional<torch::Tensor>& bias, bool vector) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                "int8_linear: x is a contiguous 2-d bf16 or float32 tensor");
    const int64_t m = x.size(0), k = x.size(1);
    TORCH_CHECK(k % 2 == 0, "int8_linear: an even number of input features");
    TORCH_CHECK(q.dim() == 2 && q.size(1) == k && q.size(0) > 0 && q.scalar_type() == at::kChar &&
                    q.storage_offset() == 0 &&
                    q.storage().nbytes() == static_cast<size_t>(padded_columns(q.size(0)) * k),
                "int8_linear: q is the [n, k] int8 weight as int8_layout.pack lays it out, k as x's");
    const int64_t n = q.size(0);
    TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) > 0 && scales.scalar_type() == at::kFloat &&
                    k % scales.size(1) == 0 && (k / scales.size(1)) % 2 == 0 && scales.storage_offset() == 0 &&
                    scales.storage().nbytes() == static_cast<size_t>(padded_columns(n) * scales.size(1) * 4),
                "int8_linear: scales are [n, groups] float32 as int8_layout.pack lays them out, groups of an "
                "even size");
    TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == at::kFloat),
                "int8_linear: bias is n contiguous float32 values");
    auto out = torch::empty({m, n}, x.options());
    if (m == 0) return out;
    const int64_t groups = scales.size(1);
    const Weights w{q.data_ptr<int8_t>(), scales.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr,
                    n, k, k / 2, groups, k / groups / 2};
    const bool fast = vector && vector_path();
    const bool is_bf16 = x.scalar_type() == at::kBFloat16;
    const int64_t column_items = padded_columns(n) / kBlockCols;
    // Rows split evenly over the fewest blocks of at most kRowBlock (see bf16_linear: blocks of
    // unequal rows are unequal work for the thread that takes them).
    const int64_t fewest_blocks = (m + kRowBlock - 1) / kRowBlock;
    const int64_t block_rows = ((m + fewest_blocks - 1) / fewest_blocks + 7) / 8 * 8;
    const int64_t items = (m + block_rows - 1) / block_rows * column_items;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {  // row blocks outer: a thread's items share inputs
            const int64_t row0 = i / column_items * block_rows, rows = std::min(block_rows, m - row0);
            const int64_t block = 2 * (i % column_items);
            if (is_bf16) {
                const auto* xp = x.data_ptr<at::BFloat16>() + row0 * k;
                auto* op = out.data_ptr<at::BFloat16>() + row0 * n;
#if defined(PAGEDSERVE_X86)
                if (fast) {
                    if (rows <= kPrefetchRows) {
                        item_bf16<true>(rows, xp, w, op, block);
                    } else {
                        item_bf16<false>(rows, xp, w, op, block);
                    }
                    continue;
                }
#endif
                portable_item(xp, rows, w, op, block);
            } else {
                const auto* xp = x.data_ptr<float>() + row0 * k;
                auto* op = out.data_ptr<float>() + row0 * n;
#if defined(PAGEDSERVE_X86)
                if (fast) {
                    item_f32(rows, xp, w, op, block);
                    continue;
                }
#endif
                portable_item(xp, rows, w, op, block);
            }
        }
    });
    return out;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                     const std::optional<torch::Tensor>& bias) {
    return run(x, q, scales, bias, true);
}

torch::Tensor linear_portable(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                              const std::optional<torch::Tensor>& bias) {
    return run(x, q, scales, bias, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
    m.def("int8_linear(Tensor x, Tensor q, Tensor scales, Tensor? bias) -> Tensor", &linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("vector_path", &vector_path, "whether this CPU takes the AVX512-BF16 code");
    m.def("linear_portable", &linear_portable, "the portable loop, whatever the CPU has (for checks)");
}
