// A whole pre-norm decoder layer in one call (app/models/quant/fused_decode.py):
//   h' + mlp(norm2(h')) where h' = h + o(attention(rope(qkv(norm1(h)))))
// with, where set after construction, RMSNorm over each query and key head before RoPE
// (Qwen3) and routed experts for the MLP (moe_experts.cpp: Qwen3-MoE, Mixtral), with a
// gated shared expert beside them (Qwen2-MoE).
// for a step whose every token goes through the decode kernel (decodes; prompt tokens too
// under TorchPagedAttention.token_by_token), on quantised weights and float32 hidden states.
//
// Each op is the one the layer's Python forward calls, with the same arguments, in the same
// order: the C++ kernels of app/models/cpu_kernels (RMSNorm, RoPE, cache writes, paged
// decode attention, silu_mul), quant_matmul's product, and torch's adds. A decode is
// then bit for bit what the Python layer computes, and a sequence's tokens do not depend on
// whether its step took this path. What goes is the Python between the ops: ~15 module
// calls and ~100 attribute lookups per layer, about half of a 135M model's decode step.
#include <torch/extension.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "../cpu_kernels/decode_attention.h"
#include "../cpu_kernels/norm_rope.h"
#include "../cpu_kernels/silu_mul.h"
#include "matmul.h"

namespace shoal_quant {
namespace {

using at::Tensor;

// One packed weight of a linear layer: its rows fill output columns [start, start + n).
struct Run {
  int64_t qtype;
  std::vector<Tensor> parts;
  int64_t n, k, start;
};
using RunSpec = std::tuple<int64_t, std::vector<Tensor>, int64_t, int64_t, int64_t>;

struct Linear {
  std::vector<Run> runs;
  int64_t n = 0;

  explicit Linear(const std::vector<RunSpec>& specs) {
    for (const auto& [qtype, parts, rows, k, start] : specs) {
      runs.push_back({qtype, parts, rows, k, start});
      n = std::max(n, start + rows);
    }
  }

  // Whether every run takes rows of k weights (matmul_into trusts x's width).
  bool takes(int64_t k) const {
    return std::all_of(runs.begin(), runs.end(), [k](const Run& r) { return r.k == k; });
  }

  // A new (T, n) float32 tensor: x @ W^T, run by run, as QuantLinear.forward does.
  Tensor operator()(const Tensor& x, int64_t activations) const {
    Tensor out = at::empty({x.size(0), n}, x.options());
    for (const Run& r : runs) {
      Tensor part = runs.size() == 1 ? out : out.narrow(1, r.start, r.n);
      matmul_into(x, r.qtype, r.parts, r.n, r.k, part, 0, 0, activations);
    }
    return out;
  }
};

class DecodeLayer {
 public:
  DecodeLayer(Tensor input_norm, Tensor post_attention_norm, double eps, const std::vector<RunSpec>& qkv,
              std::optional<Tensor> qkv_bias, const std::vector<RunSpec>& o, const std::vector<RunSpec>& gate_up,
              const std::vector<RunSpec>& down, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
              double scale, int64_t window)
      : input_norm_(std::move(input_norm)),
        post_attention_norm_(std::move(post_attention_norm)),
        eps_(eps),
        qkv_(qkv),
        qkv_bias_(std::move(qkv_bias)),
        o_(o),
        gate_up_(gate_up),
        down_(down),
        nh_(num_heads),
        nkv_(num_kv_heads),
        hd_(head_dim),
        scale_(scale),
        window_(window) {
    const int64_t hidden = input_norm_.size(0);
    TORCH_CHECK(input_norm_.scalar_type() == at::kFloat && post_attention_norm_.scalar_type() == at::kFloat,
                "norm weights must be float32");
    TORCH_CHECK(nkv_ > 0 && nh_ % nkv_ == 0 && (!shoal_cpu::kVectorized || hd_ % 16 == 0),
                "query heads must be a multiple of kv heads (and head_dim of 16 with AVX-512)");
    // No dense MLP (both empty): set_moe gives the layer its experts.
    TORCH_CHECK(qkv_.n == (nh_ + 2 * nkv_) * hd_ && o_.n == hidden &&
                    ((down_.n == hidden && gate_up_.n % 2 == 0) || (down_.n == 0 && gate_up_.n == 0)),
                "layer shapes do not fit: qkv ", qkv_.n, ", o ", o_.n, ", gate_up ", gate_up_.n, ", down ", down_.n);
  }

