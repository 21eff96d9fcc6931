// bfloat16 linear layers of a few rows (a decode step's) on CPUs with AVX512-BF16.
//
// At 16 rows oneDNN's prepacked matmul neither streams the weights at the copy bandwidth nor
// multiplies near the CPU's peak (on a 2-core Zen 4: the default model's 120 linears 14.0-14.8
// ms cold, 10.8 warm; at one row 11.6 ms, ~18 GB/s of weights). This kernel reads each weight
// once per 8 rows in its own layout: 16 output columns x 2 input dims a vector (the pairs
// `vdpbf16ps` multiplies), two such column blocks side by side, so that one broadcast of a row's
// input pair feeds both. 8 rows x 32 columns = 16 accumulators. Sums are float32 (products of
// two bf16 are exact in float32), rounded to bfloat16 once, after the bias: the numbers F.linear
// gives up to the order of the sums.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 16;         // output columns of a vector
constexpr int64_t kBlockCols = 32;    // two vectors: a work item's columns
constexpr int64_t kMaxRows = 16;      // rows the kernel takes; more go to oneDNN
constexpr int kRowTile = 8;           // rows whose accumulators live in registers at once

bool available() {
#if defined(__AVX512BF16__)
    return true;
#else
    return false;
#endif
}

// Whether the engine should take it over oneDNN: measured faster on AVX512-BF16 without AMX; on
// AMX CPUs oneDNN multiplies on tiles, which this kernel has not been measured against. (The
// build targets the host CPU, so its AMX macro says what the CPU has.)
bool preferred() {
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
    return true;
#else
    return false;
#endif
}

// weight [N, K] -> [ceil(N / 32) * 2][K / 2][16][2]: column block b, input pair k, column c,
// then the pair; columns past N are zeros. K must be even.
torch::Tensor pack(const torch::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "few_rows_linear: a 2-d bf16 weight");
    const int64_t n = weight.size(0), k = weight.size(1);
    TORCH_CHECK(k % 2 == 0, "few_rows_linear: an even number of input features");
    const int64_t padded = (n + kBlockCols - 1) / kBlockCols * kBlockCols;
    const auto w = at::constant_pad_nd(weight, {0, 0, 0, padded - n});
    return w.view({padded / kCols, kCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)
// Rows [0, R) of x against column blocks `block` and `block + 1`.
template <int R>
void tile(const at::BFloat16* x, int64_t k, const at::BFloat16* packed, const at::BFloat16* bias,
          at::BFloat16* out, int64_t n, int64_t block) {
    const int64_t pairs = k / 2;
    const __m512i* w0 = reinterpret_cast<const __m512i*>(packed) + block * pairs;
    const __m512i* w1 = w0 + pairs;
    const int32_t* xp = reinterpret_cast<const int32_t*>(x);
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        const __m512bh u = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + p));
        const __m512bh v = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + p));
        for (int r = 0; r < R; ++r) {
            const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[r * pairs + p]));
            a0[r] = _mm512_dpbf16_ps(a0[r], b, u);
            a1[r] = _mm512_dpbf16_ps(a1[r], b, v);
        }
    }
    const int64_t col0 = block * kCols;
    // Columns of each vector that exist (the packed weight pads N to a multiple of 32).
    const __mmask16 m0 = static_cast<__mmask16>(col0 >= n ? 0 : n - col0 >= kCols ? 0xFFFF : (1u << (n - col0)) - 1);
    const __mmask16 m1 =
        static_cast<__mmask16>(col0 + kCols >= n ? 0 : n - col0 - kCols >= kCols ? 0xFFFF : (1u << (n - col0 - kCols)) - 1);
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias != nullptr) {  // bf16 widened: its bits shifted to the top half of a float32
        const auto* bits = reinterpret_cast<const uint16_t*>(bias + col0);
        b0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m0, bits)), 16));
        b1 = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m1, bits + kCols)), 16));
    }
    for (int r = 0; r < R; ++r) {
        auto* dst = reinterpret_cast<uint16_t*>(out + r * n + col0);
        _mm256_mask_storeu_epi16(dst, m0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(a0[r], b0))));
        _mm256_mask_storeu_epi16(dst + kCols, m1,
                                 reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(a1[r], b1))));
    }
}

template <int R>
void rows_of(int64_t rows, const at::BFloat16* x, int64_t k, const at::BFloat16* packed, const at::BFloat16* bias,
             at::BFloat16* out, int64_t n, int64_t block) {
    if constexpr (R > 0) {
        if (rows >= R) {
            tile<R>(x, k, packed, bias, out, n, block);
            rows_of<R>(rows - R, x + R * k, k, packed, bias, out + R * n, n, block);
        } else {
            rows_of<R / 2>(rows, x, k, packed, bias, out, n, block);
        }
    }
}
#endif

// x [M, K] bf16 (M <= 16), packed from pack(weight [N, K]); bias [N] or none. Returns [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const std::optional<torch::Tensor>& bias,
                     int64_t n) {
    TORCH_CHECK(available(), "few_rows_linear: built without AVX512-BF16");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
                "few_rows_linear: x is a contiguous 2-d bf16 tensor");
    const int64_t m = x.size(0), k = x.size(1);
    TORCH_CHECK(m <= kMaxRows, "few_rows_linear: at most ", kMaxRows, " rows");
    TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(1) * 2 == k &&
                    packed.size(0) * kCols >= n && packed.size(0) % 2 == 0,
                "few_rows_linear: the packed weight does not match x and n");
    TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == at::kBFloat16),
                "few_rows_linear: bias is n contiguous bf16 values");
    auto out = torch::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
    const auto* xp = x.data_ptr<at::BFloat16>();
    const auto* wp = packed.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
    auto* op = out.data_ptr<at::BFloat16>();
    const int64_t items = (n + kBlockCols - 1) / kBlockCols;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) rows_of<kRowTile>(m, xp, k, wp, bp, op, n, 2 * i);
    });
#endif
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
    m.def("few_rows_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("available", &available, "whether the build has the kernel (AVX512-BF16)");
    m.def("preferred", &preferred, "whether to take it over oneDNN on this CPU (AVX512-BF16, no AMX)");
    m.def("pack", &pack, "a [N, K] bf16 weight in the kernel's layout");
    m.def("linear", &linear, "x @ weight.T + bias for at most 16 rows of bf16 (CPU, AVX512-BF16)");
    m.attr("MAX_ROWS") = kMaxRows;
}
