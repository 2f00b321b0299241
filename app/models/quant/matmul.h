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

void bind_decode_layer(pybind11::module_& m);

}  // namespace shoal_quant
