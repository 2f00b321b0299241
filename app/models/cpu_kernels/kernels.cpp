// Shoal's CPU kernels, built on first use by app/models/cpu_kernels/__init__.py:
//   paged_decode_attention   one query token per sequence, keys/values read in place
//   paged_prefill_attention  causal attention of query chunks over their cached context
//                            (vectorised with AVX-512; a scalar build for tests elsewhere)
//   write_kv_cache           scatter new keys and values into their cache slots
//   rms_norm, rotary_inplace float32 arithmetic for bf16/fp16 activations
//
// KV cache layout per layer: [num_blocks, num_kv_heads, block_size, head_dim].
// Attention work is split over (sequence, kv head[, query tile]) items; each item reads
// its keys and values once, straight from the blocks named by the block table, for all
// the query heads that share that kv head (GQA).
//
// Both attention kernels take `window` (> 0: a query at position p sees keys p - window
// < j <= p, sliding-window attention) and `softcap` (> 0: scores become
// softcap * tanh(score / softcap), Gemma 2's logit capping). A window moves where reading
// starts, so blocks wholly before it are never touched.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

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
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
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
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
// AVX2 machines (no AVX-512): the decode kernel's dot products and value sums in 8-wide
// FMAs for float32 caches. The scalar loop below is one serial chain of dependent adds
// (strict FP order keeps the compiler from vectorising it): 64-wide heads took ~50 us
// per layer of SmolLM2's decode, most of the step's attention time.
inline float dot(const float* q, const float* k, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), _mm256_loadu_ps(k + d + 8), a1);
  }
  for (; d + 8 <= n; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(k + d), a0);
  const __m256 a = _mm256_add_ps(a0, a1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float acc = _mm_cvtss_f32(s);
  for (; d < n; ++d) acc += q[d] * k[d];
  return acc;
}

inline void axpy(float* acc, float w, const float* v, int64_t n) {
  const __m256 wv = _mm256_set1_ps(w);
  int64_t d = 0;
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v + d), _mm256_loadu_ps(acc + d)));
  for (; d < n; ++d) acc[d] += w * v[d];
}
#endif

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

inline void softcap_row(float* row, int64_t n, float cap) {
  for (int64_t j = 0; j < n; ++j) row[j] = cap * std::tanh(row[j] / cap);
}

template <typename scalar_t>
inline void load_row(float* dst, const scalar_t* src, int64_t n) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<float>(src[d]);
}
#endif

// First key a query at `pos` sees: the window keeps `window` keys ending at its own
// (transformers' sliding window: key j visible iff j > pos - window); 0 keeps them all.
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}


#if defined(__AVX512F__)
// One (sequence, kv head) of a decode with G query heads and head_dim = 16 * NC, with
// queries, each key row and the output accumulators held in registers.
// Keys [lo, ctx) are read (scores row g holds key lo + j at j), starting mid-block when
// a window begins there, exactly as the portable loop in decode() does.
template <typename scalar_t, int G, int NC>
void decode_item(const float* qf, const scalar_t* kp, const scalar_t* vp, const int32_t* table,
                 int64_t lo, int64_t ctx, int64_t bs, int64_t block_stride, int64_t head_off,
                 float softcap, float* scores, float* out) {
  constexpr int64_t hd = NC * 16;
  const int64_t len = ctx - lo;
  __m512 qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_loadu_ps(qf + g * hd + c * 16);
  for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
    const scalar_t* kb = kp + table[b] * block_stride + head_off;
    const int64_t n = std::min(bs, ctx - start);
    for (int64_t t = std::max<int64_t>(lo - start, 0); t < n; ++t) {
      __m512 kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = load16(kb + t * hd + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int c = 1; c < NC; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
        scores[g * len + start + t - lo] = _mm512_reduce_add_ps(a);
      }
    }
  }
  if (softcap > 0.f)
    for (int g = 0; g < G; ++g) softcap_row(scores + g * len, len, softcap);
  for (int g = 0; g < G; ++g) softmax(scores + g * len, len);
  __m512 acc[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
    const scalar_t* vb = vp + table[b] * block_stride + head_off;
    const int64_t n = std::min(bs, ctx - start);
    for (int64_t t = std::max<int64_t>(lo - start, 0); t < n; ++t) {
      __m512 vv[NC];
      for (int c = 0; c < NC; ++c) vv[c] = load16(vb + t * hd + c * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * len + start + t - lo]);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(out + g * hd + c * 16, acc[g][c]);
}

