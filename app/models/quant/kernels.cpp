// Linear layers on GGUF-quantised weights, built on first use by app/models/quant/__init__.py:
//   quant_matmul     out (T, N) = x (T, K) @ W^T, W packed (formats.h); out may be a column
//                    slice of a wider tensor (fused q/k/v or gate/up outputs)
//   quant_embedding  the rows of W named by ids, dequantised
//
// Two regimes. A fused GEMV that reads each weight byte once per call, on int8-rounded x
// (gemv_i8.h: at any row count) or float32 x (gemv.h: few rows, decode). Many rows of
// float32 x (prefill, big batches): each thread dequantises a tile of W's rows into
// float32 scratch and hands it to at::mm, where the multiply, not the weights' bytes,
// sets the pace. bench/quant_gemv.py measures where one overtakes the other
// (kFloatGemvMaxT in formats.h).
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "formats.h"
#include "gemv.h"
#include "gemv_i8.h"
#include "matmul.h"
#include "simd.h"

namespace {
using namespace shoal_quant;
using at::Tensor;

// Rows r0..r1-1 of group g as exact floats (scale * q + off, gguf's roundings) into dst,
// one row per K floats; scale and off from F::scales(g).
template <class F>
void dequant_rows(const F& f, int64_t g, int r0, int r1, int64_t kb, const float* scale, const float* off,
                  float* dst) {
  constexpr int per = kNV / F::kSubs;
  for (int r = r0; r < r1; ++r, dst += kb * 32) {
    for (int64_t b = 0; b < kb; ++b) {
      vf q[kNV];
      f.decode(g * kG + r, b, q);
      for (int s = 0; s < F::kSubs; ++s) {
        const vf sc = vset1(scale[(b * F::kSubs + s) * kG + r]);
        for (int i = 0; i < per; ++i) {
          const int j = s * per + i;
          vstore(dst + b * 32 + j * kW, F::kOffset ? vfma(sc, q[j], vset1(off[b * kG + r])) : vmul(sc, q[j]));
        }
      }
    }
  }
}

// g0: the weight's rows start at row group g0 of f (one expert of a stacked weight).
template <class F>
void tiled(const F& f, int64_t N, int64_t K, const Tensor& xf, Tensor& out, int64_t tile_rows, int64_t g0 = 0) {
  const int64_t kb = K / 32, T = xf.size(0);
  int64_t rows = tile_rows;
  if (rows <= 0) {
    // Tiles of ~512 KiB of float32 (wider ones multiply better, narrower stay in cache),
    // in a count the threads share evenly.
    const int64_t threads = at::get_num_threads(), target = std::clamp<int64_t>((int64_t(1) << 17) / K, 16, 256);
    int64_t tiles = (N + target - 1) / target;
    tiles = (tiles + threads - 1) / threads * threads;
    rows = (N + tiles - 1) / tiles;
  }
  rows = (rows + kG - 1) / kG * kG;  // whole row groups
  const int64_t tiles = (N + rows - 1) / rows;
  const bool direct = out.scalar_type() == at::kFloat;  // else via float32, then rounded once
  // InferenceMode is thread-local: the worker threads take the caller's, or at::mm_out into
  // an inference tensor (the engine's forward runs in inference mode) is refused.
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard(inference);
    std::vector<float> scale(kb * F::kSubs * kG), off(F::kOffset ? kb * kG : 0);
    Tensor tile = at::empty({rows, K}, xf.options());
    float* w = tile.data_ptr<float>();
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * rows, r = std::min(rows, N - n0);
      for (int64_t g = n0 / kG; g * kG < n0 + r; ++g) {
        f.scales(g0 + g, scale.data(), off.data());
        dequant_rows(f, g0 + g, 0, int(std::min<int64_t>(kG, N - g * kG)), kb, scale.data(), off.data(),
                     w + (g * kG - n0) * K);
      }
      Tensor dst = direct ? out.narrow(1, n0, r) : at::empty({T, r}, xf.options());
      at::mm_out(dst, xf, tile.narrow(0, 0, r).t());
      if (!direct) out.narrow(1, n0, r).copy_(dst);
    }
  });
}

void check_float(const Tensor& t, const char* what) {
  const auto s = t.scalar_type();
  TORCH_CHECK(t.device().is_cpu() && (s == at::kFloat || s == at::kBFloat16 || s == at::kHalf), what,
              " must be a float32, bfloat16 or float16 CPU tensor, got ", s);
}


