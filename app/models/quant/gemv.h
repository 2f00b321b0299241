// The fused dequantise-GEMV: out[t, n] = sum_k x[t, k] W[n, k] for a few rows of x (decode).
//
// Each 32-weight block is decoded once into registers and multiplied with every row of x
// there, so weights stream from memory once per call. A block's partial dot products are
// scaled once (sum_i d q_i x_i = d sum_i q_i x_i); Q4 offsets need only per-block sums of
// x (sum_i m x_i = m sum_i x_i), precomputed per call. Activations stay float32: the
// result differs from exact dequantisation + float matmul only in summation order
// (gemv_i8.h, opt-in where a format has it, rounds them to int8 and runs faster).
//
// Work goes by row group (formats.h): threads split the groups, and within one the rows
// are taken R at a time (4 for one or two rows of x, 2 for up to four, else 1), so R rows
// share each x load, give the FMA units R independent chains, and reduce together.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "formats.h"
#include "simd.h"

namespace shoal_quant {

constexpr int kMaxT = 8;  // rows of x held in registers per pass over a row group

constexpr int group_rows(int tt) { return tt <= 2 ? 4 : tt <= 4 ? 2 : 1; }

// Rows r0..r0+R-1 of group g against TT rows of x (ldx apart), scales from F::scales:
// res[r * TT + t] = the row's dot product without its offset terms.
template <int R, int TT, class F>
void gemv_rows(const F& f, int64_t g, int r0, int64_t kb, const float* x, int64_t ldx, const float* scale,
               float* res) {
  constexpr int per = kNV / F::kSubs;  // vectors per scale
  vf acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = vzero();
  for (int64_t b = 0; b < kb; ++b) {
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      vf q[kNV];
      f.decode(g * kG + r0 + r, b, q);
      for (int s = 0; s < F::kSubs; ++s) {
        const vf sc = vset1(scale[(b * F::kSubs + s) * kG + r0 + r]);
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
using RowsFn = void (*)(const F&, int64_t, int, int64_t, const float*, int64_t, const float*, float*);

template <class F>
constexpr RowsFn<F> kRowsFn[kMaxT] = {&gemv_rows<group_rows(1), 1, F>, &gemv_rows<group_rows(2), 2, F>,
                                      &gemv_rows<group_rows(3), 3, F>, &gemv_rows<group_rows(4), 4, F>,
                                      &gemv_rows<1, 5, F>,             &gemv_rows<1, 6, F>,
                                      &gemv_rows<1, 7, F>,             &gemv_rows<1, 8, F>};

// res[r * tt + t] += sum_b off[b * kG + r] * sx[t * kb + b]: a group's Q4 offset terms.
// sxe repeats each block's x-sum kG times ((T, kb * kG), like off's (block, row) order),
// so each vector op covers kW / kG blocks of all kG rows, and lane l belongs to row l % kG.
inline void add_offsets(const float* off, const float* sxe, int64_t n, int64_t tt, float* res) {
  for (int64_t t = 0; t < tt; ++t) {
    const float* s = sxe + t * n;
    vf a0 = vzero(), a1 = vzero();  // two chains: one would wait out each FMA's latency
    int64_t i = 0;
    for (; i + 2 * kW <= n; i += 2 * kW) {
      a0 = vfma(vload(off + i), vload(s + i), a0);
      a1 = vfma(vload(off + i + kW), vload(s + i + kW), a1);
    }
    for (; i + kW <= n; i += kW) a0 = vfma(vload(off + i), vload(s + i), a0);
    float lanes[kW], o[kG] = {};
    vstore(lanes, vadd(a0, a1));
    for (int l = 0; l < kW; ++l) o[l % kG] += lanes[l];
    for (; i < n; ++i) o[i % kG] += off[i] * s[i];
    for (int r = 0; r < kG; ++r) res[r * tt + t] += o[r];
  }
}

// A run of x's rows [t0, t1) multiplied by a run of W's row groups [g0, g1), written to
// out's columns from 0: a dense product is one segment (every row, every group); experts
// stacked in one weight (grouped_matmul) one per expert that received rows.
struct Segment {
  int64_t t0, t1, g0, g1;
};

// The GEMV's frame, whatever the activations: threads split the segments' row groups
// (one flat range, so small experts do not each pay a thread team); per group its
// scales, then the segment's rows of x max_t (<= kMaxT) at a time: pass(g, t0, tt, scale,
// off, res) fills res[r * tt + t] for the group's kG rows without offset terms (unless
// offsets_in_pass), which come from sxe ((T, kb * kG), per-block sums of x as add_offsets
// reads them); then the rows go to out ((T, N), rows ldo apart). No segments: one
// segment of all T rows and all groups.
template <class F, class O, class Pass>
void for_each_group(const F& f, int64_t N, int64_t K, int64_t T, const float* sxe, O* out, int64_t ldo,
                    const Pass& pass, int max_t = kMaxT, bool offsets_in_pass = false,
                    std::vector<Segment> segments = {}) {
  const int64_t kb = K / 32;
  if (segments.empty()) segments.push_back({0, T, 0, (N + kG - 1) / kG});
  std::vector<int64_t> first(segments.size() + 1, 0);  // each segment's first flat index
  for (size_t s = 0; s < segments.size(); ++s) first[s + 1] = first[s] + segments[s].g1 - segments[s].g0;
  // Chunks of at least 64k weights: smaller ones cost more in wake-ups than they save.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (K * kG));
  at::parallel_for(0, first.back(), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scale(kb * F::kSubs * kG), off(F::kOffset ? kb * kG : 0);
    float res[kG * kMaxT];
    size_t s = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (i >= first[s + 1]) ++s;
      const Segment& seg = segments[s];
      const int64_t g = seg.g0 + (i - first[s]), col = (g - seg.g0) * kG;
      const int rows = int(std::min<int64_t>(kG, N - g * kG));  // the last group may be padded
      f.scales(g, scale.data(), off.data());
      // Past max_t rows of x, each pass over the group reads it from L1, not memory.
      for (int64_t t0 = seg.t0; t0 < seg.t1; t0 += max_t) {
        const int tt = int(std::min<int64_t>(max_t, seg.t1 - t0));
        pass(g, t0, tt, scale.data(), off.data(), res);
        if constexpr (F::kOffset)
          if (!offsets_in_pass) add_offsets(off.data(), sxe + t0 * kb * kG, kb * kG, tt, res);
        for (int r = 0; r < rows; ++r)
          for (int t = 0; t < tt; ++t) out[(t0 + t) * ldo + col + r] = static_cast<O>(res[r * tt + t]);
      }
    }
  });
}

// Float activations: x is (T, K) contiguous float32.
template <class F, class O>
void gemv(const F& f, int64_t N, int64_t K, const float* x, int64_t T, O* out, int64_t ldo,
          const std::vector<Segment>& segments = {}) {
  const int64_t kb = K / 32;
  std::vector<float> sxe(F::kOffset ? T * kb * kG : 0);  // (T, kb, kG): sums of x per block
  for (int64_t i = 0; i < int64_t(sxe.size()) / kG; ++i) {
    vf s = vzero();
    for (int j = 0; j < kNV; ++j) s = vadd(s, vload(x + i * 32 + j * kW));
    const float sum = vsum(s);
    for (int r = 0; r < kG; ++r) sxe[i * kG + r] = sum;
  }
  for_each_group(f, N, K, T, sxe.data(), out, ldo, [&](int64_t g, int64_t t0, int tt, const float* scale, const float*, float* res) {
    for (int r0 = 0; r0 < kG; r0 += group_rows(tt))  // padded rows are zeros: safe to read
      kRowsFn<F>[tt - 1](f, g, r0, kb, x + t0 * K, K, scale, res + r0 * tt);
  }, kMaxT, false, segments);
}

}  // namespace shoal_quant
