// The elementwise work of a decoder layer on the CPU, one pass over memory per op instead of the
// 3-9 torch ops (and as many full-size temporaries) each one is in eager torch: RMSNorm, the
// residual add fused with the RMSNorm after it, SiLU(gate) * up, and rotary embeddings in place.
//
// Each op rounds where eager torch rounds (every torch op on bf16 or fp16 returns a rounded
// tensor; these ops compute in float32 and round at the same points), so that a fused step gives
// the tokens the eager one does. Rows are split over threads with at::parallel_for.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>

namespace {

typedef float f16v __attribute__((vector_size(64)));
typedef int32_t i16v __attribute__((vector_size(64)));
typedef uint32_t u16x32 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;

// Sixteen values in and out of float32, rounding to nearest-even as torch does.
inline f16v load(const float* p) {
    f16v v;
    std::memcpy(&v, p, sizeof v);
    return v;
}
inline void store(float* p, f16v v) { std::memcpy(p, &v, sizeof v); }
// bfloat16 is the top half of a float32: widening its bits and shifting them up is exact. On
// AVX-512 both directions are spelled with intrinsics: the generic vector code compiled to two
// or three times the instructions (a split widening, a permute to narrow), and these ops are
// compute-bound at prefill sizes (silu_mul over 2,048 x 3,072 took 1.7 ms, a copy of its output
// 0.25 ms).
inline f16v load(const c10::BFloat16* p) {
#if defined(__AVX512F__)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return reinterpret_cast<f16v>(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#else
    u16x16 h;
    std::memcpy(&h, p, sizeof h);
    const u16x32 w = __builtin_convertvector(h, u16x32) << 16;
    return reinterpret_cast<const f16v&>(w);
#endif
}
// Round to nearest even, as c10::BFloat16 does. Where the CPU has AVX512-BF16 one instruction
// does it (silu_mul 1.7 -> 1.2 ms at 2,048 x 3,072, the norms and rotary 1.6-2.4x faster); it
// differs from c10 only off the numbers a model computes with: float32 subnormals (below
// 1.2e-38) become zero, and a NaN keeps its sign and payload (c10 writes 0x7FC0). Checking for
// those lanes and falling back cost more than the instruction saved.
inline void store(c10::BFloat16* p, f16v v) {
#if defined(__AVX512BF16__)
    const __m256bh h = _mm512_cvtneps_pbh(reinterpret_cast<__m512>(v));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(h));
#else
    const u16x32 bits = reinterpret_cast<const u16x32&>(v);
    u16x32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    rounded = (bits & 0x7FFFFFFFu) > 0x7F800000u ? u16x32{} + 0x7FC0u : rounded;  // NaN stays NaN
#if defined(__AVX512F__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(rounded)));
#else
    const u16x16 h = __builtin_convertvector(rounded, u16x16);
    std::memcpy(p, &h, sizeof h);
#endif
#endif
}
inline f16v load(const c10::Half* p) {
    f16v v;
    for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(p[i]);
    return v;
}
inline void store(c10::Half* p, f16v v) {
    for (int i = 0; i < kLanes; ++i) p[i] = static_cast<c10::Half>(v[i]);
}
// What storing to T and loading back gives: the rounding a torch op's T result applies.
template <typename T>
inline f16v round_to(f16v v) {
    if constexpr (std::is_same_v<T, float>) {
        return v;
    } else {
        T tmp[kLanes];
        store(tmp, v);
        return load(tmp);
    }
}
template <typename T>
inline float round_to(float v) {
    return static_cast<float>(static_cast<T>(v));
}

// a * b + c rounded once where the CPU has AVX-512 (the file is built with -ffp-contract=off,
// which keeps the compiler from fusing the products torch rounds; exp16's polynomial has no
// torch counterpart, and fusing it made silu_mul 1.13 -> 0.91-1.03 ms at 2,048 x 3,072).
inline f16v fma16(f16v a, f16v b, float c) {
#if defined(__AVX512F__)
    return reinterpret_cast<f16v>(
        _mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b), _mm512_set1_ps(c)));
#else
    return a * b + c;
#endif
}

