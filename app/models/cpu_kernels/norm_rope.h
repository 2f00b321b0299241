// RMSNorm and rotate-half RoPE with float32 arithmetic, any of our dtypes in and out.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace shoal_cpu {

#if defined(__AVX512F__)
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  // round to nearest even, as c10::BFloat16 does (inputs here are finite)
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16)));
}
inline void store16(c10::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
#endif

template <typename scalar_t>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& w, double eps) {
  const int64_t T = x.size(0), H = x.size(1);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = w.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* row = xp + t * H;
      scalar_t* dst = op + t * H;
      int64_t i = 0;
      float ss = 0.f;
#if defined(__AVX512F__)
      __m512 acc = _mm512_setzero_ps();
      for (; i + 16 <= H; i += 16) {
        const __m512 v = load16(row + i);
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      ss = _mm512_reduce_add_ps(acc);
#endif
      for (int64_t j = i; j < H; ++j) {
        const float v = static_cast<float>(row[j]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
      i = 0;
#if defined(__AVX512F__)
      const __m512 iv = _mm512_set1_ps(inv);
      for (; i + 16 <= H; i += 16)
        store16(dst + i, _mm512_mul_ps(load16(wp + i), _mm512_mul_ps(load16(row + i), iv)));
#endif
      for (int64_t j = i; j < H; ++j)
        dst[j] = static_cast<scalar_t>(static_cast<float>(wp[j]) * (static_cast<float>(row[j]) * inv));
    }
  });
}

// Rotary embedding in place on the first `heads` heads of each row (rotate-half layout).
template <typename scalar_t>
void rotary_impl(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t T = x.size(0), hd = cos.size(1), half = hd / 2, row_stride = x.stride(0);
  scalar_t* xp = x.data_ptr<scalar_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cp + t * hd;
      const float* s = sp + t * hd;
      for (int64_t h = 0; h < heads; ++h) {
        scalar_t* v = xp + t * row_stride + h * hd;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {
          const __m512 a = load16(v + i), b = load16(v + i + half);
          store16(v + i, _mm512_fmsub_ps(a, _mm512_loadu_ps(c + i), _mm512_mul_ps(b, _mm512_loadu_ps(s + i))));
          store16(v + i + half, _mm512_fmadd_ps(b, _mm512_loadu_ps(c + i + half), _mm512_mul_ps(a, _mm512_loadu_ps(s + i + half))));
        }
#endif
        for (; i < half; ++i) {
          const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
          v[i] = static_cast<scalar_t>(a * c[i] - b * s[i]);
          v[i + half] = static_cast<scalar_t>(b * c[i + half] + a * s[i + half]);
        }
      }
    }
  });
}

}  // namespace shoal_cpu
