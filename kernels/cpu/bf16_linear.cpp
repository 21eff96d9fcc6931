// bfloat16 linear layers on CPUs with AVX512-BF16 and no AMX: every step, from one decode row to
// a 2,048-token prefill, on the weight in a layout of its own, packed once at load.
//
// The layout: 16 output columns x 2 input dims a vector (the pairs `vdpbf16ps` multiplies), two
// such column blocks side by side, so that one broadcast of a row's input pair feeds both: 8 rows
// x 32 columns = 16 accumulators in registers. A work item is a block of up to 256 rows against
// two column blocks, so that its inputs stay in cache over the column blocks. Sums are float32
// (products of two bf16 are exact in float32), rounded to bfloat16 once, after the bias: the
// numbers F.linear gives up to the order of the sums.
//
// Against oneDNN's prepacked matmul on a 2-core Zen 4 (the default model's 120 layer linears):
// at 16 rows it neither streams the weights at the copy bandwidth nor multiplies near the CPU's
// peak (14.0-14.8 ms cold; this kernel 11.7); at 2,048 rows it ran at 419-430 GFLOP/s, this
// kernel at 439-448 (of a measured peak of ~467). So it takes every row count, and the model
// keeps only this copy of its weights.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kCols = 16;       // output columns of a vector
constexpr int64_t kBlockCols = 32;  // two vectors: a work item's columns
constexpr int kRowTile = 8;         // rows whose accumulators live in registers at once
constexpr int64_t kRowBlock = 256;  // rows of a work item
// Up to this many rows (decode steps) a work item's weights come from memory for little
// arithmetic, and the hardware prefetcher leaves the memory idle while the item's later row tiles
// multiply from cache; asking for the next item's weights meanwhile took the default model's 120
// layer linears (cold, one process alternating pass by pass) from 14.6-16.8 to 11.8-12.3 ms at
// 16 rows, 9.7 to 8.6 at 1, 25.5 to 21.6 at 32. Larger blocks multiply long enough to hide the
// stream, and the prefetches only cost them (256 rows +2%, 2,048 rows +7%).
constexpr int64_t kPrefetchRows = 64;

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

int64_t padded_columns(int64_t n) { return (n + kBlockCols - 1) / kBlockCols * kBlockCols; }

// weight [N, K] -> its blocks [ceil(N / 32) * 2][K / 2][16][2] (column block b, input pair k,
// column c, then the pair; columns past N zeros), returned as an [N, K] tensor over that storage,
// as oneDNN's packed weights are: its size still says the layer's shape. K must be even.
torch::Tensor pack(const torch::Tensor& weight) {
    TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "bf16_linear: a 2-d bf16 weight");
    const int64_t n = weight.size(0), k = weight.size(1);
    TORCH_CHECK(k % 2 == 0, "bf16_linear: an even number of input features");
    const int64_t padded = padded_columns(n);
    const auto w = at::constant_pad_nd(weight, {0, 0, 0, padded - n});
    const auto blocks = w.view({padded / kCols, kCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
    return blocks.view(-1).as_strided({n, k}, {k, 1});
}

#if defined(__AVX512BF16__)
// Rows [0, R) of x against column blocks `block` and `block + 1`; with kPrefetch, the next work
// item's two blocks are asked into L2 along the way (see kPrefetchRows).
template <int R, bool kPrefetch>
void tile(const at::BFloat16* x, int64_t k, const at::BFloat16* packed, const at::BFloat16* bias,
          at::BFloat16* out, int64_t n, int64_t block) {
    const int64_t pairs = k / 2;
    const __m512i* w0 = reinterpret_cast<const __m512i*>(packed) + block * pairs;
    const __m512i* w1 = w0 + pairs;
    const int32_t* xp = reinterpret_cast<const int32_t*>(x);
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
        if constexpr (kPrefetch) {  // (past the last block: a prefetch never faults)
            _mm_prefetch(reinterpret_cast<const char*>(w1 + pairs + p), _MM_HINT_T1);
            _mm_prefetch(reinterpret_cast<const char*>(w1 + 2 * pairs + p), _MM_HINT_T1);
        }
        const __m512bh u = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + p));
        const __m512bh v = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + p));
        for (int r = 0; r < R; ++r) {
            const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[r * pairs + p]));
            a0[r] = _mm512_dpbf16_ps(a0[r], b, u);
            a1[r] = _mm512_dpbf16_ps(a1[r], b, v);
        }
    }
    const int64_t col0 = block * kCols;
    // The columns from `col` on that exist, of a vector's 16 (the packed weight pads N to a
    // multiple of 32).
    const auto existing = [n](int64_t col) {
        const int64_t left = n - col;
        return static_cast<__mmask16>(left <= 0 ? 0 : left >= kCols ? 0xFFFF : (1u << left) - 1);
    };
    const __mmask16 m0 = existing(col0), m1 = existing(col0 + kCols);
    // The bias's columns, bf16 widened (its bits shifted to the top half of a float32), or zeros.
    const auto bias_at = [bias](int64_t col, __mmask16 mask) {
        if (bias == nullptr) return _mm512_setzero_ps();
        const auto* bits = reinterpret_cast<const uint16_t*>(bias + col);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bits)), 16));
    };
    const __m512 b0 = bias_at(col0, m0), b1 = bias_at(col0 + kCols, m1);
    for (int r = 0; r < R; ++r) {
        auto* dst = reinterpret_cast<uint16_t*>(out + r * n + col0);
        _mm256_mask_storeu_epi16(dst, m0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(a0[r], b0))));
        _mm256_mask_storeu_epi16(dst + kCols, m1,
                                 reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(a1[r], b1))));
    }
}