  void set_qk_norms(Tensor q_norm, Tensor k_norm) {
    TORCH_CHECK(q_norm.scalar_type() == at::kFloat && k_norm.scalar_type() == at::kFloat && q_norm.numel() == hd_ &&
                    k_norm.numel() == hd_,
                "q/k norm weights must be (head_dim,) float32");
    qk_norms_ = {q_norm.contiguous(), k_norm.contiguous()};
  }

  // The router: packed runs (a quantized gate) or, with none, a float weight (E, hidden).
  void set_moe(const std::vector<RunSpec>& router, std::optional<Tensor> router_weight, int64_t top_k,
               bool normalize, int64_t gu_qtype, std::vector<Tensor> gu_parts, int64_t dn_qtype,
               std::vector<Tensor> dn_parts, int64_t inter) {
    TORCH_CHECK(down_.n == 0 && (router.empty() != !router_weight.has_value()),
                "a MoE layer has no dense MLP, and one router");
    router_ = Linear(router);
    router_weight_ = std::move(router_weight);
    moe_ = MoeWeights{top_k, normalize, gu_qtype, std::move(gu_parts), dn_qtype, std::move(dn_parts), inter};
  }

  // A shared expert (a dense MLP every token takes), added to the routed sum scaled by
  // sigmoid(gate(x)): the gate packed runs or, with none, a float weight (1, hidden).
  void set_shared_expert(const std::vector<RunSpec>& gate_up, const std::vector<RunSpec>& down,
                         const std::vector<RunSpec>& gate, std::optional<Tensor> gate_weight) {
    TORCH_CHECK(moe_ && shared_down_.n == 0, "set_moe first, and one shared expert");
    TORCH_CHECK(gate.empty() != !gate_weight.has_value(), "one gate for the shared expert");
    const int64_t hidden = input_norm_.size(0);
    const Linear gu(gate_up), dn(down), g(gate);
    TORCH_CHECK(gu.n % 2 == 0 && gu.takes(hidden) && dn.n == hidden && dn.takes(gu.n / 2) &&
                    (gate_weight ? gate_weight->dim() == 2 && gate_weight->size(0) == 1 &&
                                       gate_weight->size(1) == hidden && gate_weight->scalar_type() == at::kFloat
                                 : g.n == 1 && g.takes(hidden)),
                "shared expert shapes do not fit a hidden size of ", hidden);
    shared_gate_up_ = gu;
    shared_down_ = dn;
    shared_gate_ = g;
    shared_gate_weight_ = std::move(gate_weight);
  }

