// The packed formats as the kernels see them (layouts: app/models/quant/packed_weight.py).
//
// Rows come in groups of kG = 4, interleaved unit by unit: for each 32-weight block the
// four rows' quants lie side by side (one 64-byte line in the 4-bit types), and so do
// their scales. A GEMV over a group then reads one sequential stream; with rows one after
// another it read four short ones, which the hardware prefetchers follow badly (twice as
// slow on 1536-wide rows, bench/quant_gemv.py).
//
// A format gives a group's scales (`scales`: s[(b * kSubs + j) * kG + r], one per kSubs-th
// of block b of row r, and with kOffset an additive term off[b * kG + r]; both exact float
// products of the file's fp16/int values) and any row's blocks as exact integer-valued
// floats (`decode`). A weight is then s * q (+ off), bit for bit gguf's dequantisation:
// every product fits a float's 24-bit mantissa, so the only rounding is the one numpy does.
//
// kInts: which integer kernel (gemv_i8.h) takes the format's quants against int8
// activations: kNibbles for 16 bytes of 4-bit quants per 32 weights (qs), kBytes for 32
// int8 quants, kNone where only the float GEMV reads it.
//
// kFloatGemvMaxT: up to this many rows of float32 x, quant_matmul's automatic choice is
// the GEMV, past it dequantised tiles and at::mm: where the two cross on AVX2 (Zen 3, 2
// threads), as bench/quant_gemv.py measures it (1536x576). Int8 activations (kInts) take
// their GEMV at any row count: it keeps pace with the tiles up to 512 rows, and a row's
// product is then the same bits however many rows share the call (batch invariance).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "simd.h"

