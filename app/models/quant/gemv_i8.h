// The integer GEMV: weights' quants against int8 activations (quantize_x.h), as llama.cpp
// does on every CPU matmul. Decoding 32 nibbles to floats took ~10 instructions per block
// and left Q4 at half the memory's bandwidth; here a block is multiplied as bytes
// (maddubs: unsigned x signed pairs into int16, madd: pairs into int32) and converted to
// float once, then scaled by d_w * d_x. Exact up to the float accumulation, against x
// rounded to int8 per block; the Q4 offsets (w = d q + m) need per-block d_x * sum(q_x).
//
// Nibbles (Q4_0, Q4_1, Q4_K): one 32-byte load holds two rows' quants for a block (the
// group interleaves rows by 16 bytes), so a register carries a pair of rows; x comes with
// each half of a block doubled to match (quantize_x.h). Bytes (Q8_0): llama.cpp's sign
// trick, |w| (unsigned) times x with w's sign. Either way hadd folds the int32 products of
// a group's four rows into one vector, so one convert and one FMA serve all four. With
// AVX512-VNNI (below) dpbusd makes the int32 sums: nibbles four groups at a time, a row a
// lane (nibble_unit), bytes a group at a time with partial sums of several rows a register.
#pragma once

#include <cstdint>
#include <cstring>

#include "gemv.h"
#include "quantize_x.h"

namespace shoal_quant {

#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SHOAL_QUANT_VNNI 1
#endif

// Rows of x per pass over a group: past four, the accumulators of four rows crowd the 16
// AVX2 registers, and a second pass re-reads the group from L1 for about the same cost.
// AVX-512 has 32 registers: its passes keep two or three (nibble_unit: a float sum and
// one or two int32 chains) or two (bytes) per row of x.
#ifdef SHOAL_QUANT_VNNI
constexpr int kIntMaxT = 8;
#else
constexpr int kIntMaxT = 4;
#endif
static_assert(kIntMaxT <= kMaxT, "for_each_group's res holds kMaxT rows of x");

// A group's kG rows (quants at q, blocks of kG rows apart) against tt rows of x, scales as
// F::scales gives them: res[r * tt + t] = sum_b scale[b, r] d_x[t, b] sum_i q[r, i] q_x[t, i].
using IntPassFn = void (*)(const void* q, int64_t kb, const QuantizedX& x, int64_t t0, const float* scale,
                           float* res);

#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
// 256-bit vectors in an AVX-512 build without VNNI too (simd.h's vf is wider there).

// A pass asks for the quants 2 KB ahead of the block it reads (the group's next ones,
// then the next group's, which its thread takes next): the hardware prefetchers alone
// left a decode step's expert products at 14 GB/s of this machine's 25 (a 64-expert
// model's 570 MB, out of cache), 2-4 KB ahead brought them to 19-21, 1.3-1.4x faster
// (2 threads, AVX-512 VNNI; 8 and 256 rows of x alike; measured on the one-group nibble
// pass that nibble_unit replaced there, which prefetches its four streams itself).
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_ahead(const void* p, int lines = 1) {
  for (int i = 0; i < lines; ++i)
    _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes + 64 * i, _MM_HINT_T0);
}

