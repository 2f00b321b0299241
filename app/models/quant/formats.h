// The packed formats as the kernels see them (layouts: app/models/quant/packed_weight.py).
//
// Each format gives, per row n, its scales (`scales`: one per kSubs-th of a 32-weight
// block, and with kOffset one additive term per block, both exact float products of the
// file's fp16/int values) and its blocks as exact integer-valued floats (`decode`). A
// weight is then scale * q (+ off), which is bit for bit gguf's dequantisation: every
// product here fits a float's 24-bit mantissa, so the only rounding is the one numpy does.
#pragma once

#include <torch/extension.h>

#include <vector>

#include "simd.h"

namespace shoal_quant {

enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

inline const uint16_t* halves(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr<at::Half>());
}

struct Q4_0 {  // w = d * (q - 8) = d * q + (-8 d)
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  const uint8_t* qs;
  const uint16_t* d;
  int64_t kb;
  Q4_0(const std::vector<at::Tensor>& p, int64_t k) : qs(p[0].data_ptr<uint8_t>()), d(halves(p[1])), kb(k / 32) {}
  void scales(int64_t n, float* s, float* off) const {
    halves_to_floats(d + n * kb, s, kb);
    for (int64_t b = 0; b < kb; ++b) off[b] = -8.f * s[b];
  }
  void decode(int64_t n, int64_t b, vf* v) const { decode_nib(qs + (n * kb + b) * 16, v); }
};

struct Q4_1 {  // w = d * q + m
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  const uint8_t* qs;
  const uint16_t *d, *m;
  int64_t kb;
  Q4_1(const std::vector<at::Tensor>& p, int64_t k)
      : qs(p[0].data_ptr<uint8_t>()), d(halves(p[1])), m(halves(p[2])), kb(k / 32) {}
  void scales(int64_t n, float* s, float* off) const {
    halves_to_floats(d + n * kb, s, kb);
    halves_to_floats(m + n * kb, off, kb);
  }
  void decode(int64_t n, int64_t b, vf* v) const { decode_nib(qs + (n * kb + b) * 16, v); }
};

struct Q8_0 {  // w = d * q
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = false;
  const int8_t* qs;
  const uint16_t* d;
  int64_t kb;
  Q8_0(const std::vector<at::Tensor>& p, int64_t k) : qs(p[0].data_ptr<int8_t>()), d(halves(p[1])), kb(k / 32) {}
  void scales(int64_t n, float* s, float*) const { halves_to_floats(d + n * kb, s, kb); }
  void decode(int64_t n, int64_t b, vf* v) const { decode_i8(qs + (n * kb + b) * 32, v); }
};

struct Q4_K {  // w = (d * sc) * q - dmin * mn, sc/mn per 32 weights, d/dmin per 256
  static constexpr int kSubs = 1;
  static constexpr bool kOffset = true;
  const uint8_t *qs, *sc, *mn;
  const uint16_t *d, *dmin;
  int64_t kb;
  Q4_K(const std::vector<at::Tensor>& p, int64_t k)
      : qs(p[0].data_ptr<uint8_t>()), sc(p[3].data_ptr<uint8_t>()), mn(p[4].data_ptr<uint8_t>()),
        d(halves(p[1])), dmin(halves(p[2])), kb(k / 32) {}
  void scales(int64_t n, float* s, float* off) const {
    const uint8_t *scr = sc + n * kb, *mnr = mn + n * kb;
    for (int64_t j = 0; j < kb / 8; ++j) {  // per 256 weights
      const float dj = half_to_float(d[n * (kb / 8) + j]), mj = -half_to_float(dmin[n * (kb / 8) + j]);
      scale_u8x8(scr + 8 * j, dj, s + 8 * j);
      scale_u8x8(mnr + 8 * j, mj, off + 8 * j);
    }
  }
  void decode(int64_t n, int64_t b, vf* v) const { decode_nib(qs + (n * kb + b) * 16, v); }
};

struct Q6_K {  // w = (d * sc) * (q - 32), sc per 16 weights, d per 256
  static constexpr int kSubs = 2;
  static constexpr bool kOffset = false;
  const uint8_t *lo, *hi;
  const int8_t* sc;
  const uint16_t* d;
  int64_t kb;
  Q6_K(const std::vector<at::Tensor>& p, int64_t k)
      : lo(p[0].data_ptr<uint8_t>()), hi(p[1].data_ptr<uint8_t>()), sc(p[2].data_ptr<int8_t>()),
        d(halves(p[3])), kb(k / 32) {}
  void scales(int64_t n, float* s, float*) const {
    const int8_t* scr = sc + n * 2 * kb;
    for (int64_t j = 0; j < kb / 8; ++j) {  // per 256 weights
      const float dj = half_to_float(d[n * (kb / 8) + j]);
      scale_i8x8(scr + 16 * j, dj, s + 16 * j);
      scale_i8x8(scr + 16 * j + 8, dj, s + 16 * j + 8);
    }
  }
  void decode(int64_t n, int64_t b, vf* v) const {
    const int64_t blk = n * kb + b;
    decode_q6(lo + blk * 16, hi + blk * 8, v);
  }
};

struct PartSpec {
  at::ScalarType dtype;
  int64_t per_row_div;  // columns = k / per_row_div (k * 1 for Q8_0's quants)
};

// Checks the parts' dtypes and shapes against the format, then calls fn(format).
template <class Fn>
void with_format(int64_t qtype, const std::vector<at::Tensor>& p, int64_t n, int64_t k, Fn&& fn) {
  using S = at::ScalarType;
  std::vector<PartSpec> spec;
  switch (qtype) {
    case kQ4_0: spec = {{S::Byte, 2}, {S::Half, 32}}; break;
    case kQ4_1: spec = {{S::Byte, 2}, {S::Half, 32}, {S::Half, 32}}; break;
    case kQ8_0: spec = {{S::Char, 1}, {S::Half, 32}}; break;
    case kQ4_K: spec = {{S::Byte, 2}, {S::Half, 256}, {S::Half, 256}, {S::Byte, 32}, {S::Byte, 32}}; break;
    case kQ6_K: spec = {{S::Byte, 2}, {S::Byte, 4}, {S::Char, 16}, {S::Half, 256}}; break;
    default: TORCH_CHECK(false, "unsupported GGML type ", qtype);
  }
  const int64_t block = (qtype == kQ4_K || qtype == kQ6_K) ? 256 : 32;
  TORCH_CHECK(k > 0 && k % block == 0, "K=", k, " is not a multiple of ", block);
  TORCH_CHECK(p.size() == spec.size(), "GGML type ", qtype, " has ", spec.size(), " parts, got ", p.size());
  for (size_t i = 0; i < p.size(); ++i) {
    const int64_t cols = k / spec[i].per_row_div;
    TORCH_CHECK(p[i].device().is_cpu() && p[i].scalar_type() == spec[i].dtype && p[i].dim() == 2 &&
                    p[i].size(0) == n && p[i].size(1) == cols && p[i].is_contiguous(),
                "part ", i, " of GGML type ", qtype, ": expected contiguous (", n, ", ", cols, ") ",
                spec[i].dtype, ", got ", p[i].sizes(), " ", p[i].scalar_type());
  }
  switch (qtype) {
    case kQ4_0: fn(Q4_0(p, k)); break;
    case kQ4_1: fn(Q4_1(p, k)); break;
    case kQ8_0: fn(Q8_0(p, k)); break;
    case kQ4_K: fn(Q4_K(p, k)); break;
    default: fn(Q6_K(p, k)); break;
  }
}

}  // namespace shoal_quant
