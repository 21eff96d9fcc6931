// Weight-only quantized linear layers on the CPU: 8-bit or 4-bit integer weights with float32
// scales (and, optionally, mins) per output column and group of input dims, bf16 or float32
// activations, float32 sums. A weight's value is q * scale (+ min): int8 (q in -127..127, the
// group the whole row, or 32 as GGUF's Q8_0), or 4-bit (q in 0..15, groups of 32: GGUF's Q4_1
// with its min, Q4_0 with min = -8 * scale). Decode is bound by reading the weights: these are
// half (int8) or about a third (4-bit, with its scales) of bf16's bytes.
//
// The layout is bf16_linear's: 16 output columns x 2 input dims a step (column block b, input
// pair p, column c, then the pair), columns padded to a multiple of 32 with zeros, two column
// blocks a work item. An 8-bit step is 32 bytes; a 4-bit step 16, byte j holding value j in its
// low nibble and value j + 16 in its high one, so that two masks give the 8-bit step back. The
// scales and mins: [column block][group][16] float32.
//
// bf16 activations (AVX512-BF16): each step is widened to 32 bf16 in registers (a small integer
// is exact in bf16; a 4-bit one is widened as 128 + q, one OR of its nibble into a bf16
// exponent, the offset taken out with the min) and multiplied by `vdpbf16ps` as bf16_linear
// does, the pair's products exact in float32; a group's sum is then scaled into the column's
// float32 total, and its min times the group's sum of the row's inputs added. So a row's numbers
// are the float32 matmul of the de-quantized weights up to the order of the sums (and, for
// 4-bit, the rounding of sums that carry 128 x each input: measured within 2^-18 of the sums'
// magnitudes, tests/kernels/cpu/test_cpu_quant_widening.py). The widening is done again for
// every tile of 8 rows; past 64 rows a work item's weights are instead de-quantized once into
// bf16 and multiplied as bf16_linear multiplies, each weight then rounded to bf16. float32 activations:
// the steps widened to float32 and multiplied with FMAs, each column's two lanes added at the end.
// Without AVX512-BF16 (or to check the vector code) a portable loop over the same layout, which
// the compiler vectorizes for the build's target.
//
// int8 activations (opt-in: --quantize-activations int8; 4-bit or 8-bit weights in groups of a
// multiple of 32, the whole row included; AVX512-VNNI, AVX512-VBMI and, for its bf16 stores,
// AVX512-BF16): each row's inputs are rounded per block of 32 to int8 with a float32 scale
// (d = max |x| / 127, x / d to nearest with ties to even; a block of zeros has d = 0), as
// llama.cpp's Q8_0 does to a row. Two steps (16 columns x 4 inputs) are regrouped in registers
// from the same packed layout (one shift, one mask, one `vpermb`) into `vpdpbusd`'s
// unsigned operand: 64 exact integer products an instruction, twice a `vdpbf16ps`'s, and no
// widening to bf16 (a 4-bit value is already a u8). A block's int32 sums enter the float32 totals
// times d x the group's scale; a group's min times the float32 sum of its blocks' d x integer
// sums (the rounded inputs, so that a weight's whole value meets them). So the numbers are the
// float64 formula on the rounded activations within float32 rounding
// (tests/kernels/cpu/test_cpu_int8_activations.py), not the de-quantized matmul. Every
// row count takes these 8-row tiles (integer products beat de-quantizing into bf16 past 64 rows
// too), except, on a CPU with AMX, bf16 rows from kTileRows on (tiles_linear, either path).
// 8-bit weights (any int8 q, -128..127): `vpdpbusd` multiplies an unsigned byte by a signed
// one, so a quad's bytes are flipped at their top bit (one `vpxord` a quad, shared by a tile's
// rows), q ^ 0x80 = q + 128 as an unsigned byte, and each block's int32 sums start at -128 x the
// row's integer sum of the block's activations (computed once when the rows are rounded): they
// end exactly at sum(q x a), and the rest is the 4-bit path's. Two 8-bit steps are one 64-byte
// load and one `vpermb` regroups them (no nibbles to unpack).
// Against bf16_linear on the default model's 120 linears (bench/quant_kernel.py --passes 5, one
// thread, the same Zen 4, 2026-11-26, two runs, load average 0.4-1.6; all formats alternating in
// one process; before the scales' prefetch, see prefetch_group), bf16's median over the
// format's at 1 / 4 / 8 / 16 / 32 / 64 / 128 rows: Q4_1
// exact 1.54-1.65 / 1.32-1.46 / 0.95-1.04 / 0.89-0.99 / 0.83-0.87 / 0.79 / 0.84, with int8
// activations 2.07-2.23 / 1.51-1.69 / 1.18-1.23 / 1.18-1.19 / 1.07-1.12 / 1.01-1.09 / 1.05-1.06;
// Q4_0 exact 1.82-1.99 / 1.42-1.62 / 0.98-1.10 / 0.92-0.96 / 0.85-0.90 / 0.80 / 0.85-0.86, with
// int8 activations 2.06-2.29 / 1.58-1.80 / 1.23-1.26 / 1.21 / 1.14-1.15 / 1.04-1.11 / 1.05-1.08.
// 8-bit weights (bench/quant_kernel.py --passes 5, one thread, the same Zen 4, 2026-11-26, two
// runs at load average 1.8-2.1 and 1.0-1.3): bf16's median over the format's at 1 / 4 / 8 / 16 /
// 32 / 64 / 128 rows, int8 per row exact 1.44-1.68 / 1.24-1.45 / 1.07-1.09 / 0.99-1.04 /
// 0.98-0.99 / 0.95-0.97 / 0.97-0.98, with int8 activations 1.53-1.69 / 1.96-2.14 / 1.52-1.82 /
// 1.50-1.71 / 1.51-1.61 / 1.51-1.56 / 1.40-1.45; Q8_0 exact 1.38-1.43 / 1.20-1.33 / 0.98-1.04 /
// 0.97-1.03 / 0.95-0.98 / 0.93-0.96 / 0.97, with int8 activations 1.50-1.68 / 1.62-1.86 /
// 1.34-1.68 / 1.38-1.61 / 1.44-1.55 / 1.43-1.49 / 1.39-1.40. Faster than 4-bit with int8
// activations from 4 rows on per row, from 8 rows as Q8_0 (no nibbles to unpack); at one row,
// weights read from memory rather than cache, about even with the exact path (bench/README.md).
// Past 8 rows a tile's time is about half `vpdpbusd` (1 a cycle here, as `vdpbf16ps`) and half
// the rest: unpacking the quads, each block's scaling of its 16 sums into the totals, the
// totals' loads and stores. Tried and dropped: `vpdpbusd` with its activation broadcast from
// memory ({1to16}), 1.3x slower at 8-16 rows. With GCC's `_mm512_dpbusd_epi32` the register
// allocator copied every sum and spilled some in the quad loop (2 moves a multiply: 28.4 ms for
// the 120 linears at 16 rows against 25.6 with the asm statement, both before the block was
// inlined), so the multiply is an asm statement (see dpbusd). Also tried and dropped: rounding
// the activations per weight group rather than per 32 inputs (per token for a scale per row, as
// vLLM's W8A8 does), one conversion of the int32 sums a group: the int8-per-row linears 1.1x
// faster at 16 rows and 1.25x at 128, but on the default model (--quantization int8, 8 prompts,
// 497 positions scored teacher-forced against the exact int8 path) the mean logprob error went
// from 0.071 to 0.239 and top-1 agreement from 96.0% to 86.9% (blocks of 128: 0.107, 93.2%).
//
// The vector code is compiled for AVX512 whatever the build's target (function attributes) and
// chosen at run time from the CPU's own flags, so an image built for x86-64-v3 still takes it.
//
// Against bf16_linear on the default model's 120 layer linears (bench/quant_kernel.py: 2-core
// Zen 4, AVX512-BF16, no AMX; one thread; a machine loaded by other work, load average 8-9;
// median of 5 passes, formats alternating in one process; two runs each, before and after the
// 128 + q widening and the 8-row tiles): bf16's median over the format's at 1 / 4 / 8 / 16 / 32
// rows, Q4_1 before 1.16-1.32 / 0.97-1.23 / 0.72-0.73 / 0.68-0.74 / 0.87-0.96, after
// 1.98-2.40 / 1.51-1.74 / 0.79-1.17 / 0.78-0.99 / 0.79-0.92; Q8_0 before 1.19-1.74 / 0.85-1.65 /
// 0.54-0.68 / 0.66-0.77 / 0.89-0.94, after 1.67-1.86 / 1.31-1.46 / 1.04-1.37 / 0.86-1.25 /
// 0.98-1.08; int8 per-channel (its code unchanged) 1.34-2.00 / 1.02-1.41 / 1.18-1.43 /
// 0.96-1.16 / 1.08-1.25. From 8 rows bf16's own matmul is bound by its arithmetic, which a
// format that widens to bf16 repeats (the same count of `vdpbf16ps`, plus the widening and a
// group's scale and min): the bytes saved no longer buy time there.
// Whole decode steps, every format: bench/quantized.py and bench/README.md.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#define PAGEDSERVE_X86 1
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define VNNI_TARGET \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx512vbmi")))
#endif