#ifdef SHOAL_QUANT_VNNI
// Four row groups (16 rows) at once, each row in a lane of its own: the groups' blocks
// (four 64-byte loads) are transposed by dwords, so register u holds bytes 4u..4u+3 of
// every row and dpbusd takes it against four of x's bytes broadcast. A row's block then
// sums in one lane as an int32, and is scaled (convert, multiply, FMA) once for 16 rows.
// The pass this replaced held a group's block in one register, four partial sums a row,
// and scaled each: three float ops per 128 products where this takes three per 512, and
// those ops, not the dpbusd, set the pace of a product of many rows of x (one 512-bit FMA
// port on this machine's Xeon). Measured against it, in one process (Q4_K, 2 threads):
// a prefill's experts (256 rows each) 1.6x, 32 rows of a 32000-row head 1.7x, a decode of
// 32 over 64 experts (1-10 rows each) 1.2x; one row of x the same on a dense head, 6 %
// slower over experts of one row each (their scales now cost more than the pass). Lane
// 4r + j is row r of group j (for_each_group interleaves scale and off so); groups past ng
// read as zeros. The Q4 offsets join in the pass: one FMA per block for 16 rows.
template <int TT, bool kOff>
void nibble_unit(const uint8_t* q, int64_t group_bytes, int ng, int64_t kb, const QuantizedX& x, int64_t t0,
                 const float* scale, const float* off, float* res) {
  constexpr int kChains = TT <= 4 ? 2 : 1;
  const __m512i m4 = _mm512_set1_epi8(15);
  const int8_t* qx = x.q.data() + t0 * x.ldq;
  const float* dx = x.d.data() + t0 * kb;
  const int64_t n = kb * kG;
  const float* sx = kOff ? x.sxe.data() + t0 * n : nullptr;  // (t, block, row): each sum kG times
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    __m512i v[4];
    for (int j = 0; j < 4; ++j) {
      if (j < ng) {
        // each group's stream asks for the next unit's: with rows of up to 1024 weights
        // (2 KB a group), prefetch_ahead's 2 KB would land on this unit's next group,
        // already being read
        _mm_prefetch(reinterpret_cast<const char*>(q + (j + 4) * group_bytes + b * 64), _MM_HINT_T0);
        v[j] = _mm512_loadu_si512(q + j * group_bytes + b * 64);
      } else {
        v[j] = _mm512_setzero_si512();
      }
    }
    // 128-bit lane r of v[j] is row r of group j; dword u of lane r in u[u'] ends up in
    // lane 4r + j of register u'
    const __m512i a = _mm512_unpacklo_epi32(v[0], v[1]), c = _mm512_unpackhi_epi32(v[0], v[1]);
    const __m512i e = _mm512_unpacklo_epi32(v[2], v[3]), h = _mm512_unpackhi_epi32(v[2], v[3]);
    const __m512i u[4] = {_mm512_unpacklo_epi64(a, e), _mm512_unpackhi_epi64(a, e), _mm512_unpacklo_epi64(c, h),
                          _mm512_unpackhi_epi64(c, h)};
    __m512i lo[4], hi[4];
    for (int i = 0; i < 4; ++i) {
      lo[i] = _mm512_and_si512(u[i], m4);  // weights 4i..4i+3 of each row
      hi[i] = _mm512_and_si512(_mm512_srli_epi16(u[i], 4), m4);  // weights 16+4i..16+4i+3
    }
    // int32 sums in kChains chains a row of x: dpbusd's latency is 5 cycles
    __m512i s[TT], s2[TT];
    for (int t = 0; t < TT; ++t) s[t] = s2[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 8
      for (int t = 0; t < TT; ++t) {
        // x's block in nibble order: weights 0..15 twice, then 16..31 twice (quantize_x.h)
        const int8_t* xb = qx + t * x.ldq + b * 64;
        int32_t xlo, xhi;
        std::memcpy(&xlo, xb + 4 * i, 4);
        std::memcpy(&xhi, xb + 32 + 4 * i, 4);
        s[t] = _mm512_dpbusd_epi32(s[t], lo[i], _mm512_set1_epi32(xlo));
        if constexpr (kChains == 2)
          s2[t] = _mm512_dpbusd_epi32(s2[t], hi[i], _mm512_set1_epi32(xhi));
        else
          s[t] = _mm512_dpbusd_epi32(s[t], hi[i], _mm512_set1_epi32(xhi));
      }
    }
    if constexpr (kChains == 2)
      for (int t = 0; t < TT; ++t) s[t] = _mm512_add_epi32(s[t], s2[t]);
    const __m512 sw = _mm512_loadu_ps(scale + b * 16);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[t]), sw), _mm512_set1_ps(dx[t * kb + b]), acc[t]);
      if constexpr (kOff)
        acc[t] = _mm512_fmadd_ps(_mm512_loadu_ps(off + b * 16), _mm512_set1_ps(sx[t * n + b * kG]), acc[t]);
    }
  }
  // lanes back to row order (4r + j <-> 4j + r), a row of x after another
  const __m512i rows = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int t = 0; t < TT; ++t) _mm512_storeu_ps(res + t * 16, _mm512_permutexvar_ps(rows, acc[t]));
}

