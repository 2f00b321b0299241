// silu(gate) * up, the gated MLP's activation, for quantized models: the fused decoder
// layers (app/models/quant/decode_layer.cpp) and DenseMLP's Python path both call this,
// so a token gets the same bits either way. Each column goes through the same arithmetic
// in every row (rows are walked from their start: vectors, then a scalar tail at the same
// columns), so a row's result does not depend on the step's row count or its threads.
// torch's silu, which this replaces on AVX2 and AVX-512, vectorises over the whole
// tensor, so a thread's chunk could end mid-row; it also cost two dispatched ops per
// layer, and on a prefill's experts (16k rows of strided halves) a tenth of the step.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>

#include "vector_math.h"

namespace shoal_cpu {

#if defined(__AVX512F__)
// As the AVX2 row below, 16 wide with exp16.
inline void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  const __m512 one = _mm512_set1_ps(1.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 num = _mm512_mask_mul_ps(x, neg, x, e);
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(num, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float x = g[i], e = std::exp(-std::fabs(x));
    out[i] = (x >= 0.f ? x : x * e) / (1.f + e) * u[i];
  }
}
#elif defined(SHOAL_CPU_AVX2)
// silu(x) = x / (1 + e^-x) = x e^x / (1 + e^x): both forms from e = exp(-|x|) <= 1, the
// range exp8 covers. A NaN stays NaN. exp8 stops at e^-87.3, so below x = -87.3 this
// gives x * 1.2e-38 rather than ~0: the same value in every row, which is what matters
// here, and only for inputs that have already blown up.
inline void silu_mul_row(const float* g, const float* u, float* out, int64_t n) {
  const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_or_ps(x, sign));
    const __m256 num = _mm256_blendv_ps(_mm256_mul_ps(x, e), x, _mm256_cmp_ps(x, zero, _CMP_GE_OQ));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(num, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    const float x = g[i], e = std::exp(-std::fabs(x));
    out[i] = (x >= 0.f ? x : x * e) / (1.f + e) * u[i];
  }
}
#endif

// gate_up (T, 2 * inter) float32, rows contiguous -> (T, inter).
inline at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat &&
                  gate_up.size(1) > 0 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be (T, 2 * inter) float32 on the CPU with contiguous rows");
  const int64_t T = gate_up.size(0), inter = gate_up.size(1) / 2;
#if defined(SHOAL_CPU_AVX2) || defined(__AVX512F__)
  at::Tensor out = at::empty({T, inter}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t ld = gate_up.stride(0);
  // A decode step's few rows stay on one thread: waking the others costs more.
  at::parallel_for(0, T, std::max<int64_t>(1, (int64_t(1) << 15) / inter), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_mul_row(src + t * ld, src + t * ld + inter, dst + t * inter, inter);
  });
  return out;
#else
  // Scalar builds keep torch's ops.
  return at::silu(gate_up.narrow(1, 0, inter)) * gate_up.narrow(1, inter, inter);
#endif
}

}  // namespace shoal_cpu
