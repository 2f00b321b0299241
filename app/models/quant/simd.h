// Vector layer and block decoders for the quantised-weight kernels (kernels.cpp).
//
// Three builds of the same kernels: AVX-512 (16 floats per vector), AVX2+FMA (8), and a
// portable one (plain loops; SHOAL_QUANT_PORTABLE forces it, so tests check the generic
// code on any machine). Everything ISA-specific lives here: the
// kernels see `vf`, a handful of float ops, and three decoders that turn one 32-weight
// block into exact floats in natural order (kNV vectors).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if !defined(SHOAL_QUANT_PORTABLE) && (defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)))
#include <immintrin.h>
#endif

namespace shoal_quant {

// fp16 -> fp32 without F16C: every half is exactly representable as a float.
inline float half_to_float_bits(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  uint32_t bits;
  if (exp == 0) {
    const float sub = float(mant) * 5.9604644775390625e-8f;  // mant * 2^-24, exact
    std::memcpy(&bits, &sub, 4);
    bits |= sign;
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX512F__)
constexpr int kW = 16;
constexpr const char* kIsa = "avx512";
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline vf vset1(float a) { return _mm512_set1_ps(a); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
// Four horizontal sums at once: fold each to 256 bits, then the AVX2 hadd tree.
inline void vsum4(const vf* a, float* out) {
  __m256 h[4];
  for (int i = 0; i < 4; ++i)
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

// 16 nibble bytes: lanes take bytes 0..15; low nibbles are weights 0..15, high 16..31.
inline void decode_nib(const uint8_t* q, vf* v) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  const __m512i m = _mm512_set1_epi32(15);
  v[0] = _mm512_cvtepi32_ps(_mm512_and_si512(w, m));
  v[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
}

// Q5_K: 16 added to weight j where bit j of the 16-bit units lo (weights 0..15) or hi
// (16..31) is set.
inline void add_fifth_bits(const uint8_t* lo, const uint8_t* hi, vf* v) {
  uint16_t l, h;
  std::memcpy(&l, lo, 2);
  std::memcpy(&h, hi, 2);
  const __m512 k16 = _mm512_set1_ps(16.f);
  v[0] = _mm512_mask_add_ps(v[0], l, v[0], k16);
  v[1] = _mm512_mask_add_ps(v[1], h, v[1], k16);
}

inline void decode_i8(const int8_t* q, vf* v) {
  for (int i = 0; i < 2; ++i)
    v[i] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i))));
}

// Q6_K: hi byte j carries weight j + 8i's top pair at bits 2i. Lane l of the low vector is
// weight l (pair i = l / 8), of the high vector weight 16 + l (pair i = 2 + l / 8); the
// 8 hi bytes are loaded twice so lane l reads byte l % 8, and variable shifts move each
// lane's pair to bits 4..5.
inline void decode_q6(const uint8_t* lo, const uint8_t* hi, vf* v) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
  const __m128i h8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi));
  const __m512i h = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(h8, h8));
  const __m512i up = _mm512_setr_epi32(4, 4, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i down = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m512i m15 = _mm512_set1_epi32(15), m48 = _mm512_set1_epi32(48), k32 = _mm512_set1_epi32(32);
  const __m512i a = _mm512_or_si512(_mm512_and_si512(w, m15), _mm512_and_si512(_mm512_sllv_epi32(h, up), m48));
  const __m512i b = _mm512_or_si512(_mm512_srli_epi32(w, 4), _mm512_and_si512(_mm512_srlv_epi32(h, down), m48));
  v[0] = _mm512_cvtepi32_ps(_mm512_sub_epi32(a, k32));
  v[1] = _mm512_cvtepi32_ps(_mm512_sub_epi32(b, k32));
}

#elif !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
constexpr int kW = 8;
constexpr const char* kIsa = "avx2";
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
inline vf vset1(float a) { return _mm256_set1_ps(a); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// Four horizontal sums at once: lane i of the hadd tree's halves holds parts of a[i].
inline void vsum4(const vf* a, float* out) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

inline __m256i widen8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// bytes 0..7 give weights 0..7 (low nibbles) and 16..23 (high); bytes 8..15 the rest.
inline void decode_nib(const uint8_t* q, vf* v) {
  const __m256i w0 = widen8(q), w1 = widen8(q + 8), m = _mm256_set1_epi32(15);
  v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(w0, m));
  v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(w1, m));
  v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(w0, 4));
  v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(w1, 4));
}

// Q5_K: vector i (weights 8i..8i+7) adds 16 where its byte of the units' bits is set.
inline void add_fifth_bits(const uint8_t* lo, const uint8_t* hi, vf* v) {
  const uint8_t bytes[4] = {lo[0], lo[1], hi[0], hi[1]};
  const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 k16 = _mm256_set1_ps(16.f);
  for (int i = 0; i < 4; ++i) {
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bytes[i]), bit), bit);
    v[i] = _mm256_add_ps(v[i], _mm256_and_ps(_mm256_castsi256_ps(set), k16));
  }
}

inline void decode_i8(const int8_t* q, vf* v) {
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
}

// Q6_K: vector i (weights 8i..8i+7) takes its top pair from bits 2i of hi bytes 0..7.
inline void decode_q6(const uint8_t* lo, const uint8_t* hi, vf* v) {
  const __m256i w0 = widen8(lo), w1 = widen8(lo + 8), h = widen8(hi);
  const __m256i m15 = _mm256_set1_epi32(15), m48 = _mm256_set1_epi32(48), k32 = _mm256_set1_epi32(32);
  const __m256i q[4] = {
      _mm256_or_si256(_mm256_and_si256(w0, m15), _mm256_and_si256(_mm256_slli_epi32(h, 4), m48)),
      _mm256_or_si256(_mm256_and_si256(w1, m15), _mm256_and_si256(_mm256_slli_epi32(h, 2), m48)),
      _mm256_or_si256(_mm256_srli_epi32(w0, 4), _mm256_and_si256(h, m48)),
      _mm256_or_si256(_mm256_srli_epi32(w1, 4), _mm256_and_si256(_mm256_srli_epi32(h, 2), m48)),
  };
  for (int i = 0; i < 4; ++i) v[i] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], k32));
}