namespace {

constexpr int64_t kCols = 16;       // output columns of a vector
constexpr int64_t kBlockCols = 32;  // two column blocks: a work item's columns
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

// The int8-activation code: `vpdpbusd` (AVX512-VNNI) and `vpermb` (AVX512-VBMI), besides the
// AVX512-BF16 code's own flags (its bf16 stores).
bool vnni_path() {
#if defined(PAGEDSERVE_X86)
    static const bool has =
        vector_path() && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
    return has;
#else
    return false;
#endif
}

int64_t padded_columns(int64_t n) { return (n + kBlockCols - 1) / kBlockCols * kBlockCols; }

struct Weights {
    const uint8_t* q;      // [padded / 16][pairs][step bytes]
    const float* scales;   // [padded / 16][groups][16]
    const float* mins;     // the same, or null
    const float* bias;     // [n] or null
    const float* xsums;    // with mins: [rows][groups], each group's sum of a row's inputs
    int64_t n, k, pairs, groups, group_pairs, step;  // step: 32 bytes (8-bit) or 16 (4-bit)
};

// The value at index i (0..31) of a step.
inline int32_t value_at(const uint8_t* step, int64_t i, bool four_bit) {
    if (!four_bit) return static_cast<int8_t>(step[i]);
    return i < 16 ? (step[i] & 0x0F) : (step[i - 16] >> 4);
}

// ---- portable ------------------------------------------------------------------------------

template <typename T>
void portable_block(const T* x, int64_t rows, const Weights& w, T* out, int64_t block, int64_t row0) {
    const int64_t col0 = block * kCols;
    if (col0 >= w.n) return;
    const bool four_bit = w.step == 16;
    const int64_t cols = std::min(kCols, w.n - col0);
    const uint8_t* q = w.q + block * w.pairs * w.step;
    const float* s = w.scales + block * w.groups * kCols;
    const float* mn = w.mins ? w.mins + block * w.groups * kCols : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * w.k;
        float total[kCols] = {};
        for (int64_t g = 0; g < w.groups; ++g) {
            float sum[kCols] = {};
            for (int64_t p = g * w.group_pairs; p < (g + 1) * w.group_pairs; ++p) {
                const float x0 = static_cast<float>(xr[2 * p]), x1 = static_cast<float>(xr[2 * p + 1]);
                const uint8_t* step = q + p * w.step;
                for (int64_t c = 0; c < kCols; ++c) {
                    sum[c] += x0 * value_at(step, 2 * c, four_bit) + x1 * value_at(step, 2 * c + 1, four_bit);
                }
            }
            for (int64_t c = 0; c < kCols; ++c) total[c] += sum[c] * s[g * kCols + c];
            if (mn != nullptr) {
                const float xs = w.xsums[(row0 + r) * w.groups + g];
                for (int64_t c = 0; c < kCols; ++c) total[c] += xs * mn[g * kCols + c];
            }
        }
        for (int64_t c = 0; c < cols; ++c) {
            out[r * w.n + col0 + c] = static_cast<T>(total[c] + (w.bias ? w.bias[col0 + c] : 0.0f));
        }
    }
}

template <typename T>
void portable_item(const T* x, int64_t rows, const Weights& w, T* out, int64_t block, int64_t row0) {
    portable_block(x, rows, w, out, block, row0);
    portable_block(x, rows, w, out, block + 1, row0);
}

// ---- int8 activations: quantizing a row, and the portable loop -------------------------------

constexpr int64_t kActBlock = 32;  // inputs of one activation scale (llama.cpp's Q8_0 block)

// A batch's activations quantized per block of kActBlock inputs: values [rows][k] int8, scales
// [rows][k / kActBlock] float32; an input is about value x scale. For 8-bit weights also each
// block's integer sum [rows][k / kActBlock] (see block_int8: 128 x it comes off every sum).
struct ActRows {
    const int8_t* values;
    const float* scales;
    const int32_t* sums;  // null for 4-bit weights
};

// d = max |x| / 127 (float32 division), a = x / d rounded to nearest, ties to even (the
// default rounding mode, as torch.round), so that the largest magnitude maps to +-127; a block of
// zeros gets d = 0 and a = 0. One row at a time, from the row's float32 values.
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* values, float* scales) {
    float v[kActBlock];
    for (int64_t j = 0; j < k / kActBlock; ++j) {
        float amax = 0.0f;
        for (int64_t i = 0; i < kActBlock; ++i) {
            v[i] = static_cast<float>(x[j * kActBlock + i]);
            amax = std::max(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.0f;
        scales[j] = d;
        for (int64_t i = 0; i < kActBlock; ++i) {
            const float a = d == 0.0f ? 0.0f : std::nearbyint(v[i] / d);
            values[j * kActBlock + i] = static_cast<int8_t>(std::clamp(a, -127.0f, 127.0f));
        }
    }
}

// The int8 path's arithmetic over the same layout, column by column: per block an exact int32
// sum of q x a, then the float32 total += sum x (d x scale), as the vector code does (fused
// multiply-adds: the same numbers), and per group min x the group's input sum. An 8-bit q is
// taken signed here; the vector code's (q + 128) x a less 128 x the block's sum of a is the same
// int32 exactly, so both give the same numbers.
template <typename T>
void portable_int8_block(const ActRows& xa, int64_t rows, const Weights& w, T* out, int64_t block, int64_t row0) {
    const int64_t col0 = block * kCols;
    if (col0 >= w.n) return;
    const int64_t cols = std::min(kCols, w.n - col0), blocks = w.k / kActBlock, group_blocks = blocks / w.groups;
    const bool four_bit = w.step == 16;
    const uint8_t* q = w.q + block * w.pairs * w.step;
    const float* s = w.scales + block * w.groups * kCols;
    const float* mn = w.mins ? w.mins + block * w.groups * kCols : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
        const int8_t* xr = xa.values + r * w.k;
        const float* dr = xa.scales + r * blocks;
        float total[kCols] = {};
        for (int64_t g = 0; g < w.groups; ++g) {
            for (int64_t blk = g * group_blocks; blk < (g + 1) * group_blocks; ++blk) {
                int32_t sum[kCols] = {};
                for (int64_t p = blk * kActBlock / 2; p < (blk + 1) * kActBlock / 2; ++p) {
                    const uint8_t* step = q + p * w.step;
                    for (int64_t c = 0; c < kCols; ++c) {
                        sum[c] += value_at(step, 2 * c, four_bit) * xr[2 * p] +
                                  value_at(step, 2 * c + 1, four_bit) * xr[2 * p + 1];
                    }
                }
                for (int64_t c = 0; c < kCols; ++c) {
                    total[c] = std::fma(static_cast<float>(sum[c]), dr[blk] * s[g * kCols + c], total[c]);
                }
            }
            if (mn != nullptr) {
                const float xs = w.xsums[(row0 + r) * w.groups + g];
                for (int64_t c = 0; c < kCols; ++c) total[c] = std::fma(xs, mn[g * kCols + c], total[c]);
            }
        }
        for (int64_t c = 0; c < cols; ++c) {
            out[r * w.n + col0 + c] = static_cast<T>(total[c] + (w.bias ? w.bias[col0 + c] : 0.0f));
        }
    }
}

#if defined(PAGEDSERVE_X86)
// ---- AVX512 -------------------------------------------------------------------------------------

// The columns from `col` on that exist, of a vector's 16.
AVX512_TARGET inline __mmask16 existing(int64_t n, int64_t col) {
    const int64_t left = n - col;
    return static_cast<__mmask16>(left <= 0 ? 0 : left >= kCols ? 0xFFFF : (1u << left) - 1);
}

AVX512_TARGET inline __m512 bias_at(const float* bias, int64_t col, __mmask16 mask) {
    return bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + col);
}