using UnitPassFn = void (*)(const uint8_t* q, int64_t group_bytes, int ng, int64_t kb, const QuantizedX& x,
                            int64_t t0, const float* scale, const float* off, float* res);

template <bool kOff>
constexpr UnitPassFn kUnitPass[kIntMaxT] = {
    &nibble_unit<1, kOff>, &nibble_unit<2, kOff>, &nibble_unit<3, kOff>, &nibble_unit<4, kOff>,
    &nibble_unit<5, kOff>, &nibble_unit<6, kOff>, &nibble_unit<7, kOff>, &nibble_unit<8, kOff>,
};
#else
// All four rows of the group; lanes of acc[t] hold rows (0, 0, 2, 2, 1, 1, 3, 3).
template <int TT>
void nibble_rows(const uint8_t* q, int64_t kb, const QuantizedX& x, int64_t t0, const float* scale,
                 float* res) {
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i lanes = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
  const int8_t* qx = x.q.data() + t0 * x.ldq;
  const float* dx = x.d.data() + t0 * kb;
  __m256 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    prefetch_ahead(q + b * 64);
    // a register holds two rows' 16 bytes: lanes 0..15 the first row's, 16..31 the second's
    const __m256i v01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 64));
    const __m256i v23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + b * 64 + 32));
    const __m256i lo01 = _mm256_and_si256(v01, m4), hi01 = _mm256_and_si256(_mm256_srli_epi16(v01, 4), m4);
    const __m256i lo23 = _mm256_and_si256(v23, m4), hi23 = _mm256_and_si256(_mm256_srli_epi16(v23, 4), m4);
    const __m256 sw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(scale + b * kG)), lanes);
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const __m256i* xb = reinterpret_cast<const __m256i*>(qx + t * x.ldq + b * 64);
      const __m256i xlo = _mm256_loadu_si256(xb), xhi = _mm256_loadu_si256(xb + 1);
      // int16 sums of four products (15 * 128 * 4 fits), then of eight (hadd, 15 * 128 * 8
      // fits): one multiply-port widening where two and an int32 hadd did the same sums
      const __m256i s01 = _mm256_add_epi16(_mm256_maddubs_epi16(lo01, xlo), _mm256_maddubs_epi16(hi01, xhi));
      const __m256i s23 = _mm256_add_epi16(_mm256_maddubs_epi16(lo23, xlo), _mm256_maddubs_epi16(hi23, xhi));
      const __m256i i = _mm256_madd_epi16(_mm256_hadd_epi16(s01, s23), ones);
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i), sw), _mm256_set1_ps(dx[t * kb + b]), acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    float l[8];
    _mm256_storeu_ps(l, acc[t]);
    for (int r = 0; r < kG; ++r) res[r * TT + t] = l[2 * (r / 2) + 4 * (r % 2)] + l[2 * (r / 2) + 4 * (r % 2) + 1];
  }
}
#endif

