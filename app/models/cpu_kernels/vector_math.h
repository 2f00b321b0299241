// Vector helpers of the CPU kernels: loads of any of our dtypes as float32, dot products,
// value sums, exp, softmax, soft-capping and 16-bit cache stores, in AVX-512, AVX2 or
// scalar builds. Shared by kernels.cpp and the quantised decode layer (app/models/quant).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

// The AVX2 code paths (a CPU without AVX-512, with FMA).
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define SHOAL_CPU_AVX2 1
#endif

namespace shoal_cpu {

// Load 16 elements as floats. bf16 -> fp32 is a 16-bit shift; the compiler gets
// explicit AVX-512 here because it does not vectorise c10's scalar conversions.
#if defined(__AVX512F__)
#include <immintrin.h>
constexpr bool kVectorized = true;
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// n floats stored as bfloat16, sixteen at a time, rounded to nearest-even as torch's
// .to(torch.bfloat16) rounds; a NaN stays a NaN (the rounding add would turn one with a
// small payload into infinity).
inline void store_row(c10::BFloat16* dst, const float* src, int64_t n) {
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512 x = _mm512_loadu_ps(src + d);
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), one);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(half, lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), _mm512_cvtepi32_epi16(r));
  }
  for (; d < n; ++d) dst[d] = c10::BFloat16(src[d]);
}

// n floats stored as float16, rounded to nearest-even as torch rounds.
inline void store_row(c10::Half* dst, const float* src, int64_t n) {
  int64_t d = 0;
  for (; d + 16 <= n; d += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + d), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; d < n; ++d) dst[d] = c10::Half(src[d]);
}

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load16(k + d), acc);
  return _mm512_reduce_add_ps(acc);
}

template <typename scalar_t>
inline void axpy(float* acc, float w, const scalar_t* v, int64_t n) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t d = 0; d < n; d += 16)
    _mm512_storeu_ps(acc + d, _mm512_fmadd_ps(wv, load16(v + d), _mm512_loadu_ps(acc + d)));
}

// exp(x) for x <= 0 (Cephes-style: x = n ln2 + r, 2^n * P(r)); relative error ~1e-7.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-87.3f), x);  // in this order a NaN stays NaN
  __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f),
                                                  _mm512_set1_ps(0.5f)),
                                  _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|), which keeps exp16 in its
// domain (x <= 0); absolute error ~1e-7.
inline __m512 tanh16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.f)));
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

inline __m512 softcap16(__m512 x, float cap) {
  return _mm512_mul_ps(_mm512_set1_ps(cap), tanh16(_mm512_mul_ps(x, _mm512_set1_ps(1.f / cap))));
}

inline void softcap_row(float* row, int64_t n, float cap) {
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(row + j, softcap16(_mm512_loadu_ps(row + j), cap));
  for (; j < n; ++j) row[j] = cap * std::tanh(row[j] / cap);
}

template <typename scalar_t>
inline void load_row(float* dst, const scalar_t* src, int64_t n) {
  for (int64_t d = 0; d < n; d += 16) _mm512_storeu_ps(dst + d, load16(src + d));
}