// The next work item's scales (and mins) of group g, a 64-byte line each, while this item works
// on its own group g. A work item's weights were prefetched this way, its scales and mins were
// not: they are a third of a Q4_1 item's bytes (float32 scale and min per 32 4-bit values), read
// once a group, and missed the cache (sampled: a third of the 1-row 4-bit tile's time sat on
// those two loads). The default model's 120 linears, one thread, idle
// 2-core Zen 4, two runs before and after, bf16's median over the format's at 1 / 4 / 16 rows:
// Q4_1 exact 1.72, 1.39 / 1.39, 1.35 / 0.88, 0.94 -> 1.96, 1.83 / 1.42, 1.44 / 0.93, 0.92; Q4_1
// with int8 activations 2.16, 2.30 / 1.78, 1.64 / 1.31, 1.21 -> 2.34, 2.35 / 2.08, 2.24 / 1.41,
// 1.44 (bench/README.md); Q8_0 with int8 activations (no mins) about as before.
inline void prefetch_group(const Weights& w, int64_t block, int64_t g) {
    for (int64_t b = 2; b < 4; ++b) {
        const int64_t at = ((block + b) * w.groups + g) * kCols;
        _mm_prefetch(reinterpret_cast<const char*>(w.scales + at), _MM_HINT_T1);
        if (w.mins != nullptr) _mm_prefetch(reinterpret_cast<const char*>(w.mins + at), _MM_HINT_T1);
    }
}

// A step's values 0-15 and 16-31 as two vectors of 16 int8.
template <int kBits>
AVX512_TARGET inline void load_step(const uint8_t* step, __m128i& lo, __m128i& hi) {
    if constexpr (kBits == 8) {
        lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(step));
        hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16));
    } else {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(step));
        const __m128i nibble = _mm_set1_epi8(0x0F);
        lo = _mm_and_si128(bytes, nibble);
        hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    }
}

// One step as 32 bf16 in the pair order `vdpbf16ps` reads: 8-bit values as themselves (a small
// integer is exact in bf16); 4-bit ones as 128 + q (see widen_4bit).
template <int kBits>
AVX512_TARGET inline __m512bh widen_bf16(const uint8_t* step);

template <>
AVX512_TARGET inline __m512bh widen_bf16<8>(const uint8_t* step) {
    __m128i lo, hi;
    load_step<8>(step, lo, hi);
    return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
}

// A 4-bit step without converting through float32: the bf16 bit pattern 0x4300 | q is exactly
// 128 + q (exponent 2^7, q in the top bits of its mantissa), so the 16 bytes go to both halves
// of 32 words, the high half shifted by a nibble, and one ternary-logic op masks the nibble and
// sets the exponent. Four instructions a step instead of nine; the products are x * (128 + q),
// still exact in float32, and the 128 * x * scale they add to a group's sum is taken out with
// the min, through the group's sum of the row's inputs (see group_min).
template <>
AVX512_TARGET inline __m512bh widen_bf16<4>(const uint8_t* step) {
    const __m256i bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step)));
    const __m512i words = _mm512_cvtepu8_epi16(bytes);
    const __m512i shift = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0x0004000400040004,
                                           0x0004000400040004, 0, 0, 0, 0);
    const __m512i nibbles = _mm512_srlv_epi16(words, shift);
    // (a & 0x000F) | 0x4300: ternary-logic table 0xEA for A & B | C.
    return reinterpret_cast<__m512bh>(
        _mm512_ternarylogic_epi32(nibbles, _mm512_set1_epi16(0x000F), _mm512_set1_epi16(0x4300), 0xEA));
}

// How a weight's groups are applied: one scale per column at the end, a scale per group, or a
// scale and a min per group (every 4-bit weight: its 128 offset is a min, see widen_bf16<4>).
enum class Groups { kOne, kScaled, kScaledWithMins };

// What a group's input sum multiplies: the min, less 128 x scale for 4-bit steps (128 x scale is
// exact, so this is one float32 rounding).
template <int kBits>
AVX512_TARGET inline __m512 group_min(const float* mins, const float* scales) {
    const __m512 mn = mins == nullptr ? _mm512_setzero_ps() : _mm512_loadu_ps(mins);
    if constexpr (kBits == 4) return _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), _mm512_loadu_ps(scales), mn);
    return mn;
}

// Rows [0, R) of x against NB column blocks from `block` on: NB x R totals, and as many group
// sums where there are groups (then the totals, used once a group, are what spills).
template <int R, int NB, Groups kGroups, int kBits, bool kPrefetch>
AVX512_TARGET void tile_bf16(const at::BFloat16* x, const float* xsums, const Weights& w, at::BFloat16* out,
                             int64_t block) {
    constexpr bool kGrouped = kGroups != Groups::kOne;
    constexpr int64_t kStep = kBits == 8 ? 32 : 16;
    const uint8_t* q0 = w.q + block * w.pairs * kStep;
    const uint8_t* q1 = q0 + w.pairs * kStep;
    const float* s0 = w.scales + block * w.groups * kCols;
    const int32_t* xp = reinterpret_cast<const int32_t*>(x);
    __m512 a[NB][R];
    for (int b = 0; b < NB; ++b)
        for (int r = 0; r < R; ++r) a[b][r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
        __m512 gs[NB][R];
        for (int b = 0; b < NB; ++b)
            for (int r = 0; r < R; ++r) gs[b][r] = _mm512_setzero_ps();
        auto* acc = kGrouped ? gs : a;
        if constexpr (kPrefetch && kGrouped) prefetch_group(w, block, g);
        const int64_t end = (g + 1) * w.group_pairs;
        for (int64_t p = g * w.group_pairs; p < end; ++p) {
            if constexpr (kPrefetch) {  // the next item's two blocks, a 64-byte line at a time
                if ((p * kStep) % 64 == 0) {
                    _mm_prefetch(reinterpret_cast<const char*>(q1 + (w.pairs + p) * kStep), _MM_HINT_T1);
                    _mm_prefetch(reinterpret_cast<const char*>(q1 + (2 * w.pairs + p) * kStep), _MM_HINT_T1);
                }
            }
            __m512bh u[NB];
            for (int b = 0; b < NB; ++b) u[b] = widen_bf16<kBits>(q0 + (b * w.pairs + p) * kStep);
            for (int r = 0; r < R; ++r) {
                const __m512bh xb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[r * w.pairs + p]));
                for (int b = 0; b < NB; ++b) acc[b][r] = _mm512_dpbf16_ps(acc[b][r], xb, u[b]);
            }
        }
        if constexpr (kGrouped) {
            for (int b = 0; b < NB; ++b) {
                const float* sb = s0 + b * w.groups * kCols + g * kCols;
                const __m512 sc = _mm512_loadu_ps(sb);
                for (int r = 0; r < R; ++r) a[b][r] = _mm512_fmadd_ps(gs[b][r], sc, a[b][r]);
                if constexpr (kGroups == Groups::kScaledWithMins) {
                    const float* mb = w.mins ? w.mins + (block + b) * w.groups * kCols + g * kCols : nullptr;
                    const __m512 mn = group_min<kBits>(mb, sb);
                    for (int r = 0; r < R; ++r) {
                        a[b][r] = _mm512_fmadd_ps(_mm512_set1_ps(xsums[r * w.groups + g]), mn, a[b][r]);
                    }
                }
            }
        }
    }
    for (int b = 0; b < NB; ++b) {
        const int64_t col = (block + b) * kCols;
        const __mmask16 m = existing(w.n, col);
        const __m512 bias = bias_at(w.bias, col, m);
        const __m512 sc = _mm512_loadu_ps(s0 + b * w.groups * kCols);
        for (int r = 0; r < R; ++r) {
            const __m512 y = kGrouped ? _mm512_add_ps(a[b][r], bias) : _mm512_fmadd_ps(a[b][r], sc, bias);
            auto* dst = reinterpret_cast<uint16_t*>(out + r * w.n + col);
            _mm256_mask_storeu_epi16(dst, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
        }
    }
}

