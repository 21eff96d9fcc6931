// Every decoder layer of a Llama-shaped model in one C++ call on the CPU.
//
// A decode step of a small model is a few hundred small ops; from Python each costs its
// interpreter frames, argument parsing and dispatch (~10 us), which on a 2-core machine ran on
// one core while the other waited: half of a 16-row decode step of the default model. This loop
// makes the same calls, in the same order, with the same operands as the Python layers with the
// fused CPU ops (engine/models/llama.py, engine/models/layers/, kernels/attention/cpu_backend.py),
// so its outputs are the same numbers; only the residual add before a layer's first norm goes
// into that norm (add_rms_norm rounds the sum as torch's add does).
//
// The fused ops and the attention kernels are reached as torch operators (registered by
// fused_ops.cpp, paged_attention.cpp, prefill_attention.cpp, bf16_linear.cpp and quant_linear.cpp,
// which must be loaded first); the linear layers through the kernel the weights were packed for
// (bf16_linear or oneDNN's prepacked matmul, kernels/cpu/packed_linear.py; quant_linear for
// quantized weights), else at::linear.

#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

c10::OperatorHandle op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

struct Ops {
    c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm =
        op("pagedserve::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    c10::TypedOperatorHandle<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>
        add_rms_norm = op("pagedserve::add_rms_norm")
                           .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
    c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_mul =
        op("pagedserve::silu_mul").typed<at::Tensor(const at::Tensor&)>();
    c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&)> rotary =
        op("pagedserve::rotary_").typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, int64_t, double)>
        paged_attention = op("pagedserve::paged_attention")
                              .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                          const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                                          int64_t, double)>();
    c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, int64_t)>
        prefill_attention = op("pagedserve::prefill_attention")
                                .typed<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
                                            int64_t)>();
    c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                        const OptTensor&, bool)>
        quant_linear = op("pagedserve::quant_linear")
                           .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&,
                                             const OptTensor&, bool)>();
    c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)> bf16_linear =
        op("pagedserve::bf16_linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>();
    c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view,
                                        c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>
        packed_linear = op("mkldnn::_linear_pointwise")
                            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, c10::string_view,
                                              c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
};

struct Linear {
    // The weight as loaded, or its packed copy; with `scales`, `packed` is the quantized weight
    // (with `mins` where its format has them, `bias` float32), as kernels/cpu/quant_layout.py
    // lays them out.
    OptTensor weight, packed, scales, mins, bias;
    bool int8_activations;  // the quantized weight multiplied with int8 activations (--quantize-activations)

    // `own_layout`: packed for bf16_linear, else for oneDNN.
    at::Tensor operator()(const Ops& ops, const at::Tensor& x, bool own_layout) const {
        if (scales) return ops.quant_linear.call(x, *packed, *scales, mins, bias, int8_activations);
        if (!packed) return at::linear(x, *weight, bias);
        if (own_layout) return ops.bf16_linear.call(x, *packed, bias);
        return ops.packed_linear.call(x, *packed, bias, "none", c10::List<std::optional<at::Scalar>>(), "");
    }
};

// How many tensors (or Nones) describe one layer, in the order of LAYER_TENSORS in
// kernels/cpu/layer_stack.py: 0 the input norm, 1-5 qkv (weight, packed, scales, mins, bias), 6-7
// the q and k norms, 8-12 o, 13 the post-attention norm, 14-18 gate_up, 19-23 down.
constexpr size_t kTensorsPerLayer = 24;

struct Layer {
    at::Tensor input_norm, post_norm;
    OptTensor q_norm, k_norm;
    Linear qkv, o, gate_up, down;
    int64_t window;  // 0: none
    int64_t plan;    // which of a step's chunk plans (one per distinct window) this layer reads
};

// One prefill chunk that goes to SDPA: query rows [start, end); `slots`, the cache slots of its
// keys (none: a fresh prompt's own K/V); `mask`, additive (none: causal).
using Chunk = std::tuple<int64_t, int64_t, OptTensor, OptTensor>;

at::Tensor heads_first(const at::Tensor& x) { return x.transpose(0, 1).unsqueeze(0); }