// `rows` rows: tiles of R while they last, the rest in tiles of R / 2, R / 4, ...
template <int R, bool kPrefetch>
void rows_of(int64_t rows, const at::BFloat16* x, int64_t k, const at::BFloat16* packed, const at::BFloat16* bias,
             at::BFloat16* out, int64_t n, int64_t block) {
    for (; rows >= R; rows -= R, x += R * k, out += R * n) tile<R, kPrefetch>(x, k, packed, bias, out, n, block);
    if constexpr (R > 1) {
        if (rows > 0) rows_of<R / 2, kPrefetch>(rows, x, k, packed, bias, out, n, block);
    }
}
#endif

// x [M, K] bf16, packed from pack(weight [N, K]); bias [N] or none. Returns [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const std::optional<torch::Tensor>& bias) {
    TORCH_CHECK(available(), "bf16_linear: built without AVX512-BF16");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
                "bf16_linear: x is a contiguous 2-d bf16 tensor");
    const int64_t m = x.size(0), k = x.size(1);
    TORCH_CHECK(packed.dim() == 2 && packed.size(1) == k && packed.scalar_type() == at::kBFloat16,
                "bf16_linear: the packed weight does not match x");
    const int64_t n = packed.size(0);
    // The storage of pack()'s padded blocks (a weight as loaded has N x K values: this catches it
    // where N is not a multiple of 32).
    TORCH_CHECK(packed.storage_offset() == 0 &&
                    packed.storage().nbytes() == static_cast<size_t>(padded_columns(n) * k * 2),
                "bf16_linear: the weight was not packed by bf16_linear.pack");
    TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == at::kBFloat16),
                "bf16_linear: bias is n contiguous bf16 values");
    auto out = torch::empty({m, n}, x.options());
    if (m == 0) return out;
#if defined(__AVX512BF16__)
    const auto* xp = x.data_ptr<at::BFloat16>();
    const auto* wp = packed.data_ptr<at::BFloat16>();
    const at::BFloat16* bp = bias ? bias->data_ptr<at::BFloat16>() : nullptr;
    auto* op = out.data_ptr<at::BFloat16>();
    const int64_t column_items = padded_columns(n) / kBlockCols;
    // The rows split evenly over the fewest blocks of at most kRowBlock (a multiple of the
    // register tile each). The threads take contiguous runs of work items, so blocks of unequal
    // rows are unequal work: a step of 256 prefill rows and 2 decode rows, cut 256 + 2, left one
    // core multiplying alone (the default model's linears took 244 ms instead of 134).
    const int64_t fewest_blocks = (m + kRowBlock - 1) / kRowBlock;
    const int64_t block_rows = ((m + fewest_blocks - 1) / fewest_blocks + kRowTile - 1) / kRowTile * kRowTile;
    const int64_t items = (m + block_rows - 1) / block_rows * column_items;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {  // row blocks outer: a thread's items share inputs
            const int64_t row0 = i / column_items * block_rows, rows = std::min(block_rows, m - row0);
            const int64_t block = 2 * (i % column_items);
            if (rows <= kPrefetchRows) {
                rows_of<kRowTile, true>(rows, xp + row0 * k, k, wp, bp, op + row0 * n, n, block);
            } else {
                rows_of<kRowTile, false>(rows, xp + row0 * k, k, wp, bp, op + row0 * n, n, block);
            }
        }
    });
#endif
    return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
    m.def("bf16_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor", &linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("available", &available, "whether the build has the kernel (AVX512-BF16)");
    m.def("preferred", &preferred, "whether to take it over oneDNN on this CPU (AVX512-BF16, no AMX)");
    m.def("pack", &pack, "a [N, K] bf16 weight in the kernel's layout");
}