template <int R, int NB, Groups kGroups, int kBits, bool kPrefetch>
AVX512_TARGET void rows_bf16(int64_t rows, const at::BFloat16* x, const float* xsums, const Weights& w,
                             at::BFloat16* out, int64_t block) {
    for (; rows >= R; rows -= R, x += R * w.k, xsums += R * w.groups, out += R * w.n) {
        tile_bf16<R, NB, kGroups, kBits, kPrefetch>(x, xsums, w, out, block);
    }
    if constexpr (R > 1) {
        if (rows > 0) rows_bf16<R / 2, NB, kGroups, kBits, kPrefetch>(rows, x, xsums, w, out, block);
    }
}

// Both of a work item's blocks, 8 rows a tile: with groups, 16 group sums in registers and the
// 16 totals spilled, touched once a group. (4 rows a tile, which kept both in registers, widened
// each step twice as often: Q4_1 at 16 rows took the default model's 120 linears from 58 to 48
// ms, one thread, bench/quant_kernel.py.)
template <int kBits, bool kPrefetch>
AVX512_TARGET void item_bf16(int64_t rows, const at::BFloat16* x, const float* xsums, const Weights& w,
                             at::BFloat16* out, int64_t block) {
    if constexpr (kBits == 4) {  // always a min: the 128 offset's
        rows_bf16<8, 2, Groups::kScaledWithMins, 4, kPrefetch>(rows, x, xsums, w, out, block);
    } else if (w.mins != nullptr) {
        rows_bf16<8, 2, Groups::kScaledWithMins, 8, kPrefetch>(rows, x, xsums, w, out, block);
    } else if (w.groups > 1) {
        rows_bf16<8, 2, Groups::kScaled, 8, kPrefetch>(rows, x, xsums, w, out, block);
    } else {
        rows_bf16<8, 2, Groups::kOne, 8, kPrefetch>(rows, x, xsums, w, out, block);
    }
}

// Many rows: the widening above, repeated for every tile of rows, costs more than the bytes it
// saves. Instead a work item's two column blocks are de-quantized once (q * scale + min,
// one rounding to bf16) into bf16_linear's layout, and its rows multiplied from there as
// bf16_linear does. Its numbers then carry the bf16 rounding of each weight, as a bf16 model's do.
template <int kBits>
AVX512_TARGET void dequantize_bf16(const Weights& w, int64_t block, uint16_t* dst) {
    constexpr int64_t kStep = kBits == 8 ? 32 : 16;
    const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    for (int64_t b = 0; b < 2; ++b) {
        const uint8_t* q = w.q + (block + b) * w.pairs * kStep;
        const float* s = w.scales + (block + b) * w.groups * kCols;
        const float* mn = w.mins ? w.mins + (block + b) * w.groups * kCols : nullptr;
        uint16_t* out = dst + b * w.pairs * 32;
        for (int64_t g = 0; g < w.groups; ++g) {
            const __m512 sc = _mm512_loadu_ps(s + g * kCols);
            const __m512 slo = _mm512_permutexvar_ps(dup_lo, sc), shi = _mm512_permutexvar_ps(dup_hi, sc);
            const __m512 m = mn ? _mm512_loadu_ps(mn + g * kCols) : _mm512_setzero_ps();
            const __m512 mlo = _mm512_permutexvar_ps(dup_lo, m), mhi = _mm512_permutexvar_ps(dup_hi, m);
            for (int64_t p = g * w.group_pairs; p < (g + 1) * w.group_pairs; ++p) {
                __m128i l, h;
                load_step<kBits>(q + p * kStep, l, h);
                const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l)), slo, mlo);
                const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h)), shi, mhi);
                _mm512_storeu_si512(out + p * 32, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
            }
        }
    }
}

// Rows [0, R) of x against the two de-quantized column blocks at `dense` (bf16_linear's tile).
template <int R>
AVX512_TARGET void tile_dense(const at::BFloat16* x, const uint16_t* dense, const Weights& w, at::BFloat16* out,
                              int64_t block) {
    const __m512i* w0 = reinterpret_cast<const __m512i*>(dense);
    const __m512i* w1 = w0 + w.pairs;
    const int32_t* xp = reinterpret_cast<const int32_t*>(x);
    __m512 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < w.pairs; ++p) {
        const __m512bh u = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w0 + p));
        const __m512bh v = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w1 + p));
        for (int r = 0; r < R; ++r) {
            const __m512bh b = reinterpret_cast<__m512bh>(_mm512_set1_epi32(xp[r * w.pairs + p]));
            a0[r] = _mm512_dpbf16_ps(a0[r], b, u);
            a1[r] = _mm512_dpbf16_ps(a1[r], b, v);
        }
    }
    const int64_t col0 = block * kCols;
    const __mmask16 m0 = existing(w.n, col0), m1 = existing(w.n, col0 + kCols);
    const __m512 b0 = bias_at(w.bias, col0, m0), b1 = bias_at(w.bias, col0 + kCols, m1);
    for (int r = 0; r < R; ++r) {
        auto* dst = reinterpret_cast<uint16_t*>(out + r * w.n + col0);
        _mm256_mask_storeu_epi16(dst, m0, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(a0[r], b0))));
        _mm256_mask_storeu_epi16(dst + kCols, m1,
                                 reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_add_ps(a1[r], b1))));
    }
}

template <int R>
AVX512_TARGET void rows_dense(int64_t rows, const at::BFloat16* x, const uint16_t* dense, const Weights& w,
                              at::BFloat16* out, int64_t block) {
    for (; rows >= R; rows -= R, x += R * w.k, out += R * w.n) tile_dense<R>(x, dense, w, out, block);
    if constexpr (R > 1) {
        if (rows > 0) rows_dense<R / 2>(rows, x, dense, w, out, block);
    }
}

template <int kBits>
AVX512_TARGET void item_prefill(int64_t rows, const at::BFloat16* x, const Weights& w, at::BFloat16* out,
                                int64_t block) {
    thread_local std::vector<uint16_t> dense;  // a work item's two blocks, reused item to item
    dense.resize(static_cast<size_t>(w.pairs) * 64);
    dequantize_bf16<kBits>(w, block, dense.data());
    rows_dense<8>(rows, x, dense.data(), w, out, block);
}

#if defined(PAGEDSERVE_X86) && defined(__AMX_BF16__)
// Many rows on a CPU with AMX: oneDNN multiplies bf16 on AMX tiles, and this file's vector code
// lost to it from about 128 rows (the default model's gate/up [3072, 576] at 2,048 rows: torch's
// bf16 linear 5.2 ms, int8 activations 12.8-16.1, exact 48.3; 2-core Xeon with AMX). So there the
// whole weight is de-quantized once into a plain bf16 matrix, transposed ([k, n]: dequantize_bf16's
// numbers, each weight rounded to bf16 as item_prefill rounds it), and handed to torch. With int8
// activations the rows are then not rounded: the de-quantized weights' product, more exact than
// the path it replaces. After (bench/quant_kernel.py --rows 128,512,2048 --passes 5 --threads 2
// --formats bf16,torch_bf16,q4_1,q4_1_i8,q8_0_i8, the default model's 120 linears): Q4_1 took
// 1.6x torch_bf16's time at 128 rows, 1.08-1.18x at 512, 0.98-1.03x at 2,048.
constexpr int64_t kTileRows = 128;