namespace shoal_quant {

constexpr int kG = 4;  // rows per interleaved group

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

enum class Ints { kNone, kNibbles, kBytes };

inline const uint16_t* halves(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

// Offset of unit u of row n in an array of `units` units per row, `size` elements each.
inline int64_t at_unit(int64_t n, int64_t u, int64_t units, int64_t size) {
  return ((n / kG * units + u) * kG + n % kG) * size;
}

struct Q4_0 {  // w = d * (q - 8) = d * q + (-8 d)
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr Ints kInts = Ints::kNibbles;
  static constexpr int64_t kFloatGemvMaxT = 16;
  const uint8_t* qs;
  const uint16_t* d;
  int64_t kb;
  Q4_0(const std::vector<at::Tensor>& p, int64_t k) : qs(p[0].data_ptr<uint8_t>()), d(halves(p[1])), kb(k / 32) {}
  void scales(int64_t g, float* s, float* off) const {
    halves_to_floats(d + g * kb * kG, s, kb * kG);
    scale_floats(s, -8.f, off, kb * kG);
  }
  void decode(int64_t n, int64_t b, vf* v) const { decode_nib(qs + at_unit(n, b, kb, 16), v); }
};

struct Q4_1 {  // w = d * q + m
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr Ints kInts = Ints::kNibbles;
  static constexpr int64_t kFloatGemvMaxT = 16;
  const uint8_t* qs;
  const uint16_t *d, *m;
  int64_t kb;
  Q4_1(const std::vector<at::Tensor>& p, int64_t k)
      : qs(p[0].data_ptr<uint8_t>()), d(halves(p[1])), m(halves(p[2])), kb(k / 32) {}
  void scales(int64_t g, float* s, float* off) const {
    halves_to_floats(d + g * kb * kG, s, kb * kG);
    halves_to_floats(m + g * kb * kG, off, kb * kG);
  }
  void decode(int64_t n, int64_t b, vf* v) const { decode_nib(qs + at_unit(n, b, kb, 16), v); }
};

struct Q8_0 {  // w = d * q
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = false;
  static constexpr Ints kInts = Ints::kBytes;
  static constexpr int64_t kFloatGemvMaxT = 16;
  const int8_t* qs;
  const uint16_t* d;
  int64_t kb;
  Q8_0(const std::vector<at::Tensor>& p, int64_t k) : qs(p[0].data_ptr<int8_t>()), d(halves(p[1])), kb(k / 32) {}
  void scales(int64_t g, float* s, float*) const { halves_to_floats(d + g * kb * kG, s, kb * kG); }
  void decode(int64_t n, int64_t b, vf* v) const { decode_i8(qs + at_unit(n, b, kb, 32), v); }
};

struct Q4_K {  // w = (d * sc) * q - dmin * mn, sc/mn per 32 weights, d/dmin per 256
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr Ints kInts = Ints::kNibbles;
  static constexpr int64_t kFloatGemvMaxT = 12;
  const uint8_t *qs, *sc, *mn;
  const uint16_t *d, *dmin;
  int64_t kb;
  Q4_K(const std::vector<at::Tensor>& p, int64_t k)
      : qs(p[0].data_ptr<uint8_t>()), sc(p[3].data_ptr<uint8_t>()), mn(p[4].data_ptr<uint8_t>()),
        d(halves(p[1])), dmin(halves(p[2])), kb(k / 32) {}
  void scales(int64_t g, float* s, float* off) const {
    for (int64_t j = 0; j < kb / 8; ++j) {  // 8 blocks x 4 rows of bytes per super-block
      const int64_t at = (g * kb + 8 * j) * kG, h = (g * (kb / 8) + j) * kG;
      k_scales(sc + at, d + h, 1.f, s + 8 * j * kG, 8 * kG);
      k_scales(mn + at, dmin + h, -1.f, off + 8 * j * kG, 8 * kG);
    }
  }
  void decode(int64_t n, int64_t b, vf* v) const { decode_nib(qs + at_unit(n, b, kb, 16), v); }
};

struct Q5_K {  // Q4_K's w with q = nibble + 16 * fifth bit (0..31)
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  static constexpr Ints kInts = Ints::kNone;
  static constexpr int64_t kFloatGemvMaxT = 12;
  Q4_K low;  // the nibbles, scales and mins, laid out as Q4_K's
  const uint8_t* qh;
  Q5_K(const std::vector<at::Tensor>& p, int64_t k)
      : low({p[0], p[2], p[3], p[4], p[5]}, k), qh(p[1].data_ptr<uint8_t>()) {}
  void scales(int64_t g, float* s, float* off) const { low.scales(g, s, off); }
  void decode(int64_t n, int64_t b, vf* v) const {
    low.decode(n, b, v);
    const int64_t units = 2 * low.kb;  // two 16-bit units of fifth bits per block
    add_fifth_bits(qh + at_unit(n, 2 * b, units, 2), qh + at_unit(n, 2 * b + 1, units, 2), v);
  }
};

struct Q6_K {  // w = (d * sc) * (q - 32), sc per 16 weights, d per 256
  static constexpr int kSubs = 2;
  static constexpr bool kOffset = false;
  static constexpr Ints kInts = Ints::kNone;
  static constexpr int64_t kFloatGemvMaxT = 12;
  const uint8_t *lo, *hi;
  const int8_t* sc;
  const uint16_t* d;
  int64_t kb;
  Q6_K(const std::vector<at::Tensor>& p, int64_t k)
      : lo(p[0].data_ptr<uint8_t>()), hi(p[1].data_ptr<uint8_t>()), sc(p[2].data_ptr<int8_t>()),
        d(halves(p[3])), kb(k / 32) {}
  void scales(int64_t g, float* s, float*) const {
    for (int64_t j = 0; j < kb / 8; ++j)  // 16 scales x 4 rows per super-block
      k_scales(sc + (g * 2 * kb + 16 * j) * kG, d + (g * (kb / 8) + j) * kG, 1.f, s + 16 * j * kG, 16 * kG);
  }
  void decode(int64_t n, int64_t b, vf* v) const {
    decode_q6(lo + at_unit(n, b, kb, 16), hi + at_unit(n, b, kb, 8), v);
  }
};

// Checks the parts' dtypes and shapes against the format, then calls fn(format).
template <class Fn>
void with_format(int64_t qtype, const std::vector<at::Tensor>& p, int64_t n, int64_t k, Fn&& fn) {
  using S = at::ScalarType;
  struct Spec {
    S dtype;
    int64_t weights_per_element;  // columns per row = k / this
  };
  std::vector<Spec> spec;
  switch (qtype) {
    case kQ4_0: spec = {{S::Byte, 2}, {S::Half, 32}}; break;
    case kQ4_1: spec = {{S::Byte, 2}, {S::Half, 32}, {S::Half, 32}}; break;
    case kQ8_0: spec = {{S::Char, 1}, {S::Half, 32}}; break;
    case kQ4_K: spec = {{S::Byte, 2}, {S::Half, 256}, {S::Half, 256}, {S::Byte, 32}, {S::Byte, 32}}; break;
    case kQ5_K:
      spec = {{S::Byte, 2}, {S::Byte, 8}, {S::Half, 256}, {S::Half, 256}, {S::Byte, 32}, {S::Byte, 32}};
      break;
    case kQ6_K: spec = {{S::Byte, 2}, {S::Byte, 4}, {S::Char, 16}, {S::Half, 256}}; break;
    default: TORCH_CHECK(false, "unsupported GGML type ", qtype);
  }
  const int64_t block = (qtype == kQ4_K || qtype == kQ5_K || qtype == kQ6_K) ? 256 : 32;
  TORCH_CHECK(k > 0 && k % block == 0, "K=", k, " is not a multiple of ", block);
  TORCH_CHECK(p.size() == spec.size(), "GGML type ", qtype, " has ", spec.size(), " parts, got ", p.size());
  const int64_t groups = (n + kG - 1) / kG;
  for (size_t i = 0; i < p.size(); ++i) {
    const int64_t cols = kG * k / spec[i].weights_per_element;
    TORCH_CHECK(p[i].device().is_cpu() && p[i].scalar_type() == spec[i].dtype && p[i].dim() == 2 &&
                    p[i].size(0) == groups && p[i].size(1) == cols && p[i].is_contiguous(),
                "part ", i, " of GGML type ", qtype, ": expected contiguous (", groups, ", ", cols, ") ",
                spec[i].dtype, ", got ", p[i].sizes(), " ", p[i].scalar_type());
  }
  switch (qtype) {
    case kQ4_0: fn(Q4_0(p, k)); break;
    case kQ4_1: fn(Q4_1(p, k)); break;
    case kQ8_0: fn(Q8_0(p, k)); break;
    case kQ4_K: fn(Q4_K(p, k)); break;
    case kQ5_K: fn(Q5_K(p, k)); break;
    default: fn(Q6_K(p, k)); break;
  }
}

}  // namespace shoal_quant
