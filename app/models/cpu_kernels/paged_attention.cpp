// Paged attention for CPU decode steps, and the KV-cache write.
//
// Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_dim].
// Work is split over (sequence, kv head) pairs; each pair reads its keys and values
// once, straight from the blocks named by the block table (no gathered copy), for all
// the query heads that share that kv head (GQA).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
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

template <typename scalar_t>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
            double scale) {
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
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, D * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / nkv, h = w % nkv;
      const int64_t ctx = lp[s];
      const int32_t* table = tp + s * max_blocks;
      scores.assign(G * ctx, 0.f);
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < hd; ++d)
          qf[g * hd + d] = static_cast<float>(qp[(s * nh + h * G + g) * hd + d]) * fscale;
      for (int64_t b = 0, start = 0; start < ctx; ++b, start += bs) {
        const scalar_t* kb = kp + table[b] * block_stride + h * head_stride;
        const int64_t n = std::min(bs, ctx - start);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t g = 0; g < G; ++g)
            scores[g * ctx + start + t] = dot(qf.data() + g * hd, kb + t * hd, hd);
      }
      for (int64_t g = 0; g < G; ++g) softmax(scores.data() + g * ctx, ctx);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0, start = 0; start < ctx; ++b, start += bs) {
        const scalar_t* vb = vp + table[b] * block_stride + h * head_stride;
        const int64_t n = std::min(bs, ctx - start);
        for (int64_t t = 0; t < n; ++t)
          for (int64_t g = 0; g < G; ++g)
            axpy(acc.data() + g * hd, scores[g * ctx + start + t], vb + t * hd, hd);
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

}  // namespace

#define SHOAL_DISPATCH(TYPE, NAME, ...)                                     \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)           \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt);
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(!kVectorized || q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  auto out = at::empty_like(q);
  SHOAL_DISPATCH(q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(out, q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(), scale);
  });
  return out;
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong);
  SHOAL_DISPATCH(k.scalar_type(), "write_kv", [&] {
    write<scalar_t>(k, v, k_cache, v_cache, slot_mapping.contiguous());
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged attention, one query token per sequence");
  m.def("write_kv_cache", &write_kv_cache, "scatter new keys and values into their cache slots");
}