// x rounded to int8 per 32-block and back to float (quantize_x.h's rounding): tiles forced
// on int8 activations (mode 2, benchmarks) compute what the int8 GEMV computes, up to
// summation order.
Tensor round_like_int8(const Tensor& xf) {
  const int64_t T = xf.size(0), K = xf.size(1);
  Tensor rounded = at::empty_like(xf);
  const float* x = xf.data_ptr<float>();
  float* y = rounded.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    int8_t q[32];
    int32_t sum;
    for (int64_t t = begin; t < end; ++t)
      for (int64_t i = 0; i < K; i += 32) {
        const float d = quantize_block(x + t * K + i, q, false, &sum);
        for (int j = 0; j < 32; ++j) y[t * K + i + j] = float(q[j]) * d;
      }
  });
  return rounded;
}

}  // namespace

namespace shoal_quant {

// out = x @ W^T with x (T, K) float32 and contiguous, out (T, N) with unit column stride.
// mode: 0 picks (int8 x: the GEMV; float x: the GEMV up to kFloatGemvMaxT rows), 1 forces
// the GEMV, 2 forces tiles.
// activations: kAuto rounds x to int8 per block (tiles: round_like_int8) where the
// format has an integer kernel (gemv_i8.h: faster, llama.cpp's accuracy), kFloat keeps
// float32 x (exact but for summation order), kInt8 insists on int8.
void matmul_into(const Tensor& xf, int64_t qtype, const std::vector<Tensor>& parts, int64_t n, int64_t k,
                 Tensor& out, int64_t mode, int64_t tile_rows, int64_t activations) {
  const int64_t T = xf.size(0);
  with_format(qtype, parts, n, k, [&](const auto& f) {
    if (T == 0 || n == 0) return;
    using F = std::decay_t<decltype(f)>;
    constexpr bool has_ints = F::kInts != Ints::kNone;
    const bool int8 = has_ints && activations != kFloat;
    // int8 activations take the GEMV at any T in auto mode: a row's product is then the
    // same bits however many rows share the call (batch invariance), and at 512 rows it
    // keeps pace with the tiles.
    if (mode == 2 || (mode == 0 && !int8 && T > F::kFloatGemvMaxT)) {
      tiled(f, n, k, int8 ? round_like_int8(xf) : xf, out, tile_rows);
      return;
    }
    TORCH_CHECK(has_ints || activations != kInt8, "GGML type ", qtype, " has no int8-activation kernel");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "quant_matmul", [&] {
      if constexpr (has_ints) {
        if (activations != kFloat) {
          // Rows of x a chunk at a time: a chunk's int8 rows (2 bytes a weight for the
          // 4-bit types) stay in L2 while every row group streams past them. A row's
          // arithmetic does not depend on its chunk.
          constexpr int64_t kRowChunk = 64;
          for (int64_t t0 = 0; t0 < T; t0 += kRowChunk)
            gemv_i8(f, n, k, xf.data_ptr<float>() + t0 * k, std::min(kRowChunk, T - t0),
                    out.data_ptr<scalar_t>() + t0 * out.stride(0), out.stride(0));
          return;
        }
      }
      gemv(f, n, k, xf.data_ptr<float>(), T, out.data_ptr<scalar_t>(), out.stride(0));
    });
  });
}

// Experts stacked in one packed weight of n = E * m rows (expert e's rows e*m..e*m+m-1,
// m a multiple of kG): x's rows starts[e]..starts[e+1]-1 (grouped by expert) times expert
// e, into out (R, m). One call for every expert: the GEMV's threads split all the experts'
// row groups together. Each row's arithmetic is quant_matmul's for that row and expert
// (the same bits: int8 activations round per row, and the float GEMV sums per row too);
// float32 x past the format's kFloatGemvMaxT rows of one expert takes the tiles as
// quant_matmul does.
void grouped_matmul_into(const Tensor& xf, int64_t qtype, const std::vector<Tensor>& parts, int64_t n, int64_t k,
                         const std::vector<int64_t>& starts, Tensor& out, int64_t activations) {
  const int64_t E = int64_t(starts.size()) - 1, R = xf.size(0), m = n / E;
  with_format(qtype, parts, n, k, [&](const auto& f) {
    using F = std::decay_t<decltype(f)>;
    constexpr bool has_ints = F::kInts != Ints::kNone;
    TORCH_CHECK(has_ints || activations != kInt8, "GGML type ", qtype, " has no int8-activation kernel");
    const bool int8 = has_ints && activations != kFloat;
    std::vector<Segment> gemv_segments;
    for (int64_t e = 0; e < E; ++e) {
      const int64_t t0 = starts[e], t1 = starts[e + 1];
      if (t0 == t1) continue;
      if (int8 || t1 - t0 <= F::kFloatGemvMaxT) {
        gemv_segments.push_back({t0, t1, e * m / kG, (e + 1) * m / kG});
      } else {  // many rows of float32 x: dequantised tiles and at::mm
        Tensor rows = out.narrow(0, t0, t1 - t0);
        tiled(f, m, k, xf.narrow(0, t0, t1 - t0), rows, 0, e * m / kG);
      }
    }
    if (gemv_segments.empty()) return;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "quant_grouped_matmul", [&] {
      if constexpr (has_ints) {
        if (int8) {
          gemv_i8(f, n, k, xf.data_ptr<float>(), R, out.data_ptr<scalar_t>(), out.stride(0), gemv_segments);
          return;
        }
      }
      gemv(f, n, k, xf.data_ptr<float>(), R, out.data_ptr<scalar_t>(), out.stride(0), gemv_segments);
    });
  });
}

}  // namespace shoal_quant

