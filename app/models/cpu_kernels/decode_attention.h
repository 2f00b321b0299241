// Paged decode attention (one query token per sequence, keys and values read in place
// from the blocks of each block table) and the scatter of new keys and values into
// their cache slots. Cache layout per layer: [num_blocks, num_kv_heads, block_size, head_dim].
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "vector_math.h"

namespace shoal_cpu {

#if defined(__AVX512F__)
// Every cache line of one head's rows in a block. Blocks lie anywhere in the cache, so
// the hardware prefetcher starts over at each; a decode step reads each sequence's keys
// and values once, from memory, and fetching the next block while this one is summed
// took 10-25% off a step's attention at 32 sequences (contexts of 100-500 tokens). The
// tokens of a prompt attended one by one reread their keys from cache: for them the
// prefetches only cost (a 512-token prompt took 3-5% longer), and decode() asks for none.
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* p, int64_t rows, int64_t hd) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < rows * hd * int64_t(sizeof(scalar_t)); i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// One (sequence, kv head) of a decode with G query heads and head_dim = 16 * NC, with
// queries, each key row and the output accumulators held in registers.
// Keys [lo, ctx) are read (scores row g holds key lo + j at j), starting mid-block when
// a window begins there, exactly as the portable loop in decode() does.
template <typename scalar_t, int G, int NC>
void decode_item(const float* qf, const scalar_t* kp, const scalar_t* vp, const int32_t* table,
                 int64_t lo, int64_t ctx, int64_t bs, int64_t block_stride, int64_t head_off,
                 float softcap, float* scores, float* out, bool prefetch) {
  constexpr int64_t hd = NC * 16;
  const int64_t len = ctx - lo;
  __m512 qv[G][NC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NC; ++c) qv[g][c] = _mm512_loadu_ps(qf + g * hd + c * 16);
  for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
    const scalar_t* kb = kp + table[b] * block_stride + head_off;
    const int64_t n = std::min(bs, ctx - start);
    if (prefetch) {
      if (start + bs < ctx)  // the next block's keys; after the last, the first values
        prefetch_rows(kp + table[b + 1] * block_stride + head_off, std::min(bs, ctx - start - bs), hd);
      else
        prefetch_rows(vp + table[lo / bs] * block_stride + head_off, std::min(bs, ctx - lo / bs * bs), hd);
    }
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
    if (prefetch && start + bs < ctx)
      prefetch_rows(vp + table[b + 1] * block_stride + head_off, std::min(bs, ctx - start - bs), hd);
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
                              int64_t, int64_t, int64_t, int64_t, int64_t, float, float*, float*, bool);

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

#if defined(SHOAL_CPU_AVX2)
// out[g] = sum over keys [lo, ctx) of p[g * len + j - lo] * v_j for the G query heads of a
// kv head, head_dim = 8 * NC: axpy's FMAs in axpy's order (the same bits), with out's NC
// vectors in registers across a block's keys. The heads take turns block by block, so a
// block's values are read from memory once for all G heads and then from L1; head by head
// over the whole context (which read every value row G times from L2) took 40% of a
// prompt's token-by-token attention.
template <typename cache_t, int NC>
void value_sums(const float* p, int64_t G, int64_t len, const cache_t* vp, const int32_t* table, int64_t lo,
                int64_t ctx, int64_t bs, int64_t block_stride, int64_t head_off, float* out) {
  constexpr int64_t hd = NC * 8;
  std::fill(out, out + G * hd, 0.f);
  for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
    const cache_t* vb = vp + table[b] * block_stride + head_off;
    const int64_t n = std::min(bs, ctx - start), t0 = std::max<int64_t>(lo - start, 0);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = p + g * len;  // key start + t at start + t - lo
      float* og = out + g * hd;
      __m256 acc[NC];
      for (int c = 0; c < NC; ++c) acc[c] = _mm256_loadu_ps(og + c * 8);
      for (int64_t t = t0; t < n; ++t) {
        const __m256 w = _mm256_set1_ps(pg[start + t - lo]);
        for (int c = 0; c < NC; ++c) acc[c] = _mm256_fmadd_ps(w, load8(vb + t * hd + c * 8), acc[c]);
      }
      for (int c = 0; c < NC; ++c) _mm256_storeu_ps(og + c * 8, acc[c]);
    }
  }
}

template <typename cache_t>
using ValueSumsFn = void (*)(const float*, int64_t, int64_t, const cache_t*, const int32_t*, int64_t, int64_t,
                             int64_t, int64_t, int64_t, float*);

template <typename cache_t>
ValueSumsFn<cache_t> pick_value_sums(int64_t hd) {
  switch (hd) {
    case 32: return value_sums<cache_t, 4>;
    case 64: return value_sums<cache_t, 8>;
    case 128: return value_sums<cache_t, 16>;
    default: return nullptr;
  }
}
#endif