  // h (T, hidden) float32, one decode token per row; cos/sin (T, head_dim) float32; slots
  // (T,) int64 cache slots of this step's tokens; tables (T, blocks) and lens (T,) int32
  // as paged_decode_attention takes them. Returns the layer's output (T, hidden).
  Tensor forward(const Tensor& h, const Tensor& cos, const Tensor& sin, Tensor k_cache, Tensor v_cache,
                 const Tensor& slots, const Tensor& tables, const Tensor& lens, int64_t activations) const {
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == at::kFloat, "h must be (T, hidden) float32");
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
    TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kInt &&
                    lens.scalar_type() == at::kInt && slots.size(0) == h.size(0) && lens.size(0) == h.size(0),
                "slots (T,) int64, tables (T, blocks) and lens (T,) int32");
    TORCH_CHECK(tables.dim() == 2 && tables.size(0) == h.size(0) && cos.size(0) == h.size(0) &&
                    cos.size(1) == hd_ && sin.sizes() == cos.sizes() && cos.scalar_type() == at::kFloat &&
                    sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
                "tables (T, blocks); cos and sin (T, head_dim) float32");
    TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(1) == nkv_ && k_cache.size(3) == hd_ &&
                    v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
                "caches (blocks, kv heads, block size, head_dim)");
    const int64_t T = h.size(0), q_size = nh_ * hd_, kv_size = nkv_ * hd_;
    Tensor x = at::empty_like(h);
    shoal_cpu::rms_norm_impl<float>(x, h, input_norm_, eps_);
    TORCH_CHECK(moe_ || down_.n > 0, "the layer has no MLP");
    Tensor qkv = qkv_(x, activations);
    if (qkv_bias_) qkv += *qkv_bias_;
    if (qk_norms_) {
      norm_heads(qkv, 0, nh_, qk_norms_->first);
      norm_heads(qkv, q_size, nkv_, qk_norms_->second);
    }
    shoal_cpu::rotary_impl<float>(qkv, cos, sin, nh_ + nkv_);
    const Tensor k = qkv.narrow(1, q_size, kv_size).view({T, nkv_, hd_});
    const Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, nkv_, hd_});
    const Tensor q = qkv.narrow(1, 0, q_size).view({T, nh_, hd_}).contiguous();
    Tensor attn = at::empty_like(q);
    shoal_cpu::with_cache_type<float>(k_cache.scalar_type(), [&](auto* tag) {
      using cache_t = std::remove_pointer_t<decltype(tag)>;
      shoal_cpu::write<float, cache_t>(k, v, k_cache, v_cache, slots.contiguous());
      shoal_cpu::decode<float, cache_t>(attn, q, k_cache, v_cache, tables.contiguous(), lens.contiguous(), scale_,
                                        window_, 0.0);
    });
    const Tensor h1 = h + o_(attn.view({T, q_size}), activations);
    shoal_cpu::rms_norm_impl<float>(x, h1, post_attention_norm_, eps_);
    if (moe_) {
      const Tensor logits = router_weight_ ? at::linear(x, *router_weight_) : router_(x, activations);
      Tensor out = moe_experts(x, logits, *moe_, activations);
      if (shared_down_.n > 0) {  // SparseMoE.forward's order: the expert, then its gate
        const Tensor shared = shared_down_(shoal_cpu::silu_mul(shared_gate_up_(x, activations)), activations);
        const Tensor g = shared_gate_weight_ ? at::linear(x, *shared_gate_weight_) : shared_gate_(x, activations);
        out += at::sigmoid(g) * shared;
      }
      return h1 + out;
    }
    const Tensor gate_up = gate_up_(x, activations);
    const Tensor hidden = shoal_cpu::silu_mul(gate_up);
    return h1 + down_(hidden, activations);
  }

 private:
  // RMSNorm over each of `heads` heads at column `offset` of qkv, in place, as the Python
  // path does it (Attention._norm_heads: the heads as rows of a copy, normed, copied back).
  void norm_heads(Tensor& qkv, int64_t offset, int64_t heads, const Tensor& weight) const {
    const int64_t T = qkv.size(0);
    Tensor part = qkv.narrow(1, offset, heads * hd_);
    const Tensor rows = part.reshape({T * heads, hd_});
    Tensor normed = at::empty_like(rows);
    shoal_cpu::rms_norm_impl<float>(normed, rows, weight, eps_);
    part.copy_(normed.view({T, heads * hd_}));
  }

  Tensor input_norm_, post_attention_norm_;
  double eps_;
  Linear qkv_;
  std::optional<Tensor> qkv_bias_;
  Linear o_, gate_up_, down_;
  int64_t nh_, nkv_, hd_;
  double scale_;
  int64_t window_;
  std::optional<std::pair<Tensor, Tensor>> qk_norms_;
  Linear router_{std::vector<RunSpec>{}};
  std::optional<Tensor> router_weight_;
  std::optional<MoeWeights> moe_;
  Linear shared_gate_up_{std::vector<RunSpec>{}}, shared_down_{std::vector<RunSpec>{}};
  Linear shared_gate_{std::vector<RunSpec>{}};
  std::optional<Tensor> shared_gate_weight_;
};

}  // namespace

void bind_decode_layer(pybind11::module_& m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  pybind11::class_<DecodeLayer>(m, "DecodeLayer")
      .def(pybind11::init<Tensor, Tensor, double, const std::vector<RunSpec>&, std::optional<Tensor>,
                          const std::vector<RunSpec>&, const std::vector<RunSpec>&, const std::vector<RunSpec>&,
                          int64_t, int64_t, int64_t, double, int64_t>())
      .def("set_qk_norms", &DecodeLayer::set_qk_norms, "RMSNorm over each query and key head")
      .def("set_moe", &DecodeLayer::set_moe, "routed experts in place of the dense MLP")
      .def("set_shared_expert", &DecodeLayer::set_shared_expert, "a gated shared expert beside them")
      .def("forward", &DecodeLayer::forward, "the layer's output for a step of decodes", no_gil());
}

}  // namespace shoal_quant
