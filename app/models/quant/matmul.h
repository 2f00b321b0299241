// What decode_layer.cpp calls of kernels.cpp: the quantised product behind quant_matmul.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace shoal_quant {

enum Activations : int64_t { kAuto = 0, kFloat = 1, kInt8 = 2 };

// out = x @ W^T, x (T, K) contiguous float32, out (T, N) with unit column stride, W packed
// (formats.h). mode: 0 picks (int8 x: the GEMV; float x: the GEMV up to the format's
// kFloatGemvMaxT rows), 1 forces the GEMV, 2 forces tiles. activations: see Activations (kernels.cpp).
void matmul_into(const at::Tensor& xf, int64_t qtype, const std::vector<at::Tensor>& parts, int64_t n, int64_t k,
                 at::Tensor& out, int64_t mode, int64_t tile_rows, int64_t activations);

// Experts stacked in one packed weight (n = E * m rows): rows starts[e]..starts[e+1]-1 of
// xf times expert e, into out (R, m) (kernels.cpp, quant_grouped_matmul).
void grouped_matmul_into(const at::Tensor& xf, int64_t qtype, const std::vector<at::Tensor>& parts, int64_t n,
                         int64_t k, const std::vector<int64_t>& starts, at::Tensor& out, int64_t activations);

// A MoE layer's routed experts on packed weights (moe_experts.cpp): gate_up stacks each
// expert's gate rows then its up rows (E * 2 * inter rows), down E * hidden rows.
struct MoeWeights {
  int64_t top_k;
  bool normalize;
  int64_t gu_qtype;
  std::vector<at::Tensor> gu_parts;
  int64_t dn_qtype;
  std::vector<at::Tensor> dn_parts;
  int64_t inter;
};

// The experts' weighted sum for x (T, hidden) float32 given the router's logits (T, E).
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& logits, const MoeWeights& w, int64_t activations);

void bind_decode_layer(pybind11::module_& m);
void bind_moe_experts(pybind11::module_& m);

}  // namespace shoal_quant