template <int kBits>
AVX512_TARGET void dequantize_plain(const Weights& w, int64_t item, uint16_t* scratch, uint16_t* dst) {
    dequantize_bf16<kBits>(w, 2 * item, scratch);
    // A pair's 32 values are its 16 columns' two inputs side by side: one permute splits them
    // into input 2p's 16 columns and input 2p + 1's, each a run of dst's row of that input.
    const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26,
                                           24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    for (int64_t b = 0; b < 2; ++b) {
        const int64_t col0 = (2 * item + b) * kCols;
        const __mmask16 m = existing(w.n, col0);
        if (m == 0) continue;
        const uint16_t* src = scratch + b * w.pairs * 32;
        for (int64_t p = 0; p < w.pairs; ++p) {
            const __m512i v = _mm512_permutexvar_epi16(split, _mm512_loadu_si512(src + p * 32));
            _mm256_mask_storeu_epi16(dst + 2 * p * w.n + col0, m, _mm512_castsi512_si256(v));
            _mm256_mask_storeu_epi16(dst + (2 * p + 1) * w.n + col0, m, _mm512_extracti64x4_epi64(v, 1));
        }
    }
}

torch::Tensor tiles_linear(const torch::Tensor& x, const Weights& w, bool four_bit,
                           const std::optional<torch::Tensor>& bias) {
    auto dense = torch::empty({w.k, w.n}, x.options());  // the weight transposed: inputs are rows
    auto* dst = reinterpret_cast<uint16_t*>(dense.data_ptr<at::BFloat16>());
    at::parallel_for(0, padded_columns(w.n) / kBlockCols, 1, [&](int64_t begin, int64_t end) {
        std::vector<uint16_t> scratch(static_cast<size_t>(w.pairs) * 64);
        for (int64_t i = begin; i < end; ++i) {
            four_bit ? dequantize_plain<4>(w, i, scratch.data(), dst) : dequantize_plain<8>(w, i, scratch.data(), dst);
        }
    });
    auto out = at::matmul(x, dense);
    if (bias) out.add_(*bias);
    return out;
}
#else
constexpr int64_t kTileRows = 0;
#endif

// Rows [0, R) of float32 x against one column block. A step widens to two float32 vectors,
// columns 0-7 and 8-15 with their two inputs side by side, multiplied by the row's input pair
// repeated; each column's two lanes are added at the end.
template <int R, int kBits>
AVX512_TARGET void tile_f32(const float* x, const float* xsums, const Weights& w, float* out, int64_t block) {
    constexpr int64_t kStep = kBits == 8 ? 32 : 16;
    const uint8_t* q = w.q + block * w.pairs * kStep;
    const float* s = w.scales + block * w.groups * kCols;
    const float* mn = w.mins ? w.mins + block * w.groups * kCols : nullptr;
    // A column's scale (or min) to both of its lanes.
    const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dup_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
    __m512 lo[R], hi[R];
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w.groups; ++g) {
        __m512 glo[R], ghi[R];
        for (int r = 0; r < R; ++r) glo[r] = ghi[r] = _mm512_setzero_ps();
        const int64_t end = (g + 1) * w.group_pairs;
        for (int64_t p = g * w.group_pairs; p < end; ++p) {
            __m128i l, h;
            load_step<kBits>(q + p * kStep, l, h);
            const __m512 wlo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l));
            const __m512 whi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h));
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
        if (mn != nullptr) {  // each column's lanes get half of min x the group's input sum
            const __m512 m = _mm512_mul_ps(_mm512_loadu_ps(mn + g * kCols), _mm512_set1_ps(0.5f));
            const __m512 mlo = _mm512_permutexvar_ps(dup_lo, m), mhi = _mm512_permutexvar_ps(dup_hi, m);
            for (int r = 0; r < R; ++r) {
                const __m512 xs = _mm512_set1_ps(xsums[r * w.groups + g]);
                lo[r] = _mm512_fmadd_ps(xs, mlo, lo[r]);
                hi[r] = _mm512_fmadd_ps(xs, mhi, hi[r]);
            }
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

template <int R, int kBits>
AVX512_TARGET void rows_f32(int64_t rows, const float* x, const float* xsums, const Weights& w, float* out,
                            int64_t block) {
    for (; rows >= R; rows -= R, x += R * w.k, xsums += R * w.groups, out += R * w.n) {
        tile_f32<R, kBits>(x, xsums, w, out, block);
    }
    if constexpr (R > 1) {
        if (rows > 0) rows_f32<R / 2, kBits>(rows, x, xsums, w, out, block);
    }
}

template <int kBits>
AVX512_TARGET void item_f32(int64_t rows, const float* x, const float* xsums, const Weights& w, float* out,
                            int64_t block) {
    rows_f32<4, kBits>(rows, x, xsums, w, out, block);
    if ((block + 1) * kCols < w.n) rows_f32<4, kBits>(rows, x, xsums, w, out, block + 1);
}

// ---- 4-bit weights x int8 activations (AVX512-VNNI, opt-in) ---------------------------------

// quantize_row's rounding, 32 inputs a vector pair: the same IEEE division and round-to-nearest-even
// (`vrndscaleps`), so the same bytes. The scalar loop's division cost ~1 ms of a 16-row step.
// 16 inputs / d to the nearest int8, ties to even (a function, not a lambda: a lambda does not
// take its enclosing function's target attribute).
VNNI_TARGET inline __m128i round_int8(__m512 v, __m512 d) {
    const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(v, d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 clamped = _mm512_max_ps(_mm512_min_ps(r, _mm512_set1_ps(127.0f)), _mm512_set1_ps(-127.0f));
    return _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(clamped));
}

template <typename T>
VNNI_TARGET void quantize_row_vector(const T* x, int64_t k, int8_t* values, float* scales) {
    const __m512 sign = _mm512_set1_ps(-0.0f);
    for (int64_t j = 0; j < k / kActBlock; ++j) {
        __m512 lo, hi;
        if constexpr (std::is_same_v<T, float>) {
            lo = _mm512_loadu_ps(x + j * kActBlock);
            hi = _mm512_loadu_ps(x + j * kActBlock + 16);
        } else {  // bf16: its bits are the float32's top half
            const auto* p = reinterpret_cast<const __m256i*>(x + j * kActBlock);
            lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
            hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p + 1)), 16));
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, lo), _mm512_andnot_ps(sign, hi)));
        const float d = amax / 127.0f;
        scales[j] = d;
        if (d == 0.0f) {
            std::memset(values + j * kActBlock, 0, kActBlock);
            continue;
        }
        const __m512 dv = _mm512_set1_ps(d);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(values + j * kActBlock), round_int8(lo, dv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(values + j * kActBlock + 16), round_int8(hi, dv));
    }
}

// A quad: two steps (pairs 2s and 2s + 1) as 16 columns x 4 inputs, the u8 operand of
// `vpdpbusd`, regrouped in registers so that the packed layout stays the one the exact path
// reads. 4-bit (two steps are 32 bytes): both steps go to both halves of a vector, the upper
// half shifted by a nibble, one mask keeps the nibbles, and one `vpermb` gathers each column's
// four values (its two values of each step) into its 32-bit lane.
template <int kBits>
VNNI_TARGET inline __m512i quad_u8(const uint8_t* steps, __m512i order);

template <>
VNNI_TARGET inline __m512i quad_u8<4>(const uint8_t* steps, __m512i order) {
    const __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(steps)));
    const __m512i nibbles = _mm512_and_si512(_mm512_srlv_epi64(both, _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0)),
                                             _mm512_set1_epi8(0x0F));
    return _mm512_permutexvar_epi8(order, nibbles);
}

