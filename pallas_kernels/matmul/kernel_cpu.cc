// Matmul over stacked per-layer weights for XLA:CPU, called through the XLA FFI:
// y [M, N] = x [M, K] @ W[layer], W bf16 (as bf16 or its uint16 bits) or f32, read in place;
// x f32, or bf16 with bf16 W; y f32, or bf16 (the f32 sums rounded to nearest even).
//
// Why not XLA's dot: a layer scan slices (copies) each layer's weights before its dot, and XLA:CPU
// runs bf16 weights slower than f32 ones on AVX2 (3x at M = 1, ~1.4x at M = 64). Here bf16 is
// converted in registers or in cache, so it runs at f32 speed with half the bytes, or, bf16 x
// against bf16 W, on the CPU's bf16 dot product: AMX tiles (13x vdpbf16ps's rate) or vdpbf16ps.
//
// W is packed (`pack` in kernel_cpu.py): the N columns in S strips of 16, each strip contiguous,
// the last one zero-padded; f32 strips [K, 16]; bf16 strips [K / 2, 16, 2], rows in pairs (an odd
// K gets a zero row), the operand layout of vdpbf16ps, which a shift and a mask also split into
// two f32 rows. Up to 2 rows (f32 strips) or 4 (bf16) the tasks stream whole strips (one
// sequential read each); more rows run the register-blocked `Gemm`, on f32 strips (bf16 ones
// converted a tile at a time): `RowsThrough` in the core. Both sum every element in the same
// order (see `StripRows`), so a row's bits do not depend on M. bf16 x against bf16 W runs
// `BfGemm`, the bf16 dot product on the strips as they are, at every M: with AMX-BF16 the AMX
// tile GEMM `AmxGemm` (kernel_cpu_amx.h), else, with AVX512_BF16, the vdpbf16ps GEMM `DpGemm`
// (their bits differ: one of them per process); without either, the f32 paths on x converted.
#include "matmul/kernel_cpu_core.h"  // the paths: KnStream, Gemm, BfGemm, Out, RowsThrough

// x [M, K] @ W[layer] (N columns) into out, which has out_rows rows; checks the operands first.
// (Gated, out has N / 2 columns.)
static ffi::Error Matmul(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                         ffi::Buffer<ffi::S32> layer, int64_t N, int64_t out_rows,
                         const Out& out) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4) return ffi::Error::InvalidArgument("matmul: ranks");
  const int64_t M = xd[0], K = xd[1], L = wd[0], S = wd[1];
  if (out_rows != M) return ffi::Error::InvalidArgument("matmul: result rows differ from x rows");
  const bool f32_w = w.element_type() == ffi::F32;
  if (!f32_w && w.element_type() != ffi::BF16 && w.element_type() != ffi::U16)
    return ffi::Error::InvalidArgument("matmul: weights must be f32, bf16 or uint16 bf16 bits");
  if (f32_w ? wd[2] != K || wd[3] != kNr : wd[2] != (K + 1) / 2 || wd[3] != 2 * kNr)
    return ffi::Error::InvalidArgument("matmul: K differs");
  if (S != (N + kNr - 1) / kNr) return ffi::Error::InvalidArgument("matmul: N differs");
  const int64_t layer_len = S * wd[2] * wd[3];  // values per layer
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return ffi::Error::InvalidArgument("matmul: layer out of range");
  const bool bf16_x = x.element_type() == ffi::BF16;
  if (!bf16_x && x.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("matmul: x must be f32 or bf16");
  auto run = [&](const float* xf, const auto* wl) {  // wl: the layer's strips
    RowsThrough(pool, xf, M, K, N, wl, out);
  };
  if (f32_w) {
    if (bf16_x) return ffi::Error::InvalidArgument("matmul: bf16 x needs bf16 weights");
    run(x.typed_data<float>(), static_cast<const float*>(w.untyped_data()) + l * layer_len);
    return ffi::Error::Success();
  }
  const uint16_t* wl = static_cast<const uint16_t*>(w.untyped_data()) + l * layer_len;
  if (!bf16_x) {
    run(x.typed_data<float>(), wl);
    return ffi::Error::Success();
  }
  const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
#ifdef JAXLLM_DPBF16
  std::vector<uint16_t> even;
  BfGemm(pool, WholePairs(xb, M, K, even), K + K % 2, M, K, N, wl, out);
  return ffi::Error::Success();
#else
  std::vector<float> xf(M * K);
  for (int64_t i = 0; i < M * K; ++i) xf[i] = ToF32(xb[i]);
  run(xf.data(), wl);
  return ffi::Error::Success();
#endif
}

// kGated: y [M, N] = silu(x @ W[:, :N]) * (x @ W[:, N:]) of W's 2 N columns (`Out::gated`).
template <bool kGated>
static ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> y) {
  if (y->dimensions().size() != 2) return ffi::Error::InvalidArgument("matmul: ranks");
  const int64_t N = y->dimensions()[1];
  Out out;
  out.N = N, out.gated = kGated;
  if (y->element_type() == ffi::BF16)
    out.yb = static_cast<uint16_t*>(y->untyped_data());
  else if (y->element_type() == ffi::F32)
    out.y = y->typed_data<float>();
  else
    return ffi::Error::InvalidArgument("matmul: y must be f32 or bf16");
  return Matmul(pool, x, w, layer, kGated ? 2 * N : N, y->dimensions()[0], out);
}

// Greedy LM head: per row and strip of x @ W[layer] (n columns), the maximum and its first
// column; the [M, n] products are never written.
static ffi::Error MatmulArgmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                   ffi::Buffer<ffi::S32> layer,
                                   ffi::ResultBuffer<ffi::F32> best,
                                   ffi::ResultBuffer<ffi::S32> col, int64_t n) {
  Out out;
  out.best = best->typed_data(), out.col = col->typed_data();
  out.N = n, out.S = (n + kNr - 1) / kNr;
  if (best->dimensions().size() != 2 || best->dimensions()[1] != out.S ||
      col->element_count() != best->element_count())
    return ffi::Error::InvalidArgument("matmul argmax: results must be [M, strips]");
  return Matmul(pool, x, w, layer, n, best->dimensions()[0], out);
}

// The operands of both handlers (the gated one writes half as many columns).
static auto MatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // x, f32 or bf16
      .Arg<ffi::AnyBuffer>()         // w, packed
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Ret<ffi::AnyBuffer>();  // y [M, N] (gated: silu(gate) * up), f32 or bf16
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmul, MatmulImpl<false>,
                              MatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulSilu, MatmulImpl<true>,
                              MatmulBinding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulArgmax, MatmulArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()          // x, f32 or bf16
                                  .Arg<ffi::AnyBuffer>()          // w, packed
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer
                                  .Ret<ffi::Buffer<ffi::F32>>()   // per-strip maxima [M, S]
                                  .Ret<ffi::Buffer<ffi::S32>>()   // and their columns
                                  .Attr<int64_t>("n"));