class LayerStack {
  public:
    // `own_layout`: the packed weights are bf16_linear's (else oneDNN's). `int8_linears`: per
    // layer, whether its qkv, o, gate_up and down take int8 activations.
    LayerStack(const std::vector<OptTensor>& tensors, std::vector<int64_t> windows, std::vector<int64_t> plans,
               int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double qk_eps, double scale,
               bool own_layout, const std::vector<bool>& int8_linears)
        : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), qk_eps_(qk_eps), scale_(scale),
          own_layout_(own_layout) {
        TORCH_CHECK(tensors.size() == windows.size() * kTensorsPerLayer && windows.size() == plans.size() &&
                        int8_linears.size() == 4 * windows.size(),
                    "LayerStack: ", kTensorsPerLayer, " tensors, a window, a plan and 4 int8 flags per layer");
        for (size_t i = 0; i < windows.size(); ++i) {
            const OptTensor* t = tensors.data() + i * kTensorsPerLayer;
            layers_.push_back(Layer{*t[0], *t[13], t[6], t[7], Linear{t[1], t[2], t[3], t[4], t[5], int8_linears[4 * i]},
                                    Linear{t[8], t[9], t[10], t[11], t[12], int8_linears[4 * i + 1]},
                                    Linear{t[14], t[15], t[16], t[17], t[18], int8_linears[4 * i + 2]},
                                    Linear{t[19], t[20], t[21], t[22], t[23], int8_linears[4 * i + 3]}, windows[i],
                                    plans[i]});
        }
    }

    // x [tokens, hidden]: the embeddings; cos, sin [tokens, head_dim]. `store_rows`: the rows
    // whose K/V are stored (none: all), at `store_slots`. Requests with more than `max_query_len`
    // query rows go to SDPA as `plans` say, or, `long_chunks` of them, to the prefill kernel.
    // Returns the last layer's output.
    at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                       const OptTensor& store_rows, const at::Tensor& store_slots, const at::Tensor& block_tables,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& seqlens_k, int64_t max_query_len,
                       const std::vector<std::vector<Chunk>>& plans, int64_t long_chunks, int64_t num_reqs) const {
        TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(),
                    "LayerStack: a K and a V cache per layer");
        at::Tensor residual = x, h = ops_.rms_norm.call(x, layers_[0].input_norm, eps_), mlp_out;
        for (size_t i = 0; i < layers_.size(); ++i) {
            const Layer& layer = layers_[i];
            if (i > 0) std::tie(h, residual) = pair(ops_.add_rms_norm.call(mlp_out, residual, layer.input_norm, eps_));
            const at::Tensor attn = attention(layer, h, cos, sin, k_caches[i], v_caches[i], store_rows, store_slots,
                                              block_tables, cu_seqlens_q, seqlens_k, max_query_len,
                                              plans.at(layer.plan), long_chunks, num_reqs);
            std::tie(h, residual) = pair(ops_.add_rms_norm.call(attn, residual, layer.post_norm, eps_));
            mlp_out = layer.down(ops_, ops_.silu_mul.call(layer.gate_up(ops_, h, own_layout_)), own_layout_);
        }
        return at::add(residual, mlp_out);
    }

  private:
    at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight) const {
        at::Tensor y = x.to(at::kFloat);
        y = y * at::rsqrt(y.pow(2).mean(-1, /*keepdim=*/true) + qk_eps_);
        return weight * y.to(x.scalar_type());
    }

    static std::tuple<at::Tensor, at::Tensor> pair(std::vector<at::Tensor> v) { return {v[0], v[1]}; }

    at::Tensor attention(const Layer& layer, const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache, const OptTensor& store_rows,
                         const at::Tensor& store_slots, const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                         const at::Tensor& seqlens_k, int64_t max_query_len, const std::vector<Chunk>& chunks,
                         int64_t long_chunks, int64_t num_reqs) const {
        const int64_t q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
        const at::Tensor qkv = layer.qkv(ops_, h, own_layout_);
        at::Tensor q = qkv.narrow(1, 0, q_size).view({-1, heads_, head_dim_});
        at::Tensor k = qkv.narrow(1, q_size, kv_size).view({-1, kv_heads_, head_dim_});
        const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({-1, kv_heads_, head_dim_});
        if (layer.q_norm) {  // torch ops, as the Python layer's per-head norms (RMSNorm without fused ops)
            q = head_norm(q, *layer.q_norm);
            k = head_norm(k, *layer.k_norm);
        }
        ops_.rotary.call(q, cos, sin);
        ops_.rotary.call(k, cos, sin);

        const at::Tensor k_rows = k_cache.view({-1, kv_heads_, head_dim_});
        const at::Tensor v_rows = v_cache.view({-1, kv_heads_, head_dim_});
        k_rows.index_copy_(0, store_slots, (store_rows ? k.index_select(0, *store_rows) : k).to(k_cache.scalar_type()));
        v_rows.index_copy_(0, store_slots, (store_rows ? v.index_select(0, *store_rows) : v).to(v_cache.scalar_type()));

        q = q.contiguous();
        const at::Tensor out = at::empty_like(q);
        if (static_cast<int64_t>(chunks.size()) + long_chunks < num_reqs) {
            ops_.paged_attention.call(out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale_,
                                      max_query_len, layer.window, 0.0);
        }
        if (long_chunks > 0) {
            ops_.prefill_attention.call(out, q, k_cache, v_cache, block_tables, cu_seqlens_q, seqlens_k, scale_,
                                        max_query_len, layer.window);
        }
        for (const auto& [start, end, slots, mask] : chunks) {
            const at::Tensor keys = slots ? k_rows.index_select(0, *slots) : k.narrow(0, start, end - start);
            const at::Tensor values = slots ? v_rows.index_select(0, *slots) : v.narrow(0, start, end - start);
            const at::Tensor attn = at::scaled_dot_product_attention(
                heads_first(q.narrow(0, start, end - start)), heads_first(keys), heads_first(values), mask, 0.0,
                !mask.has_value(), scale_, /*enable_gqa=*/true);
            out.narrow(0, start, end - start).copy_(attn.squeeze(0).transpose(0, 1));
        }
        return layer.o(ops_, out.view({-1, q_size}), own_layout_);
    }

    Ops ops_;
    std::vector<Layer> layers_;
    int64_t heads_, kv_heads_, head_dim_;
    double eps_, qk_eps_, scale_;
    bool own_layout_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    py::class_<LayerStack>(m, "LayerStack")
        .def(py::init<const std::vector<OptTensor>&, std::vector<int64_t>, std::vector<int64_t>, int64_t, int64_t,
                      int64_t, double, double, double, bool, const std::vector<bool>&>())
        .def("forward", &LayerStack::forward, py::call_guard<py::gil_scoped_release>());
}