// 8-bit (two steps are 64 bytes, one load): one `vpermb` gathers each column's four bytes, and
// flipping every byte's top bit turns a signed q (-128..127) into the unsigned q + 128 that
// `vpdpbusd` takes; block_int8 takes the 128 x the activations' sum back off.
template <>
VNNI_TARGET inline __m512i quad_u8<8>(const uint8_t* steps, __m512i order) {
    const __m512i bytes = _mm512_loadu_si512(steps);
    return _mm512_xor_si512(_mm512_permutexvar_epi8(order, bytes), _mm512_set1_epi8(static_cast<char>(0x80)));
}

// Byte 4c + j of a quad: column c's input j. 4-bit: after the shift and mask, byte i < 32 holds
// the low nibble of the steps' byte i (columns 0-7), byte 32 + i its high nibble (columns 8-15);
// within a step, byte 2c' + t is column c''s input t of the pair, the second step 16 bytes on.
// 8-bit: byte 2c + t of a step is column c's input t, the second step 32 bytes on.
template <int kBits>
VNNI_TARGET inline __m512i quad_order() {
    alignas(64) uint8_t idx[64];
    for (int c = 0; c < 16; ++c) {
        for (int j = 0; j < 2; ++j) {  // the step
            for (int t = 0; t < 2; ++t) {  // the input of its pair
                const int at = kBits == 8 ? 32 * j + 2 * c + t : (c < 8 ? 0 : 32) + 2 * (c % 8) + 16 * j + t;
                idx[4 * c + 2 * j + t] = static_cast<uint8_t>(at);
            }
        }
    }
    return _mm512_load_si512(idx);
}

// acc + the int32 sums of u (u8) x x (s8) four by four: `vpdpbusd` in place. With GCC's builtin
// the register allocator copied every sum and spilled some in the quad loop (see the header);
// the asm ties the sum to its register.
VNNI_TARGET inline __m512i dpbusd(__m512i acc, __m512i u, __m512i x) {
#if defined(__GNUC__) && !defined(__clang__)
    asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(x));
    return acc;
#else
    return _mm512_dpbusd_epi32(acc, u, x);
#endif
}

template <typename T>
VNNI_TARGET inline void store_row(T* dst, __mmask16 m, __m512 y) {
    if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(dst, m, y);
    } else {
        _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(dst), m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(y)));
    }
}

// One block of 32 inputs of rows [0, R) against a work item's two column blocks (the quads
// from `s` on): 8 quads of `vpdpbusd` into exact int32 sums, then added into the float32 totals
// `tot` [2][R][16] times each row's activation scale and each column's group scale (`sc`, [2][16]).
// The totals live in memory (touched once a block): the 16 int32 sums, two quads, the order
// table and a broadcast row take the registers. (The same as a function not inlined was 1.2x
// slower at 8-16 rows: its calls and the sums' zeroing broke the overlap between blocks.)
// 8-bit: each quad holds q + 128, so a sum starts at -128 x the row's integer sum of the block
// (`asum`), which leaves sum(q x a) exactly (|(q + 128) x a| summed over 32 inputs is at most
// 32 x 255 x 127, far inside int32).
template <int kBits, int R, bool kPrefetch>
VNNI_TARGET inline void block_int8(const uint8_t* q0, const uint8_t* q1, int64_t pairs,
                                   const int32_t* xq, int64_t quads, int64_t s, const float* d,
                                   const int32_t* asum, int64_t blocks, const float* sc, float* tot) {
    constexpr int64_t kStep = kBits == 8 ? 32 : 16;
    const __m512i order = quad_order<kBits>();
    __m512i acc[2][R];
    for (int r = 0; r < R; ++r) {
        const __m512i start = kBits == 8 ? _mm512_set1_epi32(-128 * asum[r * blocks]) : _mm512_setzero_si512();
        acc[0][r] = acc[1][r] = start;
    }
    for (const int64_t end = s + kActBlock / 4; s < end; ++s) {
        if constexpr (kPrefetch) {  // the next item's two blocks, a 64-byte line at a time
            if (kBits == 8 || s % 2 == 0) {
                _mm_prefetch(reinterpret_cast<const char*>(q1 + (pairs + 2 * s) * kStep), _MM_HINT_T1);
                _mm_prefetch(reinterpret_cast<const char*>(q1 + (2 * pairs + 2 * s) * kStep), _MM_HINT_T1);
            }
        }
        const __m512i u0 = quad_u8<kBits>(q0 + 2 * s * kStep, order);
        const __m512i u1 = quad_u8<kBits>(q1 + 2 * s * kStep, order);
        for (int r = 0; r < R; ++r) {
            const __m512i xb = _mm512_set1_epi32(xq[r * quads + s]);
            acc[0][r] = dpbusd(acc[0][r], u0, xb);
            acc[1][r] = dpbusd(acc[1][r], u1, xb);
        }
    }
    for (int b = 0; b < 2; ++b) {
        const __m512 scale = _mm512_loadu_ps(sc + b * kCols);
        for (int r = 0; r < R; ++r) {
            float* t = tot + (b * R + r) * kCols;
            const __m512 ds = _mm512_mul_ps(_mm512_set1_ps(d[r * blocks]), scale);
            _mm512_storeu_ps(t, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[b][r]), ds, _mm512_loadu_ps(t)));
        }
    }
}

// Rows [0, R) against a work item's two column blocks: block_int8 for each block of 32 inputs;
// per group, its min times the row's input sum.
template <int kBits, int R, bool kMins, bool kPrefetch, typename T>
VNNI_TARGET void tile_int8(const ActRows& xa, const float* xsums, const Weights& w, T* out, int64_t block) {
    constexpr int64_t kStep = kBits == 8 ? 32 : 16;
    const uint8_t* q0 = w.q + block * w.pairs * kStep;
    const uint8_t* q1 = q0 + w.pairs * kStep;
    const float* s0 = w.scales + block * w.groups * kCols;
    const int32_t* xq = reinterpret_cast<const int32_t*>(xa.values);
    const int64_t quads = w.k / 4, blocks = w.k / kActBlock, group_blocks = blocks / w.groups;
    alignas(64) float tot[2 * R * kCols] = {};
    alignas(64) float sc[2 * kCols];
    for (int64_t g = 0; g < w.groups; ++g) {
        if constexpr (kPrefetch) prefetch_group(w, block, g);
        std::memcpy(sc, s0 + g * kCols, sizeof(float) * kCols);
        std::memcpy(sc + kCols, s0 + (w.groups + g) * kCols, sizeof(float) * kCols);
        for (int64_t blk = g * group_blocks; blk < (g + 1) * group_blocks; ++blk) {
            block_int8<kBits, R, kPrefetch>(q0, q1, w.pairs, xq, quads, blk * kActBlock / 4, xa.scales + blk,
                                            kBits == 8 ? xa.sums + blk : nullptr, blocks, sc, tot);
        }
        if constexpr (kMins) {
            for (int b = 0; b < 2; ++b) {
                const __m512 mn = _mm512_loadu_ps(w.mins + (block + b) * w.groups * kCols + g * kCols);
                for (int r = 0; r < R; ++r) {
                    float* t = tot + (b * R + r) * kCols;
                    _mm512_store_ps(t, _mm512_fmadd_ps(_mm512_set1_ps(xsums[r * w.groups + g]), mn, _mm512_load_ps(t)));
                }
            }
        }
    }
    for (int b = 0; b < 2; ++b) {
        const int64_t col = (block + b) * kCols;
        const __mmask16 m = existing(w.n, col);
        const __m512 bias = bias_at(w.bias, col, m);
        for (int r = 0; r < R; ++r) {
            store_row(out + r * w.n + col, m, _mm512_add_ps(_mm512_load_ps(tot + (b * R + r) * kCols), bias));
        }
    }
}

