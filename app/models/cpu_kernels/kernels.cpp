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

#include "decode_attention.h"
#include "norm_rope.h"
#include "silu_mul.h"
#include "vector_math.h"

namespace {
using namespace shoal_cpu;

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
template <typename scalar_t, typename cache_t, bool kWindow, bool kSoftcap>
void prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
             const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
             const at::Tensor& starts, double scale, int64_t window, double softcap) {
  constexpr int64_t R = 16;  // query tokens per tile
  const int64_t nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), bs = k_cache.size(2);
  const int64_t G = nh / nkv, max_blocks = tables.size(1), S = lens.size(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
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
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches differ in dtype");
  SHOAL_DISPATCH(q.scalar_type(), "paged_decode", [&] {
    with_cache_type<scalar_t>(k_cache.scalar_type(), [&](auto* tag) {
      using cache_t = std::remove_pointer_t<decltype(tag)>;
      decode<scalar_t, cache_t>(out, q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(),
                                scale, window, softcap);
    });
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
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "K and V caches differ in dtype");
  SHOAL_DISPATCH(q.scalar_type(), "paged_prefill", [&] {
    with_cache_type<scalar_t>(k_cache.scalar_type(), [&](auto* tag) {
      using cache_t = std::remove_pointer_t<decltype(tag)>;
      using Fn = decltype(&prefill<scalar_t, cache_t, false, false>);
      const Fn run = window > 0 ? (softcap > 0 ? &prefill<scalar_t, cache_t, true, true>
                                               : &prefill<scalar_t, cache_t, true, false>)
                                : (softcap > 0 ? &prefill<scalar_t, cache_t, false, true>
                                               : &prefill<scalar_t, cache_t, false, false>);
      run(out, q, k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(),
          query_starts.contiguous(), scale, window, softcap);
    });
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

// Whether the decode kernel reads float16 and bfloat16 caches in vector registers
// (AVX-512 or AVX2); plain loops convert one element at a time, slower than float32.
bool reads_16_bit_cache_fast() {
#if defined(__AVX512F__) || defined(SHOAL_CPU_AVX2)
  return true;
#else
  return false;
#endif
}

void write_kv_cache(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous());
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "keys and values differ in dtype");
  SHOAL_DISPATCH(k.scalar_type(), "write_kv", [&] {
    with_cache_type<scalar_t>(k_cache.scalar_type(), [&](auto* tag) {
      write<scalar_t, std::remove_pointer_t<decltype(tag)>>(k, v, k_cache, v_cache, slot_mapping.contiguous());
    });
  });
}

// The work runs without the GIL: while the engine's thread is in a kernel, the threads that
// stream its tokens (AsyncEngine's event loop) can run Python instead of waiting for it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "paged attention, one query token per sequence", no_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal attention over query chunks", no_gil());
  m.def("has_prefill_kernel", &has_prefill_kernel, "whether paged_prefill_attention is vectorised (AVX-512)");
  m.def("reads_16_bit_cache_fast", &reads_16_bit_cache_fast, "whether 16-bit caches are read in vectors");
  m.def("rms_norm", &rms_norm, "RMSNorm with float32 arithmetic", no_gil());
  m.def("rotary_inplace", &rotary_inplace, "rotate-half RoPE applied in place to the leading heads", no_gil());
  m.def("silu_mul", &shoal_cpu::silu_mul, "silu(gate) * up of a (T, 2 * inter) float32 gate|up product", no_gil());
  m.def("write_kv_cache", &write_kv_cache, "scatter new keys and values into their cache slots", no_gil());
}