// exp(x) on all lanes, x clamped to where float32 is finite: x = n ln2 + r with n the nearest
// integer to x / ln2 (ln2 in two parts, so that r keeps its low bits for large |x|), then
// 2^n (exponent bits) times the degree-7 Taylor polynomial of e^r, |r| <= ln2 / 2 (relative
// error ~2e-8, below float32's rounding).
inline f16v exp16(f16v x) {
    x = x < -87.0f ? f16v{} - 87.0f : x;
    x = x > 88.0f ? f16v{} + 88.0f : x;
    const f16v shifted = x * 1.4426950408889634f + 0.5f;
    f16v n = __builtin_convertvector(__builtin_convertvector(shifted, i16v), f16v);
    n = n > shifted ? n - 1.0f : n;  // floor(x / ln2 + 1/2)
    const f16v r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    f16v p = fma16(r, f16v{} + 1.0f / 5040, 1.0f / 720);
    p = fma16(p, r, 1.0f / 120);
    p = fma16(p, r, 1.0f / 24);
    p = fma16(p, r, 1.0f / 6);
    p = fma16(p, r, 0.5f);
    p = fma16(p, r, 1.0f);
    p = fma16(p, r, 1.0f);
    const i16v bits = (__builtin_convertvector(n, i16v) + 127) << 23;
    return p * reinterpret_cast<const f16v&>(bits);
}

// Calls f(T{}) for the tensor dtypes these ops take: float32, bfloat16, float16.
template <typename F>
void dispatch(at::ScalarType dtype, const char* op, F&& f) {
    switch (dtype) {
        case at::kFloat: return f(float{});
        case at::kBFloat16: return f(c10::BFloat16{});
        case at::kHalf: return f(c10::Half{});
        default: TORCH_CHECK(false, op, ": float32, bfloat16 or float16 only, not ", dtype);
    }
}

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// out[r] = weight * round(x[r] / rms(x[r])), x's rows `x_stride` apart, out contiguous.
template <typename T>
void rms_norm_rows(T* out, const T* x, int64_t x_stride, const T* weight, int64_t rows, int64_t width, float eps) {
    const int64_t vec_end = width - width % kLanes;
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T* src = x + r * x_stride;
            T* dst = out + r * width;
            f16v acc{};
            for (int64_t i = 0; i < vec_end; i += kLanes) {
                const f16v v = load(src + i);
                acc += v * v;
            }
            float sum = 0.0f;
            for (int i = 0; i < kLanes; ++i) sum += acc[i];
            for (int64_t i = vec_end; i < width; ++i) sum += static_cast<float>(src[i]) * static_cast<float>(src[i]);
            const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
            for (int64_t i = 0; i < vec_end; i += kLanes) {
                store(dst + i, load(weight + i) * round_to<T>(load(src + i) * inv));
            }
            for (int64_t i = vec_end; i < width; ++i) {
                dst[i] = static_cast<T>(static_cast<float>(weight[i]) * round_to<T>(static_cast<float>(src[i]) * inv));
            }
        }
    });
}

}  // namespace

// x: [rows, width] with unit stride along width; weight: [width]. Returns a new [rows, width].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.size(0) == x.size(1),
                "rms_norm: x [rows, width] with unit stride along width, weight [width]");
    TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
    auto out = torch::empty({x.size(0), x.size(1)}, x.options());
    dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
        using scalar_t = decltype(tag);
        rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(),
                                x.size(0), x.size(1), static_cast<float>(eps));
    });
    return out;
}

// Returns (rms_norm(residual + x), residual + x), the sum rounded as torch's add rounds it.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual, const torch::Tensor& weight,
                                        double eps) {
    TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() && x.dim() == 2,
                "add_rms_norm: x and residual contiguous [rows, width]");
    TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "add_rms_norm: x and residual must share a dtype");
    auto sum = torch::empty_like(x);
    dispatch(x.scalar_type(), "add_rms_norm", [&](auto tag) {
        using scalar_t = decltype(tag);
        const scalar_t* a = x.data_ptr<scalar_t>();
        const scalar_t* b = residual.data_ptr<scalar_t>();
        scalar_t* s = sum.data_ptr<scalar_t>();
        const int64_t n = x.numel(), vec_end = n - n % kLanes;
        at::parallel_for(0, vec_end / kLanes, 2048, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin * kLanes; i < end * kLanes; i += kLanes) store(s + i, load(b + i) + load(a + i));
        });
        for (int64_t i = vec_end; i < n; ++i) s[i] = static_cast<scalar_t>(static_cast<float>(b[i]) + static_cast<float>(a[i]));
    });
    return {rms_norm(sum, weight, eps), sum};
}