template <int kBits, int R, bool kMins, bool kPrefetch, typename T>
VNNI_TARGET void rows_int8(int64_t rows, ActRows xa, const float* xsums, const Weights& w, T* out, int64_t block) {
    const int64_t blocks = w.k / kActBlock;
    for (; rows >= R; rows -= R, xa.values += R * w.k, xa.scales += R * blocks, out += R * w.n) {
        tile_int8<kBits, R, kMins, kPrefetch, T>(xa, xsums, w, out, block);
        if (kMins) xsums += R * w.groups;
        if (kBits == 8) xa.sums += R * blocks;
    }
    if constexpr (R > 1) {
        if (rows > 0) rows_int8<kBits, R / 2, kMins, kPrefetch, T>(rows, xa, xsums, w, out, block);
    }
}

template <int kBits, typename T>
VNNI_TARGET void item_int8_bits(int64_t rows, const ActRows& xa, const float* xsums, const Weights& w, T* out,
                                int64_t block) {
    const bool prefetch = rows <= kPrefetchRows;
    if (w.mins != nullptr) {
        prefetch ? rows_int8<kBits, 8, true, true, T>(rows, xa, xsums, w, out, block)
                 : rows_int8<kBits, 8, true, false, T>(rows, xa, xsums, w, out, block);
    } else {
        prefetch ? rows_int8<kBits, 8, false, true, T>(rows, xa, xsums, w, out, block)
                 : rows_int8<kBits, 8, false, false, T>(rows, xa, xsums, w, out, block);
    }
}

template <typename T>
VNNI_TARGET void item_int8(int64_t rows, const ActRows& xa, const float* xsums, const Weights& w, T* out,
                           int64_t block) {
    w.step == 32 ? item_int8_bits<8, T>(rows, xa, xsums, w, out, block)
                 : item_int8_bits<4, T>(rows, xa, xsums, w, out, block);
}
#endif

// Row r of x quantized (quantize_row's numbers; the vector code where `vnni`).
void quantize_one_row(const torch::Tensor& x, int64_t r, int8_t* values, float* scales, bool vnni) {
    const int64_t k = x.size(1), blocks = k / kActBlock;
    const bool is_bf16 = x.scalar_type() == at::kBFloat16;
#if defined(PAGEDSERVE_X86)
    if (vnni) {
        is_bf16 ? quantize_row_vector(x.data_ptr<at::BFloat16>() + r * k, k, values + r * k, scales + r * blocks)
                : quantize_row_vector(x.data_ptr<float>() + r * k, k, values + r * k, scales + r * blocks);
        return;
    }
#endif
    is_bf16 ? quantize_row(x.data_ptr<at::BFloat16>() + r * k, k, values + r * k, scales + r * blocks)
            : quantize_row(x.data_ptr<float>() + r * k, k, values + r * k, scales + r * blocks);
}

// Rows of a batch for the int8 path: how many one thread rounds before the rest are shared out
// (a decode step's few rows stay on the calling thread, where a fork costs more than they do).
constexpr int64_t kQuantizeGrain = 16;

// The activations of rows [0, m) rounded (values [m][k], scales [m][blocks]), each block's
// integer sum (sums [m][blocks]: what 8-bit weights' 128 offset adds, block_int8, and what the
// mins meet), and where `group_sums` is given each group's sum of the rounded inputs ([m][groups],
// d x the block's integer sum over its blocks; see run). Rows are independent, so a long
// prefill's rows spread over the threads. On the 2-core Zen 4, two threads, the default
// model's 120 linears at 2,048 rows (bench/quant_kernel.py --threads 2): int8 weights 820 -> 742
// ms, Q4_1 912 -> 852 (bf16: 1,031 and 1,014), against rounding on the calling thread alone.
void quantize_rows(const torch::Tensor& x, int64_t m, int64_t groups, int8_t* values, float* scales,
                   int32_t* sums, float* group_sums, bool vnni) {
    const int64_t k = x.size(1), blocks = k / kActBlock, group_blocks = blocks / groups;
    at::parallel_for(0, m, kQuantizeGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            quantize_one_row(x, r, values, scales, vnni);
            for (int64_t b = r * blocks; b < (r + 1) * blocks; ++b) {
                int32_t sum = 0;
                for (int64_t i = 0; i < kActBlock; ++i) sum += values[b * kActBlock + i];
                sums[b] = sum;
            }
            if (group_sums == nullptr) continue;
            for (int64_t g = r * groups; g < (r + 1) * groups; ++g) {
                float total = 0.0f;
                for (int64_t b = g * group_blocks; b < (g + 1) * group_blocks; ++b) {
                    total += scales[b] * static_cast<float>(sums[b]);
                }
                group_sums[g] = total;
            }
        }
    });
}

// The int8-activation path's work items: a tile's rows at any count (its integer products are
// what makes it fast, so many rows do not switch to de-quantized bf16 as the exact path does).
void run_int8(const ActRows& xa, int64_t m, const Weights& w, torch::Tensor& out, bool vnni) {
    const int64_t column_items = padded_columns(w.n) / kBlockCols, blocks = w.k / kActBlock;
    const int64_t fewest_blocks = (m + kRowBlock - 1) / kRowBlock;
    const int64_t block_rows = ((m + fewest_blocks - 1) / fewest_blocks + 7) / 8 * 8;
    const int64_t items = (m + block_rows - 1) / block_rows * column_items;
    const bool is_bf16 = out.scalar_type() == at::kBFloat16;
    at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t row0 = i / column_items * block_rows, rows = std::min(block_rows, m - row0);
            const int64_t block = 2 * (i % column_items);
            const ActRows xr{xa.values + row0 * w.k, xa.scales + row0 * blocks,
                             xa.sums ? xa.sums + row0 * blocks : nullptr};
            const float* xs = w.xsums ? w.xsums + row0 * w.groups : nullptr;
            // The same for either output type: the item's rows, vector or portable.
            auto item = [&](auto* op) {
#if defined(PAGEDSERVE_X86)
                if (vnni) {
                    item_int8(rows, xr, xs, w, op, block);
                    return;
                }
#endif
                portable_int8_block(xr, rows, w, op, block, row0);
                portable_int8_block(xr, rows, w, op, block + 1, row0);
            };
            if (is_bf16) {
                item(out.data_ptr<at::BFloat16>() + row0 * w.n);
            } else {
                item(out.data_ptr<float>() + row0 * w.n);
            }
        }
    });
}

// x [M, K] bf16 or float32. q: the weight as quant_layout.pack lays it out, [n, K] int8 (8-bit)
// or [n, K / 2] uint8 (4-bit), a view of the padded blocks as bf16_linear's packed weight is (its
// size says the layer's shape); scales and mins [n, groups] float32 the same way; bias [n] float32
// or none. Returns [M, n] in x's dtype. `vector`: the AVX512 code (where the CPU has it), else the
// portable loop.
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                  const std::optional<torch::Tensor>& mins, const std::optional<torch::Tensor>& bias, bool vector,
                  bool int8_activations) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                "quant_linear: x is a contiguous 2-d bf16 or float32 tensor");
    const int64_t m = x.size(0), k = x.size(1);
    TORCH_CHECK(k % 2 == 0, "quant_linear: an even number of input features");
    TORCH_CHECK(q.scalar_type() == at::kChar || q.scalar_type() == at::kByte,
                "quant_linear: q is int8 (8-bit) or uint8 (4-bit, two a byte)");
    const bool four_bit = q.scalar_type() == at::kByte;
    const int64_t row_bytes = four_bit ? k / 2 : k;
    TORCH_CHECK(q.dim() == 2 && q.size(1) == row_bytes && q.size(0) > 0 && q.storage_offset() == 0 &&
                    q.storage().nbytes() == static_cast<size_t>(padded_columns(q.size(0)) * row_bytes),
                "quant_linear: q is the weight as quant_layout.pack lays it out, for x's ", k, " inputs");
    const int64_t n = q.size(0);
    const auto laid_out = [n](const torch::Tensor& t, int64_t groups) {
        return t.dim() == 2 && t.size(0) == n && t.size(1) == groups && t.scalar_type() == at::kFloat &&
               t.storage_offset() == 0 &&
               t.storage().nbytes() == static_cast<size_t>(padded_columns(n) * groups * 4);
    };
    const int64_t groups = scales.dim() == 2 ? scales.size(1) : 0;
    TORCH_CHECK(groups > 0 && k % groups == 0 && (k / groups) % 2 == 0 && laid_out(scales, groups),
                "quant_linear: scales are [n, groups] float32 as quant_layout.pack lays them out, groups of an "
                "even size");
    TORCH_CHECK(!mins || laid_out(*mins, groups), "quant_linear: mins are laid out as the scales are");
    TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == n && bias->scalar_type() == at::kFloat),
                "quant_linear: bias is n contiguous float32 values");
    TORCH_CHECK(!int8_activations || (k / groups) % kActBlock == 0,
                "quant_linear: int8 activations are for weights in groups of a multiple of ", kActBlock,
                " inputs");
    // Bias and input sums are set below, for this file's own paths (tiles_linear adds the bias).
    Weights w{static_cast<const uint8_t*>(q.data_ptr()), scales.data_ptr<float>(), mins ? mins->data_ptr<float>() : nullptr,
              nullptr, nullptr, n, k, k / 2, groups, k / groups / 2, four_bit ? 16 : 32};