inline void softmax(float* row, int64_t n) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(row + j));
  float m = _mm512_reduce_max_ps(mx);
  for (; j < n; ++j) m = std::max(m, row[j]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row + j), mv));
    _mm512_storeu_ps(row + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; j < n; ++j) {
    row[j] = std::exp(row[j] - m);
    total += row[j];
  }
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (j = 0; j + 16 <= n; j += 16) _mm512_storeu_ps(row + j, _mm512_mul_ps(_mm512_loadu_ps(row + j), inv));
  for (; j < n; ++j) row[j] *= 1.f / total;
}
#else
constexpr bool kVectorized = false;
#if defined(SHOAL_CPU_AVX2)
#include <immintrin.h>
// Load 8 elements as floats (a 16-bit cache widened in registers, as load16 does).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
#if defined(__F16C__)  // every AVX2 CPU has it; a VM may hide it
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm256_setr_ps(p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]);
#endif
}
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// AVX2 machines (no AVX-512): the decode kernel's dot products and value sums in 8-wide
// FMAs, from caches of any of our dtypes. The scalar loop below is one serial chain of
// dependent adds (strict FP order keeps the compiler from vectorising it): 64-wide heads
// took ~50 us per layer of SmolLM2's decode, most of the step's attention time.
template <typename cache_t>
inline float dot(const float* q, const cache_t* k, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
  }
  for (; d + 8 <= n; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
  const __m256 a = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float acc = _mm_cvtss_f32(s);
  for (; d < n; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

// out[i] = dot(q, k + i * n, n) for eight rows of k, n a multiple of 16: the same bits as
// dot() (each row's two chains, then its lanes summed in dot's order), but the eight
// reductions share a transpose, where dot() spent six dependent shuffles and adds on each
// key, a third of a decode's attention.
template <typename cache_t>
inline void dot8(const float* q, const cache_t* k, int64_t n, float* out) {
  __m256 a[8];
  for (int i = 0; i < 8; ++i) {
    const cache_t* ki = k + i * n;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t d = 0; d < n; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(ki + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(ki + d + 8), a1);
    }
    a[i] = _mm256_add_ps(a0, a1);
  }
  // Row i's lanes l0..l7 end as ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), as in dot().
  // b: rows (2i | 2i+1), each half l_j + l_{j+4}.
  __m256 b[4];
  for (int i = 0; i < 4; ++i)
    b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
  // c: halves (rows 0, 2 | rows 1, 3) and (4, 6 | 5, 7), each row's pair (b0 + b2, b1 + b3).
  const auto pairs = [](__m256 x, __m256 y) {
    return _mm256_add_ps(_mm256_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  };
  const __m256 c0 = pairs(b[0], b[1]), c1 = pairs(b[2], b[3]);
  // rows (0, 2, 4, 6 | 1, 3, 5, 7), then in order
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
  _mm256_storeu_ps(out, _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

template <typename cache_t>
inline void axpy(float* acc, float w, const cache_t* v, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, load8(v + d), _mm256_loadu_ps(acc + d)));
  for (; d < n; ++d) acc[d] += w * static_cast<float>(v[d]);
}

// exp16's polynomial, 8 wide. Quantized models attend every prompt token through the
// decode kernel (TorchPagedAttention.token_by_token): with std::exp per score, the
// softmax took about a quarter of a 512-token prefill.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), x);  // in this order a NaN stays NaN
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline void softmax(float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mv));
    _mm256_storeu_ps(row + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  float lanes[8], total = 0.f;
  _mm256_storeu_ps(lanes, sum);
  for (float l : lanes) total += l;
  for (; j < n; ++j) {
    row[j] = std::exp(row[j] - m);
    total += row[j];
  }
  const __m256 inv = _mm256_set1_ps(1.f / total);
  for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), inv));
  for (; j < n; ++j) row[j] *= 1.f / total;
}
#else  // plain loops
template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t n) {
  float acc = 0.f;
  for (int64_t d = 0; d < n; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

template <typename scalar_t>
inline void axpy(float* acc, float w, const scalar_t* v, int64_t n) {
  for (int64_t d = 0; d < n; ++d) acc[d] += w * static_cast<float>(v[d]);
}

inline void softmax(float* row, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
  float total = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    row[j] = std::exp(row[j] - m);
    total += row[j];
  }
  for (int64_t j = 0; j < n; ++j) row[j] /= total;
}
#endif

inline void softcap_row(float* row, int64_t n, float cap) {
  for (int64_t j = 0; j < n; ++j) row[j] = cap * std::tanh(row[j] / cap);
}

template <typename scalar_t>
inline void load_row(float* dst, const scalar_t* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
#endif

// A row of keys or values into the cache: a copy, or each element converted (the
// AVX-512 build's float -> bfloat16 overload above rounds the same way, vectorised).
template <typename cache_t, typename scalar_t>
inline void store_row(cache_t* dst, const scalar_t* src, int64_t n) {
  if constexpr (std::is_same_v<cache_t, scalar_t>)
    std::copy_n(src, n, dst);
  else
    for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<cache_t>(static_cast<float>(src[d]));
}

// First key a query at `pos` sees: the window keeps `window` keys ending at its own
// (transformers' sliding window: key j visible iff j > pos - window); 0 keeps them all.
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

}  // namespace shoal_cpu