#else
// Plain loops over SHOAL_QUANT_PORTABLE_WIDTH floats: the build uses 16 in tests, the
// AVX-512 geometry, so the generic kernels are checked at both widths on an AVX2 machine.
#ifndef SHOAL_QUANT_PORTABLE_WIDTH
#define SHOAL_QUANT_PORTABLE_WIDTH 8
#endif
constexpr int kW = SHOAL_QUANT_PORTABLE_WIDTH;
static_assert(kW == 8 || kW == 16, "32-weight blocks fill whole vectors");
constexpr const char* kIsa = "portable";
struct vf {
  float v[kW];
};
inline vf vzero() { return vf{}; }
inline vf vload(const float* p) {
  vf r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline void vstore(float* p, vf a) { std::memcpy(p, a.v, sizeof a.v); }
inline vf vset1(float a) {
  vf r;
  for (float& x : r.v) x = a;
  return r;
}
inline vf vmul(vf a, vf b) {
  for (int i = 0; i < kW; ++i) a.v[i] *= b.v[i];
  return a;
}
inline vf vadd(vf a, vf b) {
  for (int i = 0; i < kW; ++i) a.v[i] += b.v[i];
  return a;
}
inline vf vfma(vf a, vf b, vf c) {
  for (int i = 0; i < kW; ++i) c.v[i] = __builtin_fmaf(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline float vsum(vf a) {
  float s = 0.f;
  for (float x : a.v) s += x;
  return s;
}
inline void vsum4(const vf* a, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = vsum(a[i]);
}

// Weight j of a block goes to lane j % kW of vector j / kW.
inline void decode_nib(const uint8_t* q, vf* v) {
  for (int j = 0; j < 32; ++j) v[j / kW].v[j % kW] = float(j < 16 ? q[j] & 15 : q[j - 16] >> 4);
}

inline void add_fifth_bits(const uint8_t* lo, const uint8_t* hi, vf* v) {
  for (int j = 0; j < 32; ++j) {
    const uint8_t* unit = j < 16 ? lo : hi;
    if ((unit[(j % 16) / 8] >> (j % 8)) & 1) v[j / kW].v[j % kW] += 16.f;
  }
}

inline void decode_i8(const int8_t* q, vf* v) {
  for (int j = 0; j < 32; ++j) v[j / kW].v[j % kW] = float(q[j]);
}

inline void decode_q6(const uint8_t* lo, const uint8_t* hi, vf* v) {
  for (int j = 0; j < 32; ++j) {
    const int low = j < 16 ? lo[j] & 15 : lo[j - 16] >> 4;
    const int top = (hi[j % 8] >> (2 * (j / 8))) & 3;
    v[j / kW].v[j % kW] = float((low | (top << 4)) - 32);
  }
}
#endif

constexpr int kNV = 32 / kW;  // vectors per 32-weight block

inline float half_to_float(uint16_t h) {
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return half_to_float_bits(h);
#endif
}

// dst[i] = f[i] * src[i] for 8 bytes (unsigned / signed): the K types' sub-block scales.
// Explicit, because stores to float* may alias uint8_t loads and so never vectorise.
inline void mul_u8x8(const uint8_t* src, const float* f, float* dst) {
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX2__)
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_loadu_ps(f), _mm256_cvtepi32_ps(v)));
#else
  for (int i = 0; i < 8; ++i) dst[i] = f[i] * float(src[i]);
#endif
}

inline void mul_i8x8(const int8_t* src, const float* f, float* dst) {
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX2__)
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_loadu_ps(f), _mm256_cvtepi32_ps(v)));
#else
  for (int i = 0; i < 8; ++i) dst[i] = f[i] * float(src[i]);
#endif
}

// A K type's sub-block factors for one super-block of a row group: dst[i] = sign *
// half(h[i % 4]) * src[i] for n (a multiple of 16) bytes of (unit, row)-ordered
// unsigned / signed 6- or 8-bit scales (four rows, formats.h's kG). 16 at a time where
// AVX-512 allows: the grouped expert products on cache-resident Q4_K weights took
// 1.5-1.7x as long 8 at a time. The products are the same either way.
template <class T>
inline void k_scales(const T* src, const uint16_t* h, float sign, float* dst, int n) {
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX512F__) && defined(__F16C__)
  const __m128 f = _mm_mul_ps(_mm_set1_ps(sign), _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h))));
  const __m512 f16 = _mm512_broadcast_f32x4(f);
  for (int i = 0; i < n; i += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m512i v = std::is_signed_v<T> ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(f16, _mm512_cvtepi32_ps(v)));
  }
#else
  float f8[8];
  for (int r = 0; r < 4; ++r) f8[r] = f8[r + 4] = sign * half_to_float(h[r]);
  for (int i = 0; i < n; i += 8) {
    if constexpr (std::is_signed_v<T>) {
      mul_i8x8(src + i, f8, dst + i);
    } else {
      mul_u8x8(src + i, f8, dst + i);
    }
  }
#endif
}

// dst[i] = k * src[i].
inline void scale_floats(const float* src, float k, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) vstore(dst + i, vmul(vset1(k), vload(src + i)));
  for (; i < n; ++i) dst[i] = k * src[i];
}

// n fp16 values (as raw bits) -> floats.
inline void halves_to_floats(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

}  // namespace shoal_quant