#ifdef SHOAL_QUANT_VNNI
// A block's four rows in two 512-bit registers (rows 0|1, 2|3), against x's 32 bytes
// twice. AVX-512 has no byte sign instruction: |w| comes from abs, and x takes w's sign
// by a masked negation. Lanes 8r'..8r'+7 of a register's accumulator belong to its row r'.
template <int TT>
void byte_rows(const int8_t* q, int64_t kb, const QuantizedX& x, int64_t t0, const float* scale, float* res) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i lanes01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m512i lanes23 = _mm512_add_epi32(lanes01, _mm512_set1_epi32(2));
  const int8_t* qx = x.q.data() + t0 * x.ldq;
  const float* dx = x.d.data() + t0 * kb;
  __m512 acc01[TT], acc23[TT];
  for (int t = 0; t < TT; ++t) acc01[t] = acc23[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    prefetch_ahead(q + b * kG * 32, 2);
    const __m512i w01 = _mm512_loadu_si512(q + b * kG * 32), w23 = _mm512_loadu_si512(q + b * kG * 32 + 64);
    const __m512i a01 = _mm512_abs_epi8(w01), a23 = _mm512_abs_epi8(w23);  // -128 too, as unsigned 128
    const __mmask64 n01 = _mm512_movepi8_mask(w01), n23 = _mm512_movepi8_mask(w23);
    const __m512 s = _mm512_castps128_ps512(_mm_loadu_ps(scale + b * kG));
    const __m512 sw01 = _mm512_permutexvar_ps(lanes01, s), sw23 = _mm512_permutexvar_ps(lanes23, s);
#pragma GCC unroll 8
    for (int t = 0; t < TT; ++t) {
      const __m512i xt = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * x.ldq + b * 32)));
      const __m512i i01 = _mm512_dpbusd_epi32(zero, a01, _mm512_mask_sub_epi8(xt, n01, zero, xt));
      const __m512i i23 = _mm512_dpbusd_epi32(zero, a23, _mm512_mask_sub_epi8(xt, n23, zero, xt));
      const __m512 d = _mm512_set1_ps(dx[t * kb + b]);
      acc01[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i01), sw01), d, acc01[t]);
      acc23[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i23), sw23), d, acc23[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    float l[32];
    _mm512_storeu_ps(l, acc01[t]);
    _mm512_storeu_ps(l + 16, acc23[t]);
    for (int r = 0; r < kG; ++r) {
      const float* v = l + 8 * r;
      res[r * TT + t] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
  }
}
#else
// All four rows of the group; lanes of acc[t] hold rows (0 1 2 3 0 1 2 3).
template <int TT>
void byte_rows(const int8_t* q, int64_t kb, const QuantizedX& x, int64_t t0, const float* scale, float* res) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* qx = x.q.data() + t0 * x.ldq;
  const float* dx = x.d.data() + t0 * kb;
  __m256 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    prefetch_ahead(q + b * kG * 32, 2);
    __m256i w[kG], aw[kG];
    for (int r = 0; r < kG; ++r) {
      w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (b * kG + r) * 32));
      aw[r] = _mm256_sign_epi8(w[r], w[r]);  // |w|: -128 too, as unsigned 128
    }
    const __m256 sw = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(scale + b * kG));
#pragma GCC unroll 4
    for (int t = 0; t < TT; ++t) {
      const __m256i xt = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + t * x.ldq + b * 32));
      __m256i i[kG];
      for (int r = 0; r < kG; ++r)  // int16 sums of two products: 128 * 127 * 2 fits
        i[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(xt, w[r])), ones);
      const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(i[0], i[1]), _mm256_hadd_epi32(i[2], i[3]));
      acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(h), sw), _mm256_set1_ps(dx[t * kb + b]), acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) {
    float l[8];
    _mm256_storeu_ps(l, acc[t]);
    for (int r = 0; r < kG; ++r) res[r * TT + t] = l[r] + l[r + 4];
  }
}

#endif