template <typename scalar_t>
using DecodeItemFn = void (*)(const float*, const scalar_t*, const scalar_t*, const int32_t*,
                              int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*);

template <typename scalar_t, int NC>
DecodeItemFn<scalar_t> pick_by_group(int64_t G) {
  switch (G) {
    case 1: return decode_item<scalar_t, 1, NC>;
    case 2: return decode_item<scalar_t, 2, NC>;
    case 3: return decode_item<scalar_t, 3, NC>;
    case 4: return decode_item<scalar_t, 4, NC>;
    case 5: return decode_item<scalar_t, 5, NC>;
    case 6: return decode_item<scalar_t, 6, NC>;
    case 7: return decode_item<scalar_t, 7, NC>;
    case 8: return decode_item<scalar_t, 8, NC>;
    default: return nullptr;
  }
}

template <typename scalar_t>
DecodeItemFn<scalar_t> pick_decode_item(int64_t G, int64_t hd) {
  switch (hd) {
    case 32: return pick_by_group<scalar_t, 2>(G);
    case 64: return pick_by_group<scalar_t, 4>(G);
    case 128: return pick_by_group<scalar_t, 8>(G);
    default: return nullptr;
  }
}
#endif

template <typename scalar_t>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
            double scale, int64_t window, double softcap) {
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), bs = k_cache.size(2);
  const int64_t G = nh / nkv, max_blocks = tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t block_stride = nkv * bs * hd, head_stride = bs * hd;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

#if defined(__AVX512F__)
  const DecodeItemFn<scalar_t> fast = pick_decode_item<scalar_t>(G, hd);
#endif
  at::parallel_for(0, D * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / nkv, h = w % nkv;
      const int64_t ctx = lp[s], lo = first_visible(ctx - 1, window), len = ctx - lo;
      const int32_t* table = tp + s * max_blocks;
      scores.assign(G * len, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < hd; ++d)
          qf[g * hd + d] = static_cast<float>(qp[(s * nh + h * G + g) * hd + d]) * fscale;
#if defined(__AVX512F__)
      if (fast != nullptr) {
        fast(qf.data(), kp, vp, table, lo, ctx, bs, block_stride, h * head_stride, cap, scores.data(),
             acc.data());
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < hd; ++d)
            op[(s * nh + h * G + g) * hd + d] = static_cast<scalar_t>(acc[g * hd + d]);
        continue;
      }
#endif
      // Blocks from the one holding key lo; the first is read from lo's offset.
      for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
        const scalar_t* kb = kp + table[b] * block_stride + h * head_stride;
        const int64_t n = std::min(bs, ctx - start);
        for (int64_t t = std::max<int64_t>(lo - start, 0); t < n; ++t)
          for (int64_t g = 0; g < G; ++g)
            scores[g * len + start + t - lo] = dot(qf.data() + g * hd, kb + t * hd, hd);
      }
      if (cap > 0.f)
        for (int64_t g = 0; g < G; ++g) softcap_row(scores.data() + g * len, len, cap);
      for (int64_t g = 0; g < G; ++g) softmax(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
        const scalar_t* vb = vp + table[b] * block_stride + h * head_stride;
        const int64_t n = std::min(bs, ctx - start);
        for (int64_t t = std::max<int64_t>(lo - start, 0); t < n; ++t)
          for (int64_t g = 0; g < G; ++g)
            axpy(acc.data() + g * hd, scores[g * len + start + t - lo], vb + t * hd, hd);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < hd; ++d)
          op[(s * nh + h * G + g) * hd + d] = static_cast<scalar_t>(acc[g * hd + d]);
    }
  });
}

template <typename scalar_t>
void write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
           const at::Tensor& slots) {
  const int64_t T = k.size(0), nkv = k.size(1), hd = k.size(2);
  const int64_t bs = k_cache.size(2);
  const int64_t block_stride = nkv * bs * hd, head_stride = bs * hd;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = sp[t] / bs, off = sp[t] % bs;
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t dst = block * block_stride + h * head_stride + off * hd;
        std::copy_n(kp + t * ks0 + h * ks1, hd, kc + dst);
        std::copy_n(vp + t * vs0 + h * vs1, hd, vc + dst);
      }
    }
  });
}