#if defined(PAGEDSERVE_X86) && defined(__AMX_BF16__)
    if (vector && vector_path() && x.scalar_type() == at::kBFloat16 && m >= kTileRows) {
        return tiles_linear(x, w, four_bit, bias);
    }
#endif
    auto out = torch::empty({m, n}, x.options());
    if (m == 0) return out;
    const bool is_bf16 = x.scalar_type() == at::kBFloat16;
    // Each group's sum of a row's inputs, which the group's min multiplies. A plain loop: at a
    // decode step's few rows, torch ops here cost more than the sums (three ops a linear took
    // the default model's 120 linears at 1 row from ~8 to ~14 ms).
    std::vector<float> xsums;
    // 4-bit bf16 on the exact path: the 128 offset's sums.
    const bool need_xsums = mins || (four_bit && is_bf16 && !int8_activations);
    // The int8 path's rounded rows, uninitialized (every byte is written; zeroing m x k bytes a
    // linear cost a serial pass of its own).
    std::unique_ptr<int8_t[]> values;
    std::vector<float> act_scales;
    std::vector<int32_t> act_sums;
    const bool vnni = vector && vnni_path();
    if (int8_activations) {
        values.reset(new int8_t[m * k]);
        act_scales.resize(m * (k / kActBlock));
        act_sums.resize(m * (k / kActBlock));
        // The min multiplies the group's sum of the *rounded* inputs (over its blocks, d x the
        // block's integer sum), so that a weight's whole value, q x scale + min, meets the same
        // rounded input: the output's error is then the de-quantized weights times the rounding,
        // as in llama.cpp's Q4_0 x Q8_0. With the unrounded sums it was q x scale's, several
        // times larger where the min is near -8 x scale (Q4_0, symmetric int4).
        if (need_xsums) xsums.resize(m * groups);
        quantize_rows(x, m, groups, values.get(), act_scales.data(), act_sums.data(),
                      need_xsums ? xsums.data() : nullptr, vnni);
    } else if (need_xsums) {
        xsums.assign(m * groups, 0.0f);
        const int64_t group = k / groups;
        const at::BFloat16* xb = is_bf16 ? x.data_ptr<at::BFloat16>() : nullptr;
        const float* xf = is_bf16 ? nullptr : x.data_ptr<float>();
        for (int64_t i = 0; i < m * k; ++i) {
            xsums[i / group] += xb != nullptr ? static_cast<float>(xb[i]) : xf[i];
        }
    }
    w.bias = bias ? bias->data_ptr<float>() : nullptr;
    w.xsums = need_xsums ? xsums.data() : nullptr;
    if (int8_activations) {
        run_int8(ActRows{values.get(), act_scales.data(), four_bit ? nullptr : act_sums.data()}, m, w, out, vnni);
        return out;
    }
    const bool fast = vector && vector_path();
    // From how many rows a work item de-quantizes its weights into bf16 first (see
    // dequantize_bf16): past the decode row counts. Below, the steps are widened in registers
    // for every tile of 8 rows, which at 8-32 rows costs less than writing and reading back the
    // item (de-quantized, or widened once into a bf16 buffer without its scales: both measured
    // slower, bench/quant_kernel.py).
    const int64_t dense_from = kPrefetchRows + 1;
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
            const float* xs = w.xsums ? w.xsums + row0 * groups : nullptr;
            if (is_bf16) {
                const auto* xp = x.data_ptr<at::BFloat16>() + row0 * k;
                auto* op = out.data_ptr<at::BFloat16>() + row0 * n;
#if defined(PAGEDSERVE_X86)
                if (fast && rows >= dense_from) {
                    four_bit ? item_prefill<4>(rows, xp, w, op, block) : item_prefill<8>(rows, xp, w, op, block);
                    continue;
                }
                if (fast) {
                    const bool prefetch = rows <= kPrefetchRows;
                    if (four_bit) {
                        prefetch ? item_bf16<4, true>(rows, xp, xs, w, op, block)
                                 : item_bf16<4, false>(rows, xp, xs, w, op, block);
                    } else {
                        prefetch ? item_bf16<8, true>(rows, xp, xs, w, op, block)
                                 : item_bf16<8, false>(rows, xp, xs, w, op, block);
                    }
                    continue;
                }
#endif
                portable_item(xp, rows, w, op, block, row0);
            } else {
                const auto* xp = x.data_ptr<float>() + row0 * k;
                auto* op = out.data_ptr<float>() + row0 * n;
#if defined(PAGEDSERVE_X86)
                if (fast) {
                    four_bit ? item_f32<4>(rows, xp, xs, w, op, block) : item_f32<8>(rows, xp, xs, w, op, block);
                    continue;
                }
#endif
                portable_item(xp, rows, w, op, block, row0);
            }
        }
    });
    return out;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                     const std::optional<torch::Tensor>& mins, const std::optional<torch::Tensor>& bias,
                     bool int8_activations) {
    return run(x, q, scales, mins, bias, true, int8_activations);
}

torch::Tensor linear_portable(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                              const std::optional<torch::Tensor>& mins, const std::optional<torch::Tensor>& bias,
                              bool int8_activations) {
    return run(x, q, scales, mins, bias, false, int8_activations);
}

// The activations as the int8 path quantizes them (to check it against a torch reference):
// `vector`, the AVX512 code where the CPU has it, else the portable loop.
std::tuple<torch::Tensor, torch::Tensor> quantize_activations(const torch::Tensor& x, bool vector) {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kActBlock == 0 &&
                    (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
                "quantize_activations: x is a contiguous 2-d bf16 or float32 tensor, a multiple of ", kActBlock,
                " inputs a row");
    const int64_t m = x.size(0), k = x.size(1);
    auto values = torch::empty({m, k}, x.options().dtype(at::kChar));
    auto scales = torch::empty({m, k / kActBlock}, x.options().dtype(at::kFloat));
    std::vector<int32_t> sums(m * (k / kActBlock));
    quantize_rows(x, m, 1, values.data_ptr<int8_t>(), scales.data_ptr<float>(), sums.data(), nullptr,
                  vector && vnni_path());
    return {values, scales};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
    m.def("quant_linear(Tensor x, Tensor q, Tensor scales, Tensor? mins, Tensor? bias, bool int8_activations=False) "
          "-> Tensor",
          &linear);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("vector_path", &vector_path, "whether this CPU takes the AVX512-BF16 code");
    m.def("linear_portable", &linear_portable, "the portable loop, whatever the CPU has (for checks)");
    m.def("tile_rows", [] { return kTileRows; },
          "from how many bf16 rows the weight is de-quantized for torch's AMX matmul (0: no AMX build)");
    m.def("vnni_path", &vnni_path, "whether this CPU takes the int8-activation code (AVX512-VNNI, VBMI and BF16)");
    m.def("quantize_activations", &quantize_activations, "x's int8 values and scales per block of 32");
}