template <Ints I, int TT>
void int_pass(const void* q, int64_t kb, const QuantizedX& x, int64_t t0, const float* scale, float* res) {
  if constexpr (I == Ints::kNibbles) {
#ifndef SHOAL_QUANT_VNNI  // there: nibble_unit, four groups a pass
    nibble_rows<TT>(static_cast<const uint8_t*>(q), kb, x, t0, scale, res);
#endif
  } else {
    byte_rows<TT>(static_cast<const int8_t*>(q), kb, x, t0, scale, res);
  }
}

template <Ints I>
constexpr IntPassFn kIntPass[kIntMaxT] = {
    &int_pass<I, 1>, &int_pass<I, 2>, &int_pass<I, 3>, &int_pass<I, 4>,
#ifdef SHOAL_QUANT_VNNI
    &int_pass<I, 5>, &int_pass<I, 6>, &int_pass<I, 7>, &int_pass<I, 8>,
#endif
};

#else
// Plain loops, the same sums in another order.
inline void int_pass_plain(Ints ints, int tt, const void* q, int64_t kb, const QuantizedX& x, int64_t t0,
                           const float* scale, float* res) {
  for (int r = 0; r < kG; ++r)
    for (int t = 0; t < tt; ++t) {
      const int8_t* qx = x.q.data() + (t0 + t) * x.ldq;
      float acc = 0.f;
      for (int64_t b = 0; b < kb; ++b) {
        int32_t dot = 0;
        if (ints == Ints::kNibbles) {
          const uint8_t* w = static_cast<const uint8_t*>(q) + (b * kG + r) * 16;
          for (int j = 0; j < 16; ++j) dot += (w[j] & 15) * qx[b * 64 + j] + (w[j] >> 4) * qx[b * 64 + 32 + j];
        } else {
          const int8_t* w = static_cast<const int8_t*>(q) + (b * kG + r) * 32;
          for (int j = 0; j < 32; ++j) dot += w[j] * qx[b * 32 + j];
        }
        acc += float(dot) * scale[b * kG + r] * x.d[(t0 + t) * kb + b];
      }
      res[r * tt + t] = acc;
    }
}
#endif

// out (T, N) = x @ W^T with x rounded to int8 per block; x (T, K) contiguous float32.
template <class F, class O>
void gemv_i8(const F& f, int64_t N, int64_t K, const float* x, int64_t T, O* out, int64_t ldo,
             const std::vector<Segment>& segments = {}) {
  static_assert(F::kInts != Ints::kNone && F::kSubs == 1, "a format with one scale per 32-block of quants");
  constexpr bool nibbles = F::kInts == Ints::kNibbles;
  const QuantizedX qx = quantize_x(x, T, K, nibbles, F::kOffset);
  const int64_t kb = K / 32, group_bytes = kb * kG * (nibbles ? 16 : 32);
  const auto* base = reinterpret_cast<const uint8_t*>(f.qs);
#ifdef SHOAL_QUANT_VNNI
  if constexpr (nibbles) {  // four groups a pass, the offsets in it
    for_each_group(f, N, K, T, qx.sxe.data(), out, ldo,
                   [&](int64_t g, int ng, int64_t t0, int tt, const float* scale, const float* off, float* res) {
                     kUnitPass<F::kOffset>[tt - 1](base + g * group_bytes, group_bytes, ng, kb, qx, t0, scale,
                                                   off, res);
                   },
                   kIntMaxT, true, segments, kMaxUnit);
    return;
  }
#endif
  for_each_group(f, N, K, T, qx.sxe.data(), out, ldo,
                 [&](int64_t g, int, int64_t t0, int tt, const float* scale, const float*, float* res) {
                   const void* q = base + g * group_bytes;
#if !defined(SHOAL_QUANT_PORTABLE) && defined(__AVX2__) && defined(__FMA__)
                   kIntPass<F::kInts>[tt - 1](q, kb, qx, t0, scale, res);
#else
                   int_pass_plain(F::kInts, tt, q, kb, qx, t0, scale, res);
#endif
                 },
                 kIntMaxT, false, segments);
}

}  // namespace shoal_quant