// Prefill (several query tokens per sequence), flash-attention style: work items are
// (sequence, kv head, tile of up to 16 query tokens); each item walks the keys its tile
// may see, kChunk at a time, keeping an online softmax per query row. Keys are
// transposed into an (hd, kChunk) float tile once per chunk so scores need no
// horizontal sums. prefill_row is the only part with two builds (AVX-512, scalar): the
// tiling and the key ranges are shared, so the scalar build tests them anywhere.
constexpr int64_t kChunk = 32;  // keys per step of the online softmax

#if defined(__AVX512F__)

// acc = acc * alpha + sum_j p[j] * v[j]; the hd/16 accumulators stay in registers.
template <int NC>
inline void accumulate_pv_fixed(float* acc, float alpha, const float* p, const float* v, int64_t n) {
  __m512 a[NC];
  const __m512 av = _mm512_set1_ps(alpha);
  for (int c = 0; c < NC; ++c) a[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + c * 16), av);
  for (int64_t j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    for (int c = 0; c < NC; ++c) a[c] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(v + j * NC * 16 + c * 16), a[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + c * 16, a[c]);
}

inline void accumulate_pv(float* acc, float alpha, const float* p, const float* v, int64_t n, int64_t hd) {
  switch (hd) {
    case 64: return accumulate_pv_fixed<4>(acc, alpha, p, v, n);
    case 128: return accumulate_pv_fixed<8>(acc, alpha, p, v, n);
    case 32: return accumulate_pv_fixed<2>(acc, alpha, p, v, n);
    default: break;
  }
  const __m512 av = _mm512_set1_ps(alpha);
  for (int64_t d = 0; d < hd; d += 16) {
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + d), av);
    for (int64_t j = 0; j < n; ++j)
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_loadu_ps(v + j * hd + d), a);
    _mm512_storeu_ps(acc + d, a);
  }
}

// One query row against keys [begin, end) of the chunk (0 <= begin < end <= kChunk):
// scores, the online-softmax update of m and l, acc = acc * alpha + p v. Always inlined,
// as this body was before it had a name: without a window, begin is a constant 0.
template <bool kSoftcap>
__attribute__((always_inline)) inline void prefill_row(const float* qr, const float* kt, const float* vf, int64_t begin,
                        int64_t end, float cap, float& m, float& l, float* acc, int64_t hd) {
  static_assert(kChunk == 32, "scores are two halves of 16 keys");
  // Two halves of 16 keys, two partial sums each: four independent FMA chains.
  __m512 lo0 = _mm512_setzero_ps(), lo1 = lo0, hi0 = lo0, hi1 = lo0;
  for (int64_t d = 0; d < hd; d += 2) {
    const __m512 q0 = _mm512_set1_ps(qr[d]), q1 = _mm512_set1_ps(qr[d + 1]);
    lo0 = _mm512_fmadd_ps(q0, _mm512_loadu_ps(kt + d * kChunk), lo0);
    hi0 = _mm512_fmadd_ps(q0, _mm512_loadu_ps(kt + d * kChunk + 16), hi0);
    lo1 = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kt + (d + 1) * kChunk), lo1);
    hi1 = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kt + (d + 1) * kChunk + 16), hi1);
  }
  __m512 raw_lo = _mm512_add_ps(lo0, lo1), raw_hi = _mm512_add_ps(hi0, hi1);
  if constexpr (kSoftcap) {
    raw_lo = softcap16(raw_lo, cap);
    raw_hi = softcap16(raw_hi, cap);
  }
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // bit j set for keys begin <= j < end
  const uint32_t keep = (end >= 32 ? ~0u : (1u << end) - 1u) & ~((1u << begin) - 1u);
  const __mmask16 keep_lo = static_cast<__mmask16>(keep & 0xFFFFu);
  const __mmask16 keep_hi = static_cast<__mmask16>(keep >> 16);
  const __m512 s_lo = _mm512_mask_blend_ps(keep_lo, _mm512_set1_ps(neg_inf), raw_lo);
  const __m512 s_hi = _mm512_mask_blend_ps(keep_hi, _mm512_set1_ps(neg_inf), raw_hi);
  const float m_new = std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(s_lo, s_hi)));
  const __m512 mv = _mm512_set1_ps(m_new);
  const __m512 p_lo = _mm512_maskz_mov_ps(keep_lo, exp16(_mm512_sub_ps(s_lo, mv)));
  const __m512 p_hi = _mm512_maskz_mov_ps(keep_hi, exp16(_mm512_sub_ps(s_hi, mv)));
  const float alpha = std::exp(m - m_new);
  l = l * alpha + _mm512_reduce_add_ps(_mm512_add_ps(p_lo, p_hi));
  m = m_new;
  alignas(64) float pbuf[kChunk];
  _mm512_store_ps(pbuf, p_lo);
  _mm512_store_ps(pbuf + 16, p_hi);
  accumulate_pv(acc, alpha, pbuf + begin, vf + begin * hd, end - begin, hd);
}
#else
template <bool kSoftcap>
inline void prefill_row(const float* qr, const float* kt, const float* vf, int64_t begin,
                        int64_t end, float cap, float& m, float& l, float* acc, int64_t hd) {
  float p[kChunk];
  float m_new = m;
  for (int64_t j = begin; j < end; ++j) {
    float s = 0.f;
    for (int64_t d = 0; d < hd; ++d) s += qr[d] * kt[d * kChunk + j];
    if constexpr (kSoftcap) s = cap * std::tanh(s / cap);
    p[j] = s;
    m_new = std::max(m_new, s);
  }
  const float alpha = std::exp(m - m_new);
  float sum = 0.f;
  for (int64_t j = begin; j < end; ++j) {
    p[j] = std::exp(p[j] - m_new);
    sum += p[j];
  }
  l = l * alpha + sum;
  m = m_new;
  for (int64_t d = 0; d < hd; ++d) acc[d] *= alpha;
  for (int64_t j = begin; j < end; ++j)
    for (int64_t d = 0; d < hd; ++d) acc[d] += p[j] * vf[j * hd + d];
}
#endif

