// A MoE layer's routed experts in one call (app/models/quant/experts.py): the router's
// softmax and top-k (torch's own ops, so the choice is the Python path's), the (token,
// slot) rows sorted by expert, every active expert's gate|up and then down in one grouped
// product each (kernels.cpp), silu(gate) * up between, and each token's k outputs
// weighed and summed in slot order. What goes is the Python between those: a dozen small
// torch ops per layer (gathers, sorts, counts), a third of a decode step of a 64-expert
// model.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <vector>

#include "../cpu_kernels/silu_mul.h"
#include "matmul.h"

namespace shoal_quant {

using at::Tensor;

// x (T, H) float32; logits (T, E) the router's. Returns (T, H) float32.
Tensor moe_experts(const Tensor& x, const Tensor& logits, const MoeWeights& moe, int64_t activations) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be (T, H) float32");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == x.size(0), "logits must be (T, experts)");
  const int64_t T = x.size(0), H = x.size(1), E = logits.size(1), k = moe.top_k, R = T * k, inter = moe.inter;
  TORCH_CHECK(k >= 1 && k <= E && inter > 0, "top_k must be 1..", E);
  const Tensor probs = at::softmax(logits, -1, at::kFloat);
  auto [weights, chosen] = at::topk(probs, k, -1);
  if (moe.normalize) weights /= weights.sum(-1, true);
  weights = weights.contiguous();
  const Tensor chosen64 = chosen.to(at::kLong).contiguous();
  const int64_t* ch = chosen64.data_ptr<int64_t>();
  // (token, slot) rows grouped by expert, in row order within an expert: pos[r] is where
  // row r = t * k + j goes.
  std::vector<int64_t> starts(E + 1, 0), pos(R);
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(ch[r] >= 0 && ch[r] < E, "expert index out of range");
    ++starts[ch[r] + 1];
  }
  for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
  std::vector<int64_t> next(starts.begin(), starts.end() - 1);
  for (int64_t r = 0; r < R; ++r) pos[r] = next[ch[r]]++;
  const Tensor xc = x.contiguous();
  Tensor xs = at::empty({R, H}, x.options());
  const float* src = xc.data_ptr<float>();
  float* dst = xs.data_ptr<float>();
  // The copies and the weighted sums below run on every thread once a prefill's rows
  // make them worth it: a 2048-token step's took a fifth of its MoE time on one.
  at::parallel_for(0, R, 256, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) std::copy_n(src + (r / k) * H, H, dst + pos[r] * H);
  });
  Tensor gate_up = at::empty({R, 2 * inter}, x.options());
  grouped_matmul_into(xs, moe.gu_qtype, moe.gu_parts, E * 2 * inter, H, starts, gate_up, activations);
  const Tensor hidden = shoal_cpu::silu_mul(gate_up).contiguous();
  Tensor ys = at::empty({R, H}, x.options());
  grouped_matmul_into(hidden, moe.dn_qtype, moe.dn_parts, E * H, inter, starts, ys, activations);
  Tensor out = at::empty({T, H}, x.options());
  const float* y = ys.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, T, 32, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = o + t * H;
      const float* first = y + pos[t * k] * H;
      for (int64_t i = 0; i < H; ++i) row[i] = w[t * k] * first[i];
      for (int64_t j = 1; j < k; ++j) {
        const float* yj = y + pos[t * k + j] * H;
        const float wj = w[t * k + j];
        for (int64_t i = 0; i < H; ++i) row[i] += wj * yj[i];
      }
    }
  });
  return out;
}

void bind_moe_experts(pybind11::module_& m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def(
      "quant_moe_experts",
      [](const Tensor& x, const Tensor& logits, int64_t top_k, bool normalize, int64_t gu_qtype,
         const std::vector<Tensor>& gu_parts, int64_t dn_qtype, const std::vector<Tensor>& dn_parts, int64_t inter,
         int64_t activations) {
        return moe_experts(x, logits, {top_k, normalize, gu_qtype, gu_parts, dn_qtype, dn_parts, inter}, activations);
      },
      "a MoE layer's routed experts on packed weights", no_gil());
}

}  // namespace shoal_quant