namespace {

void quant_grouped_matmul(const Tensor& x, int64_t qtype, const std::vector<Tensor>& parts, int64_t n, int64_t k,
                          const std::vector<int64_t>& starts, Tensor out, int64_t activations) {
  TORCH_CHECK(activations >= kAuto && activations <= kInt8, "activations must be 0 (auto), 1 (float) or 2 (int8)");
  check_float(x, "x");
  check_float(out, "out");
  const int64_t E = int64_t(starts.size()) - 1, R = x.size(0);
  TORCH_CHECK(E >= 1 && n % E == 0 && (n / E) % kG == 0, "n=", n, " is not ", E, " experts of whole row groups");
  TORCH_CHECK(starts.front() == 0 && starts.back() == R, "starts must run from 0 to x's ", R, " rows");
  for (int64_t e = 0; e < E; ++e) TORCH_CHECK(starts[e] <= starts[e + 1], "starts must not decrease");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be (R, ", k, "), got ", x.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == R && out.size(1) == n / E && out.stride(1) == 1, "out must be (", R,
              ", ", n / E, ") with unit column stride, got ", out.sizes());
  grouped_matmul_into(x.to(at::kFloat).contiguous(), qtype, parts, n, k, starts, out, activations);
}

void quant_matmul(const Tensor& x, int64_t qtype, const std::vector<Tensor>& parts, int64_t n, int64_t k,
                  Tensor out, int64_t mode, int64_t tile_rows, int64_t activations) {
  TORCH_CHECK(activations >= kAuto && activations <= kInt8, "activations must be 0 (auto), 1 (float) or 2 (int8)");
  check_float(x, "x");
  check_float(out, "out");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "x must be (T, ", k, "), got ", x.sizes());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n && out.stride(1) == 1,
              "out must be (", x.size(0), ", ", n, ") with unit column stride, got ", out.sizes(), " strides ",
              out.strides());
  const Tensor xf = x.to(at::kFloat).contiguous();  // bf16 -> float is exact
  matmul_into(xf, qtype, parts, n, k, out, mode, tile_rows, activations);
}

void quant_embedding(const Tensor& ids, int64_t qtype, const std::vector<Tensor>& parts, int64_t n, int64_t k,
                     Tensor out) {
  check_float(out, "out");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be a 1-d int64 tensor");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == ids.size(0) && out.size(1) == k && out.stride(1) == 1,
              "out must be (", ids.size(0), ", ", k, ") with unit column stride, got ", out.sizes());
  const Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.size(0); ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "token id ", id[i], " outside the ", n, " rows");
  with_format(qtype, parts, n, k, [&](const auto& f) {
    using F = std::decay_t<decltype(f)>;
    const int64_t kb = k / 32;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "quant_embedding", [&] {
      at::parallel_for(0, idc.size(0), 16, [&](int64_t begin, int64_t end) {
        std::vector<float> scale(kb * F::kSubs * kG), off(F::kOffset ? kb * kG : 0), row(k);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t g = id[i] / kG;
          const int r = int(id[i] % kG);
          f.scales(g, scale.data(), off.data());
          dequant_rows(f, g, r, r + 1, kb, scale.data(), off.data(), row.data());
          scalar_t* dst = out.data_ptr<scalar_t>() + i * out.stride(0);
          for (int64_t j = 0; j < k; ++j) dst[j] = static_cast<scalar_t>(row[j]);
        }
      });
    });
  });
}

}  // namespace

// The products run without the GIL (see cpu_kernels/kernels.cpp: streaming threads need it).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("quant_matmul", &quant_matmul, "out = x @ W^T for a packed GGUF-quantised W", pybind11::arg("x"),
        pybind11::arg("qtype"), pybind11::arg("parts"), pybind11::arg("n"), pybind11::arg("k"),
        pybind11::arg("out"), pybind11::arg("mode") = 0, pybind11::arg("tile_rows") = 0,
        pybind11::arg("activations") = 0, no_gil());
  m.def("quant_grouped_matmul", &quant_grouped_matmul,
        "out rows of each expert = x rows @ W_e^T, experts stacked in one packed weight", no_gil());
  m.def("quant_embedding", &quant_embedding, "rows of a packed GGUF-quantised W, dequantised", no_gil());
  m.def("isa", [] { return std::string(kIsa); }, "which vector build this is: avx512, avx2 or portable");
  shoal_quant::bind_decode_layer(m);
  shoal_quant::bind_moe_experts(m);
}