// Queries and output in scalar_t, the cache in cache_t (with_cache_type says which pairs).
template <typename scalar_t, typename cache_t>
void decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& tables, const at::Tensor& lens,
            double scale, int64_t window, double softcap) {
  const int64_t D = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nkv = k_cache.size(1), bs = k_cache.size(2);
  const int64_t G = nh / nkv, max_blocks = tables.size(1);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k_cache.data_ptr<cache_t>();
  const cache_t* vp = v_cache.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t block_stride = nkv * bs * hd, head_stride = bs * hd;
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

#if defined(__AVX512F__)
  const DecodeItemFn<cache_t> fast = pick_decode_item<cache_t>(G, hd);
#endif
#if defined(SHOAL_CPU_AVX2)
  const ValueSumsFn<cache_t> sums = pick_value_sums<cache_t>(hd);
#endif
  // Items from both ends in turn: threads take contiguous ranges, and a prompt attended
  // token by token (TorchPagedAttention.token_by_token) lists its tokens in position
  // order, each with one more key than the last.
  const int64_t items = D * nkv;
  // Rows of one prompt attended token by token: one key apart, the shorter's last key in
  // the same block for both (a block that separate sequences share, as a common system
  // prompt's, holds none of a decode's last keys).
  const auto same_prompt = [&](int64_t r, int64_t s) {
    if (r < 0 || r >= D || std::abs(lp[r] - lp[s]) != 1) return false;
    const int64_t b = (std::min(lp[r], lp[s]) - 1) / bs;
    return tp[r * max_blocks + b] == tp[s * max_blocks + b];
  };
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), scores;
    // The G query heads' outputs of item (s, h), from acc.
    const auto store = [&](int64_t s, int64_t h) {
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < hd; ++d) op[(s * nh + h * G + g) * hd + d] = static_cast<scalar_t>(acc[g * hd + d]);
    };
    for (int64_t i = begin; i < end; ++i) {
      const int64_t w = i % 2 == 0 ? i / 2 : items - 1 - i / 2;
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
             acc.data(), !same_prompt(s - 1, s) && !same_prompt(s + 1, s));
        store(s, h);
        continue;
      }
#endif
      // Blocks from the one holding key lo; the first is read from lo's offset.
      for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
        const cache_t* kb = kp + table[b] * block_stride + h * head_stride;
        const int64_t n = std::min(bs, ctx - start);
        int64_t t = std::max<int64_t>(lo - start, 0);
#if defined(SHOAL_CPU_AVX2)
        if (hd % 16 == 0)
            for (; t + 8 <= n; t += 8)
              for (int64_t g = 0; g < G; ++g)
                dot8(qf.data() + g * hd, kb + t * hd, hd, scores.data() + g * len + start + t - lo);
#endif
        for (; t < n; ++t)
          for (int64_t g = 0; g < G; ++g)
            scores[g * len + start + t - lo] = dot(qf.data() + g * hd, kb + t * hd, hd);
      }
      if (cap > 0.f)
        for (int64_t g = 0; g < G; ++g) softcap_row(scores.data() + g * len, len, cap);
      for (int64_t g = 0; g < G; ++g) softmax(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(SHOAL_CPU_AVX2)
      if (sums != nullptr) {
        sums(scores.data(), G, len, vp, table, lo, ctx, bs, block_stride, h * head_stride, acc.data());
        store(s, h);
        continue;
      }
#endif
      for (int64_t b = lo / bs, start = b * bs; start < ctx; ++b, start += bs) {
        const cache_t* vb = vp + table[b] * block_stride + h * head_stride;
        const int64_t n = std::min(bs, ctx - start);
        for (int64_t t = std::max<int64_t>(lo - start, 0); t < n; ++t)
          for (int64_t g = 0; g < G; ++g)
            axpy(acc.data() + g * hd, scores[g * len + start + t - lo], vb + t * hd, hd);
      }
      store(s, h);
    }
  });
}

// New keys and values (scalar_t) into their slots of a cache in cache_t (store_row
// rounds as torch's .to() does when the two differ).
template <typename scalar_t, typename cache_t>
void write(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
           const at::Tensor& slots) {
  const int64_t T = k.size(0), nkv = k.size(1), hd = k.size(2);
  const int64_t bs = k_cache.size(2);
  const int64_t block_stride = nkv * bs * hd, head_stride = bs * hd;
  const int64_t* sp = slots.data_ptr<int64_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  cache_t* kc = k_cache.data_ptr<cache_t>();
  cache_t* vc = v_cache.data_ptr<cache_t>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = sp[t] / bs, off = sp[t] % bs;
      for (int64_t h = 0; h < nkv; ++h) {
        const int64_t dst = block * block_stride + h * head_stride + off * hd;
        store_row(kc + dst, kp + t * ks0 + h * ks1, hd);
        store_row(vc + dst, vp + t * vs0 + h * vs1, hd);
      }
    }
  });
}

// Calls f with a null cache_t pointer for a cache of element type `cache`: the queries'
// scalar_t, or a 16-bit type under float32 queries (EngineConfig.kv_cache_dtype), else fails.
template <typename scalar_t, typename F>
void with_cache_type(at::ScalarType cache, F&& f) {
  if (cache == c10::CppTypeToScalarType<scalar_t>::value) return f(static_cast<scalar_t*>(nullptr));
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (cache == at::kHalf) return f(static_cast<c10::Half*>(nullptr));
    if (cache == at::kBFloat16) return f(static_cast<c10::BFloat16*>(nullptr));
  }
  TORCH_CHECK(false, "a ", cache, " KV cache cannot hold ", c10::CppTypeToScalarType<scalar_t>::value,
              " keys (the model's dtype, or float16 or bfloat16 under float32)");
}

}  // namespace shoal_cpu