// gate_up: [rows, 2 * width] (gate columns first). Returns silu(gate) * up, [rows, width].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
                "silu_mul: gate_up contiguous [rows, 2 * width]");
    const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
    auto out = torch::empty({rows, width}, gate_up.options());
    dispatch(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
        using T = decltype(tag);
        const T* in = gate_up.data_ptr<T>();
        T* o = out.data_ptr<T>();
        const int64_t vec_end = width - width % kLanes;
        at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const T* gate = in + r * 2 * width;
                const T* up = gate + width;
                T* dst = o + r * width;
                for (int64_t i = 0; i < vec_end; i += kLanes) {
                    const f16v g = load(gate + i);
                    store(dst + i, round_to<T>(g / (1.0f + exp16(-g))) * load(up + i));
                }
                for (int64_t i = vec_end; i < width; ++i) {
                    dst[i] = static_cast<T>(round_to<T>(silu(static_cast<float>(gate[i]))) * static_cast<float>(up[i]));
                }
            }
        });
    });
    return out;
}

// In place on x [tokens, heads, dim] (unit stride along dim, heads `dim` apart, any token
// stride: the q or k columns of a fused qkv output), rotate-half layout, with cos and sin
// [tokens, dim] contiguous: x * cos + rotate_half(x) * sin, rounded as eager torch rounds.
void rotary_(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: x [tokens, heads, dim], heads packed");
    TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) && cos.size(-1) == x.size(2),
                "rotary_: cos and sin contiguous [tokens, dim]");
    TORCH_CHECK(x.scalar_type() == cos.scalar_type() && x.scalar_type() == sin.scalar_type(),
                "rotary_: x, cos and sin must share a dtype");
    const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
    TORCH_CHECK(dim % 2 == 0, "rotary_: odd head dim");
    dispatch(x.scalar_type(), "rotary_", [&](auto tag) {
        using T = decltype(tag);
        T* base = x.data_ptr<T>();
        const T* cos_p = cos.data_ptr<T>();
        const T* sin_p = sin.data_ptr<T>();
        const int64_t stride = x.stride(0);
        const int64_t vec_end = half - half % kLanes;
        at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                const T* c = cos_p + t * dim;
                const T* s = sin_p + t * dim;
                for (int64_t h = 0; h < heads; ++h) {
                    T* v = base + t * stride + h * dim;
                    for (int64_t i = 0; i < vec_end; i += kLanes) {
                        const f16v lo = load(v + i), hi = load(v + half + i);
                        const f16v new_lo = round_to<T>(lo * load(c + i)) + round_to<T>(-hi * load(s + i));
                        const f16v new_hi = round_to<T>(hi * load(c + half + i)) + round_to<T>(lo * load(s + half + i));
                        store(v + i, new_lo);
                        store(v + half + i, new_hi);
                    }
                    for (int64_t i = vec_end; i < half; ++i) {
                        const float lo = static_cast<float>(v[i]), hi = static_cast<float>(v[half + i]);
                        const float new_lo = round_to<T>(lo * static_cast<float>(c[i])) +
                                             round_to<T>(-hi * static_cast<float>(s[i]));
                        const float new_hi = round_to<T>(hi * static_cast<float>(c[half + i])) +
                                             round_to<T>(lo * static_cast<float>(s[half + i]));
                        v[i] = static_cast<T>(new_lo);
                        v[half + i] = static_cast<T>(new_hi);
                    }
                }
            }
        });
    });
}

// Also torch operators, for C++ callers that hold no Python (kernels/cpu/layer_stack.cpp).
TORCH_LIBRARY_FRAGMENT(pagedserve, m) {
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
    m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]", &add_rms_norm);
    m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
    m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &rotary_);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("rms_norm", &rms_norm, "RMSNorm of each row (CPU)");
    m.def("add_rms_norm", &add_rms_norm, "residual add, then RMSNorm (CPU)");
    m.def("silu_mul", &silu_mul, "SiLU(gate) * up (CPU)");
    m.def("rotary_", &rotary_, "rotary embedding in place, rotate-half layout (CPU)");
}
