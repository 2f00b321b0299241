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
// (one flat range, so small experts do not each pay a thread team), `unit` consecutive
// groups of a segment at a time; per unit its scales, then the segment's rows of x max_t
// (<= kMaxT) at a time: pass(g, ng, t0, tt, scale, off, res) fills res[r * tt + t] (one
// group a unit) or res[t * unit * kG + r] (more) for the ng groups' ng * kG rows (r
// counted from group g's first) without offset terms
// (unless offsets_in_pass), which come from sxe ((T, kb * kG), per-block sums of x as
// add_offsets reads them); then the rows go to out ((T, N), rows ldo apart). One group a
// unit: scale and off are F::scales'. More (the VNNI nibble pass, gemv_i8.h): they are
// interleaved per block, [b][r][j] for row r of the unit's group j (zeros past ng), the
// order of that pass's lanes. No segments: one segment of all T rows and all groups.
constexpr int kMaxUnit = 4;  // row groups a pass may take at once

// Four groups' per-block values, [j][b][r] (F::scales' order, one group after another),
// to [b][r][j]: lane 4r + j of the VNNI nibble pass (gemv_i8.h) is row r of group j.
inline void interleave_groups(const float* in, int64_t blocks, float* out) {
  int64_t b = 0;
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX512F__)
  // Four blocks at a time, in two rounds of two-source permutes (one shuffle-port op
  // each, half the unpack-and-shuffle transpose's count): first pairs of groups per pair
  // of blocks, [q][r][j of the pair], then the two pairs' halves per block.
  auto index = [](auto lane) {
    alignas(64) int32_t v[16];
    for (int l = 0; l < 16; ++l) v[l] = lane(l);
    return _mm512_load_si512(v);
  };
  // pair (j0, j0 + 1), blocks 2h, 2h + 1: lane 8q + 2r + j from z_j's lane 4(2h + q) + r
  const __m512i pair_lo = index([](int l) { return (l & 1) * 16 + 4 * (l >> 3) + ((l >> 1) & 3); });
  const __m512i pair_hi = index([](int l) { return (l & 1) * 16 + 4 * (2 + (l >> 3)) + ((l >> 1) & 3); });
  // block q of a pair of blocks: lane 4r + j from pair (j >> 1)'s lane 8q + 2r + (j & 1)
  const __m512i block0 = index([](int l) { return (l & 3) / 2 * 16 + 2 * (l >> 2) + (l & 1); });
  const __m512i block1 = index([](int l) { return (l & 3) / 2 * 16 + 8 + 2 * (l >> 2) + (l & 1); });
  for (; b + 4 <= blocks; b += 4) {
    const float* p = in + b * kG;
    const __m512 z0 = _mm512_loadu_ps(p), z1 = _mm512_loadu_ps(p + blocks * kG);
    const __m512 z2 = _mm512_loadu_ps(p + 2 * blocks * kG), z3 = _mm512_loadu_ps(p + 3 * blocks * kG);
    const __m512 p01_lo = _mm512_permutex2var_ps(z0, pair_lo, z1), p01_hi = _mm512_permutex2var_ps(z0, pair_hi, z1);
    const __m512 p23_lo = _mm512_permutex2var_ps(z2, pair_lo, z3), p23_hi = _mm512_permutex2var_ps(z2, pair_hi, z3);
    _mm512_storeu_ps(out + (b + 0) * 16, _mm512_permutex2var_ps(p01_lo, block0, p23_lo));
    _mm512_storeu_ps(out + (b + 1) * 16, _mm512_permutex2var_ps(p01_lo, block1, p23_lo));
    _mm512_storeu_ps(out + (b + 2) * 16, _mm512_permutex2var_ps(p01_hi, block0, p23_hi));
    _mm512_storeu_ps(out + (b + 3) * 16, _mm512_permutex2var_ps(p01_hi, block1, p23_hi));
  }
#endif
  for (; b < blocks; ++b)
    for (int r = 0; r < kG; ++r)
      for (int j = 0; j < 4; ++j) out[b * 16 + 4 * r + j] = in[(j * blocks + b) * kG + r];
}

