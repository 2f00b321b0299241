// The fused dequantise-GEMV: out[t, n] = sum_k x[t, k] W[n, k] for a few rows of x (decode).
//
// Each 32-weight block is decoded once into registers and multiplied with every row of x
// there, so weights stream from memory once per call. A block's partial dot products are
// scaled once (sum_i d q_i x_i = d sum_i q_i x_i); Q4 offsets need only per-block sums of
// x (sum_i m x_i = m sum_i x_i), precomputed per call. Activations stay float32: the
// result differs from exact dequantisation + float matmul only in summation order.
//
// Weight rows go in groups of R (4 for one or two rows of x, 2 for up to four): the group
// shares each x load, gives the FMA units R independent chains, and R horizontal sums
// reduce together. Rows of W are split over threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "simd.h"

namespace shoal_quant {

constexpr int kMaxT = 8;  // rows of x held in registers per pass over a weight row

constexpr int group_rows(int tt) { return tt <= 2 ? 4 : tt <= 4 ? 2 : 1; }

// R weight rows from n0 (scales ls apart, offsets kbp apart) against TT rows of x (ldx
// apart, their block sums sx kbp apart); res is (R, TT). off and sx are zero-padded to
// whole vectors, so the offset terms join the same accumulators.
template <int R, int TT, class F>
void gemv_rows(const F& f, int64_t n0, int64_t kb, const float* x, int64_t ldx, const float* scale, int64_t ls,
               const float* off, const float* sx, int64_t kbp, float* res) {
  constexpr int per = kNV / F::kSubs;  // vectors per scale
  vf acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  for (int64_t b = 0; b < kb; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      vf q[kNV];
      f.decode(n0 + r, b, q);
      for (int s = 0; s < F::kSubs; ++s) {
        const vf sc = vset1(scale[r * ls + b * F::kSubs + s]);
        const float* xb = x + b * 32 + s * per * kW;
#pragma GCC unroll 8
        for (int t = 0; t < TT; ++t) {
          const float* xt = xb + t * ldx;
          vf p = vmul(q[s * per], vload(xt));
          for (int i = 1; i < per; ++i) p = vfma(q[s * per + i], vload(xt + i * kW), p);
          acc[r][t] = vfma(sc, p, acc[r][t]);
        }
      }
    }
  }
  if constexpr (F::kOffset)
    for (int64_t i = 0; i < kbp; i += kW)
      for (int r = 0; r < R; ++r)
        for (int t = 0; t < TT; ++t) acc[r][t] = vfma(vload(off + r * kbp + i), vload(sx + t * kbp + i), acc[r][t]);
  for (int t = 0; t < TT; ++t) {
    if constexpr (R == 4) {
      const vf four[4] = {acc[0][t], acc[1][t], acc[2][t], acc[3][t]};
      float sums[4];
      vsum4(four, sums);
      for (int r = 0; r < 4; ++r) res[r * TT + t] = sums[r];
    } else {
      for (int r = 0; r < R; ++r) res[r * TT + t] = vsum(acc[r][t]);
    }
  }
}

template <class F>
using RowsFn = void (*)(const F&, int64_t, int64_t, const float*, int64_t, const float*, int64_t, const float*,
                        const float*, int64_t, float*);

// (R = group_rows(TT), TT) for TT = 1..8, then (1, TT): the kernels a call can need.
template <class F>
struct GemvTable {
  static constexpr RowsFn<F> grouped[kMaxT] = {
      &gemv_rows<group_rows(1), 1, F>, &gemv_rows<group_rows(2), 2, F>, &gemv_rows<group_rows(3), 3, F>,
      &gemv_rows<group_rows(4), 4, F>, &gemv_rows<1, 5, F>,             &gemv_rows<1, 6, F>,
      &gemv_rows<1, 7, F>,             &gemv_rows<1, 8, F>};
  static constexpr RowsFn<F> single[kMaxT] = {&gemv_rows<1, 1, F>, &gemv_rows<1, 2, F>, &gemv_rows<1, 3, F>,
                                              &gemv_rows<1, 4, F>, &gemv_rows<1, 5, F>, &gemv_rows<1, 6, F>,
                                              &gemv_rows<1, 7, F>, &gemv_rows<1, 8, F>};
};

// x is (T, K) contiguous float32; out (T, N) with rows ldo apart.
template <class F, class O>
void gemv(const F& f, int64_t N, int64_t K, const float* x, int64_t T, O* out, int64_t ldo) {
  const int64_t kb = K / 32, kbp = (kb + kW - 1) / kW * kW, ls = kb * F::kSubs;
  std::vector<float> sx(F::kOffset ? T * kbp : 0, 0.f);  // (T, kbp): sums of x per 32-block
  if (F::kOffset)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < kb; ++b) {
        vf s = vzero();
        for (int j = 0; j < kNV; ++j) s = vadd(s, vload(x + t * K + b * 32 + j * kW));
        sx[t * kbp + b] = vsum(s);
      }
  // Past kMaxT rows of x, each pass over a weight group reads it from L1, not memory.
  const int R = T <= kMaxT ? group_rows(int(T)) : 1;
  // Chunks of at least 64k weights: smaller ones cost more in wake-ups than they save.
  const int64_t grain = std::max<int64_t>(R, (int64_t(1) << 16) / K);
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(kMaxT * ls), off(F::kOffset ? kMaxT * kbp : 0, 0.f);
    float res[4 * kMaxT];
    for (int64_t n0 = begin; n0 < end;) {
      const int64_t rows = end - n0 >= R ? R : 1;
      for (int64_t r = 0; r < rows; ++r) f.scales(n0 + r, scale.data() + r * ls, off.data() + r * kbp);
      for (int64_t t0 = 0; t0 < T; t0 += kMaxT) {
        const int64_t tt = std::min<int64_t>(kMaxT, T - t0);
        const RowsFn<F> fn = rows == R ? GemvTable<F>::grouped[tt - 1] : GemvTable<F>::single[tt - 1];
        fn(f, n0, kb, x + t0 * K, K, scale.data(), ls, off.data(), sx.data() + t0 * kbp, kbp, res);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t t = 0; t < tt; ++t) out[(t0 + t) * ldo + n0 + r] = static_cast<O>(res[r * tt + t]);
      }
      n0 += rows;
    }
  });
}

}  // namespace shoal_quant