// kWindow and kSoftcap are template arguments so that plain causal attention pays
// nothing for either.
template <typename scalar_t, bool kWindow, bool kSoftcap>
void prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
             const at::Tensor& starts, double scale, int64_t window, double softcap) {
  constexpr int64_t R = 16;  // query tokens per tile
  const int64_t nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), bs = k_cache.size(2);
  const int64_t G = nh / nkv, max_blocks = tables.size(1), S = lens.size(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* sp = starts.data_ptr<int32_t>();
  const int64_t block_stride = nkv * bs * hd, head_stride = bs * hd;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  struct Item { int64_t seq, head, tile; };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = 0; t < sp[s + 1] - sp[s]; t += R)
      for (int64_t h = 0; h < nkv; ++h) items.push_back({s, h, t});
  // Costliest (latest) tiles first so that dynamic scheduling balances the threads.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.tile > b.tile; });

  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qf(G * R * hd), acc(G * R * hd), kt(hd * kChunk), vf(kChunk * hd);
    std::vector<float> m(G * R), l(G * R);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < n_items; ++w) {
      const Item it = items[w];
      const int64_t qs = sp[it.seq], n = sp[it.seq + 1] - qs, ctx = lp[it.seq];
      const int64_t rows_tok = std::min(R, n - it.tile);
      const int64_t first_pos = ctx - n + it.tile;  // position of the tile's first token
      const int32_t* table = tp + it.seq * max_blocks;
      const int64_t rows = G * rows_tok;  // row r: head g = r / rows_tok, token i = r % rows_tok
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / rows_tok, i = r % rows_tok;
        const scalar_t* src = qp + ((qs + it.tile + i) * nh + it.head * G + g) * hd;
        for (int64_t d = 0; d < hd; ++d) qf[r * hd + d] = static_cast<float>(src[d]) * fscale;
      }
      std::fill(acc.begin(), acc.begin() + rows * hd, 0.f);
      std::fill(m.begin(), m.begin() + rows, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + rows, 0.f);
      const int64_t kv_end = first_pos + rows_tok;  // keys visible to the tile's last token
      // The tile's first token sees the earliest keys: under a window, reading starts at
      // its first visible key and the blocks before are skipped.
      for (int64_t start = kWindow ? first_visible(first_pos, window) : 0; start < kv_end;) {
        const int64_t nk = std::min<int64_t>(kChunk, kv_end - start);
        // Gather this chunk's keys (transposed, as floats) and values, block by block.
        for (int64_t j = 0; j < kChunk; ++j) {
          if (j >= nk) {
            for (int64_t d = 0; d < hd; ++d) kt[d * kChunk + j] = 0.f;
            continue;
          }
          const int64_t pos = start + j;
          const int64_t base = table[pos / bs] * block_stride + it.head * head_stride + (pos % bs) * hd;
          for (int64_t d = 0; d < hd; ++d) kt[d * kChunk + j] = static_cast<float>(kp[base + d]);
          load_row(vf.data() + j * hd, vp + base, hd);
        }
        for (int64_t r = 0; r < rows; ++r) {
          // The row sees chunk keys [begin, end): causal on the right, window on the left.
          const int64_t pos = first_pos + r % rows_tok;
          const int64_t end = std::min<int64_t>(nk, pos - start + 1);
          const int64_t begin = kWindow ? std::max<int64_t>(first_visible(pos, window) - start, 0) : 0;
          if (end <= begin) continue;
          prefill_row<kSoftcap>(qf.data() + r * hd, kt.data(), vf.data(), begin, end, cap, m[r], l[r],
                                acc.data() + r * hd, hd);
        }
        start += nk;
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t g = r / rows_tok, i = r % rows_tok;
        scalar_t* dst = op + ((qs + it.tile + i) * nh + it.head * G + g) * hd;
        const float inv = 1.f / l[r];
        for (int64_t d = 0; d < hd; ++d) dst[d] = static_cast<scalar_t>(acc[r * hd + d] * inv);
      }
    }
  }
}