template <class F, class O, class Pass>
void for_each_group(const F& f, int64_t N, int64_t K, int64_t T, const float* sxe, O* out, int64_t ldo,
                    const Pass& pass, int max_t = kMaxT, bool offsets_in_pass = false,
                    std::vector<Segment> segments = {}, int unit = 1) {
  TORCH_CHECK(unit == 1 || unit == kMaxUnit, "a unit is one row group or ", kMaxUnit);
  const int64_t kb = K / 32, per_group = kb * F::kSubs * kG;
  if (segments.empty()) segments.push_back({0, T, 0, (N + kG - 1) / kG});
  std::vector<int64_t> first(segments.size() + 1, 0);  // each segment's first flat index
  for (size_t s = 0; s < segments.size(); ++s)
    first[s + 1] = first[s] + (segments[s].g1 - segments[s].g0 + unit - 1) / unit;
  // As many ranges as give each about 64k weights or more, up to the threads: smaller
  // ones cost more in wake-ups than they save.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (K * kG * unit));
  const int64_t units = first.back();
  const int64_t parts = std::clamp<int64_t>((units + grain - 1) / grain, 1, at::get_num_threads());
  // The threads' ranges of units are of about equal cost, not count: a unit costs its
  // segment's rows of x plus kUnitCost for its scales and weight bytes. Experts get 1-10
  // rows each in a decode of 32, so ranges of equal count left one thread waiting on the
  // other (with the even split, libgomp's spin was ~14 % of such a step's samples).
  constexpr int64_t kUnitCost = 2;
  std::vector<int64_t> bounds(parts + 1, units);
  {
    int64_t total = 0;
    for (size_t s = 0; s < segments.size(); ++s)
      total += (first[s + 1] - first[s]) * (segments[s].t1 - segments[s].t0 + kUnitCost);
    bounds[0] = 0;
    int64_t p = 1, cost = 0;
    for (size_t s = 0; s < segments.size() && p < parts; ++s) {
      const int64_t each = segments[s].t1 - segments[s].t0 + kUnitCost;
      for (int64_t i = first[s]; i < first[s + 1] && p < parts; ++i) {
        cost += each;
        while (p < parts && cost * parts >= total * p) bounds[p++] = i + 1;
      }
    }
  }
  at::parallel_for(0, parts, 1, [&](int64_t part0, int64_t part1) {
    const int64_t begin = bounds[part0], end = bounds[part1];
    if (begin >= end) return;
    std::vector<float> scale(per_group * unit), off(F::kOffset ? kb * kG * unit : 0);
    std::vector<float> by_group(unit > 1 ? scale.size() + off.size() : 0);  // [scale | off][j][b][r]
    float res[kMaxUnit * kG * kMaxT];
    size_t s = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (int64_t i = begin; i < end; ++i) {
      while (i >= first[s + 1]) ++s;
      const Segment& seg = segments[s];
      const int64_t g = seg.g0 + (i - first[s]) * unit;
      const int ng = int(std::min<int64_t>(unit, seg.g1 - g));
      if (unit == 1) {
        f.scales(g, scale.data(), off.data());
      } else {
        float* group_off = by_group.data() + scale.size();
        for (int j = 0; j < unit; ++j) {
          if (j < ng) {
            f.scales(g + j, by_group.data() + j * per_group, group_off + j * per_group);
          } else {
            std::fill_n(by_group.data() + j * per_group, per_group, 0.f);
            std::fill_n(group_off + j * per_group, F::kOffset ? per_group : 0, 0.f);
          }
        }
        interleave_groups(by_group.data(), per_group / kG, scale.data());
        if constexpr (F::kOffset) interleave_groups(group_off, per_group / kG, off.data());
      }
      // Past max_t rows of x, each pass over the unit reads it from L1, not memory.
      for (int64_t t0 = seg.t0; t0 < seg.t1; t0 += max_t) {
        const int tt = int(std::min<int64_t>(max_t, seg.t1 - t0));
        pass(g, ng, t0, tt, scale.data(), off.data(), res);
        if constexpr (F::kOffset)
          if (!offsets_in_pass) add_offsets(off.data(), sxe + t0 * kb * kG, kb * kG, tt, res);
        const int64_t col = (g - seg.g0) * kG;
        const int rows = int(std::min<int64_t>(ng * kG, N - g * kG));  // the last group may be padded
        if (unit == 1) {
          for (int r = 0; r < rows; ++r)
            for (int t = 0; t < tt; ++t) out[(t0 + t) * ldo + col + r] = static_cast<O>(res[r * tt + t]);
        } else {
          for (int t = 0; t < tt; ++t)
            for (int r = 0; r < rows; ++r) out[(t0 + t) * ldo + col + r] = static_cast<O>(res[t * unit * kG + r]);
        }
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
  for_each_group(f, N, K, T, sxe.data(), out, ldo, [&](int64_t g, int, int64_t t0, int tt, const float* scale, const float*, float* res) {
    for (int r0 = 0; r0 < kG; r0 += group_rows(tt))  // padded rows are zeros: safe to read
      kRowsFn<F>[tt - 1](f, g, r0, kb, x + t0 * K, K, scale, res + r0 * tt);
  }, kMaxT, false, segments);
}

}  // namespace shoal_quant
