// Activations to int8, once per call, for the integer GEMV (gemv_i8.h): llama.cpp's Q8_0
// (Q8_1 with the sums) on x's rows. Per 32-block of a row, d = max|x| / 127 and
// q = round(x * (127 / max|x|)) to nearest even; the products of float32 roundings that
// tests/models/test_quant_kernels.py repeats in torch, so its reference quantises x
// bit for bit as this does. d stays float32 (llama.cpp rounds it to fp16).
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "formats.h"
#include "simd.h"

namespace shoal_quant {

struct QuantizedX {
  std::vector<int8_t> q;  // (T, ldq): per block 32 bytes, or 64 in nibble order (below)
  std::vector<float> d;   // (T, kb)
  std::vector<float> sxe; // (T, kb, kG): d * sum(q) per block, repeated for add_offsets
  int64_t ldq = 0, kb = 0;
};

// One block: q[0..31] = round(x * id) and its sum; returns d. nibbles: the 4-bit kernels
// want each half of the block twice, [q0..15, q0..15, q16..31, q16..31], so one 32-byte
// load meets the low nibbles of two rows (weights 0..15 of each) and the next the high
// (AVX512-VNNI broadcasts one copy of each half to four rows).
inline float quantize_block(const float* x, int8_t* q, bool nibbles, int32_t* sum) {
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
  __m256 v[4];
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(amax, 1), _mm256_castps256_ps128(amax));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const __m256 id = _mm256_set1_ps(m != 0.f ? 127.f / m : 0.f);
  __m256i i[4];
  for (int j = 0; j < 4; ++j) i[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));  // MXCSR: nearest even
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1)));
  // packs work within 128-bit lanes: bytes come out in dword order 0 2 4 6 1 3 5 7
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  auto* out = reinterpret_cast<__m256i*>(q);
  if (nibbles) {
    _mm256_storeu_si256(out, _mm256_permute2x128_si256(ordered, ordered, 0x00));
    _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(ordered, ordered, 0x11));
  } else {
    _mm256_storeu_si256(out, ordered);
  }
#else
  float m = 0.f;
  for (int j = 0; j < 32; ++j) m = std::fmax(m, std::fabs(x[j]));
  const float id = m != 0.f ? 127.f / m : 0.f;
  *sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int8_t v = int8_t(std::nearbyint(x[j] * id));
    *sum += v;
    if (nibbles)
      q[j < 16 ? j : j + 16] = q[j < 16 ? j + 16 : j + 32] = v;
    else
      q[j] = v;
  }
#endif
  return m / 127.f;
}

// x (T, K) contiguous float32.
inline QuantizedX quantize_x(const float* x, int64_t T, int64_t K, bool nibbles, bool sums) {
  QuantizedX qx;
  qx.kb = K / 32;
  qx.ldq = nibbles ? 2 * K : K;
  qx.q.resize(T * qx.ldq);
  qx.d.resize(T * qx.kb);
  qx.sxe.resize(sums ? T * qx.kb * kG : 0);
  const int64_t bytes = nibbles ? 64 : 32;
  // Blocks are independent: threads share them once there are enough (a prefill chunk's).
  at::parallel_for(0, T * qx.kb, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int32_t sum;
      const float d = quantize_block(x + i * 32, qx.q.data() + i * bytes, nibbles, &sum);
      qx.d[i] = d;
      if (sums)
        for (int r = 0; r < kG; ++r) qx.sxe[i * kG + r] = d * float(sum);
    }
  });
  return qx;
}

}  // namespace shoal_quant