// RMSNorm over the last dimension, float32 arithmetic, any of our dtypes in and out.
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

}  // namespace

#define SHOAL_DISPATCH(TYPE, NAME, ...)                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)           \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, int64_t window,
                                  double softcap) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt);
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(!kVectorized || q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap are 0 (off) or positive");
  auto out = at::empty_like(q);
  SHOAL_DISPATCH(q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(out, q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale,
                     window, softcap);
  });
  return out;
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_tables,
                                   const at::Tensor& context_lens, const at::Tensor& query_starts,
                                   double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt &&
              query_starts.scalar_type() == at::kInt);
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(!kVectorized || q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap are 0 (off) or positive");
  auto out = at::empty_like(q);
  SHOAL_DISPATCH(q.scalar_type(), "paged_prefill", [&] {
    using Fn = decltype(&prefill<scalar_t, false, false>);
    const Fn run = window > 0 ? (softcap > 0 ? &prefill<scalar_t, true, true> : &prefill<scalar_t, true, false>)
                              : (softcap > 0 ? &prefill<scalar_t, false, true> : &prefill<scalar_t, false, false>);
    run(out, q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), query_starts.contiguous(),
        scale, window, softcap);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type());
  auto out = at::empty_like(x);
  SHOAL_DISPATCH(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(out, x, weight, eps); });
  return out;
}

void rotary_inplace(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x: (T, width) with contiguous rows");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0));
  TORCH_CHECK(heads * cos.size(1) <= x.size(1));
  SHOAL_DISPATCH(x.scalar_type(), "rotary", [&] { rotary_impl<scalar_t>(x, cos, sin, heads); });
}

// Whether paged_prefill_attention is the vectorised build; the scalar one is slower than
// torch's SDPA, so the backend uses it only here.
bool has_prefill_kernel() { return kVectorized; }

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong);
  SHOAL_DISPATCH(k.scalar_type(), "write_kv", [&] {
    write<scalar_t>(k, v, k_cache, v_cache, slot_mapping.contiguous());
  });
}

// The work runs without the GIL: while the engine's thread is in a kernel, the threads that
// stream its tokens (AsyncEngine's event loop) can run Python instead of waiting for it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "paged attention, one query token per sequence", no_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal attention over query chunks", no_gil());
  m.def("has_prefill_kernel", &has_prefill_kernel, "whether paged_prefill_attention is vectorised (AVX-512)");
  m.def("rms_norm", &rms_norm, "RMSNorm with float32 arithmetic", no_gil());
  m.def("rotary_inplace", &rotary_inplace, "rotate-half RoPE applied in place to the leading heads", no_gil());
  m.def("write_kv_cache", &write_kv_cache, "scatter new keys and values into their cache slots", no_gil());
}
