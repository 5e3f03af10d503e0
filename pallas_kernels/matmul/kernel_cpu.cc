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
// two f32 rows. Up to 48 rows (16 with AVX-512) the tasks stream whole strips (one sequential read each, for all
// the rows: 3+ in register blocks of 5-6 rows against a K-chunk held in L1); more rows run the
// register-blocked `Gemm`, on f32 strips (bf16 ones converted a tile at a time): `RowsThrough`
// in the core. Both sum every element in the same
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

#include "matmul/kernel_cpu_quant.h"  // QRowsThrough: the paths of quantized weights

// kGated as MatmulImpl's. y [M, N] = x [M, K] @ ((q - zero) * scale)[layer] (`pack_quantized`):
// q int8 strips by twos [L, ceil(S / 2), ceil(K / 2), 64] or int4 by fours [L, ceil(S / 4),
// ceil(K / 4), 128] uint8, scale and zero [L, S, G, 16] f32 (zero empty: symmetric), G groups of
// whole loads of q (any K for G = 1).
template <bool kGated>
static ffi::Error QuantMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer q,
                                  ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> zero,
                                  ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> y) {
  auto bad = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("quantized matmul: ") + what);
  };
  auto xd = x.dimensions(), qd = q.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || qd.size() != 4 || sd.size() != 4 || yd.size() != 2) return bad("ranks");
  const int64_t M = xd[0], K = xd[1], L = qd[0], S = sd[1], G = sd[2];
  const int64_t N = kGated ? 2 * yd[1] : yd[1];
  if (yd[0] != M) return bad("result rows differ from x rows");
  const bool int4 = q.element_type() == ffi::U8;
  if (!int4 && q.element_type() != ffi::S8) return bad("q must be int8, or uint8 int4 pairs");
  const int64_t P = int4 ? (K + 3) / 4 * 2 : (K + 1) / 2;  // pairs of rows, padded
  const int64_t group = int4 ? kGroup<uint8_t> : kGroup<int8_t>;  // strips stored together
  if (qd[2] != (int4 ? P / 2 : P) || qd[3] != group * kQLoad) return bad("K differs");
  if (S != (N + kNr - 1) / kNr || qd[1] != (S + group - 1) / group) return bad("N differs");
  if (sd[0] != L || sd[3] != kNr || G < 1 || K % G || (G > 1 && K / G % (int4 ? 4 : 2)))
    return bad("scales must be [L, S, G, 16], G groups of whole loads of q");
  const bool zp = zero.element_count() != 0;
  if (zp && zero.element_count() != scale.element_count()) return bad("zero points differ");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || l >= L) return bad("layer out of range");
  const bool bf16_x = x.element_type() == ffi::BF16;
  if (!bf16_x && x.element_type() != ffi::F32) return bad("x must be f32 or bf16");
  Out out;
  out.N = yd[1], out.gated = kGated;
  if (y->element_type() == ffi::BF16) out.yb = static_cast<uint16_t*>(y->untyped_data());
  else if (y->element_type() == ffi::F32) out.y = y->typed_data<float>();
  else return bad("y must be f32 or bf16");
  if (M == 0) return ffi::Error::Success();
  QLayer w;
  w.group = qd[2] * qd[3];
  w.q = static_cast<const int8_t*>(q.untyped_data()) + l * qd[1] * w.group;
  if (l + 1 < L) w.after = static_cast<const int8_t*>(w.q) + qd[1] * w.group;
  w.scale = scale.typed_data() + l * S * G * kNr;
  w.zero = zp ? zero.typed_data() + l * S * G * kNr : nullptr;
  w.P = P, w.G = G, w.gp = G == 1 ? P : K / G / 2;
  // x as panels of whole pairs (bf16 against the bf16 dot product, else f32) and its group
  // sums, in the calling thread's buffers (fresh ones cost page faults every call).
  thread_local std::vector<float> xs;
  xs.resize(zp ? M * G : 0);
  auto run = [&](auto bf, const auto* x0) {
    constexpr bool kBf = decltype(bf)::value;
    thread_local std::vector<QTile<kBf>> panels;
    panels.resize(M * 2 * P);
    Panels(pool, x0, M, K, P, panels.data());
    if (zp) GroupSums(x0, K, M, G, K / G, xs.data());
    if (int4) QRowsThrough<kBf, uint8_t>(pool, panels.data(), xs.data(), M, N, w, out);
    else QRowsThrough<kBf, int8_t>(pool, panels.data(), xs.data(), M, N, w, out);
  };
  const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
#ifdef JAXLLM_DPBF16
  if (bf16_x) return run(std::true_type{}, xb), ffi::Error::Success();
#endif
  if (bf16_x) run(std::false_type{}, xb);
  else run(std::false_type{}, x.typed_data<float>());
  return ffi::Error::Success();
}

static auto QuantMatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // x [M, K], f32 or bf16
      .Arg<ffi::AnyBuffer>()         // q, packed: int8, or uint8 int4 pairs
      .Arg<ffi::Buffer<ffi::F32>>()  // scale [L, S, G, 16]
      .Arg<ffi::Buffer<ffi::F32>>()  // zero [L, S, G, 16], or empty
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Ret<ffi::AnyBuffer>();        // y [M, N] (gated: silu(gate) * up), f32 or bf16
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulQuant, QuantMatmulImpl<false>, QuantMatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmMatmulQuantSilu, QuantMatmulImpl<true>,
                              QuantMatmulBinding());
