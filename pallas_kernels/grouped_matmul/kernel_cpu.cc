// Grouped matmul for XLA:CPU (the CPU counterpart of megablox `gmm`), called through the XLA FFI:
// rows sorted by group, y[r] = x[r] @ W[layer * G + g] for the rows r of group g (group_sizes[g]
// consecutive rows, in order), rows past the groups zero. W is the matmul's packed weights
// (`pack` in matmul/kernel_cpu.py) with the G experts of each layer stacked on the leading axis,
// read in place; x f32, or bf16 with bf16 W; y f32 or bf16.
//
// Each group's rows run the matmul's own paths (matmul/kernel_cpu_core.h) against its expert:
// only the routed FLOPs, only the experts that have rows are read, and every element is the
// matmul's one chain down K (FMAs, or bf16 dot products: AMX tiles or vdpbf16ps), so a row's
// bits depend neither on M nor on the other groups (batch invariance). Each group's columns
// are split over the threads, as the matmul's are.
#include "matmul/kernel_cpu_core.h"

// kGated: y [M, N] = silu(x @ W[:, :N]) * (x @ W[:, N:]) of W's 2 N columns (`Out::gated`).
template <bool kGated>
static ffi::Error GroupedMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                    ffi::Buffer<ffi::S32> group_sizes,
                                    ffi::Buffer<ffi::S32> layer,
                                    ffi::Result<ffi::AnyBuffer> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 4 || yd.size() != 2 || group_sizes.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("grouped matmul: ranks");
  const int64_t M = xd[0], K = xd[1], N = yd[1], G = group_sizes.dimensions()[0];
  const int64_t Nw = kGated ? 2 * N : N;  // W's columns
  if (yd[0] != M) return ffi::Error::InvalidArgument("grouped matmul: y rows differ from x rows");
  const bool f32_w = w.element_type() == ffi::F32;
  if (!f32_w && w.element_type() != ffi::BF16 && w.element_type() != ffi::U16)
    return ffi::Error::InvalidArgument("grouped matmul: weights must be f32, bf16 or uint16");
  if (f32_w ? wd[2] != K || wd[3] != kNr : wd[2] != (K + 1) / 2 || wd[3] != 2 * kNr)
    return ffi::Error::InvalidArgument("grouped matmul: K differs");
  if (wd[1] != (Nw + kNr - 1) / kNr)
    return ffi::Error::InvalidArgument("grouped matmul: N differs");
  const int32_t l = layer.typed_data()[0];
  if (l < 0 || (l + 1) * G > wd[0])
    return ffi::Error::InvalidArgument("grouped matmul: layer out of range");
  const int32_t* sizes = group_sizes.typed_data();
  int64_t rows = 0;
  for (int64_t g = 0; g < G; ++g) {
    if (sizes[g] < 0) return ffi::Error::InvalidArgument("grouped matmul: negative group size");
    rows += sizes[g];
  }
  if (rows > M) return ffi::Error::InvalidArgument("grouped matmul: groups exceed x's rows");
  const bool bf16_x = x.element_type() == ffi::BF16;
  if (!bf16_x && x.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("grouped matmul: x must be f32 or bf16");
  if (bf16_x && f32_w)
    return ffi::Error::InvalidArgument("grouped matmul: bf16 x needs bf16 weights");
  Out out;
  out.N = N, out.gated = kGated;
  if (y->element_type() == ffi::BF16) {
    out.yb = static_cast<uint16_t*>(y->untyped_data());
    std::memset(out.yb + rows * N, 0, sizeof(uint16_t) * (M - rows) * N);
  } else if (y->element_type() == ffi::F32) {
    out.y = y->typed_data<float>();
    std::memset(out.y + rows * N, 0, sizeof(float) * (M - rows) * N);
  } else {
    return ffi::Error::InvalidArgument("grouped matmul: y must be f32 or bf16");
  }
  const int64_t expert_len = wd[1] * wd[2] * wd[3];  // values per expert
  // body(g, r0, m): group g, its rows [r0, r0 + m), non-empty; out_at(r0): out from row r0.
  auto out_at = [&](int64_t r0) {
    Out o = out;
    if (o.y != nullptr) o.y += r0 * N;
    if (o.yb != nullptr) o.yb += r0 * N;
    return o;
  };
  auto each_group = [&](const auto& body) {
    for (int64_t g = 0, r0 = 0; g < G; r0 += sizes[g++])
      if (sizes[g] > 0) body(l * G + g, r0, sizes[g]);
  };
  auto run = [&](const float* xf, const auto* w0) {
    each_group([&](int64_t e, int64_t r0, int64_t m) {
      RowsThrough(pool, xf + r0 * K, m, K, Nw, w0 + e * expert_len, out_at(r0));
    });
  };
  if (f32_w) {
    run(x.typed_data<float>(), static_cast<const float*>(w.untyped_data()));
    return ffi::Error::Success();
  }
  const uint16_t* w0 = static_cast<const uint16_t*>(w.untyped_data());
  if (!bf16_x) {
    run(x.typed_data<float>(), w0);
    return ffi::Error::Success();
  }
  const uint16_t* xb = static_cast<const uint16_t*>(x.untyped_data());
#ifdef JAXLLM_DPBF16
  const int64_t lda = K + K % 2;  // rows of whole pairs
  std::vector<uint16_t> even;
  xb = WholePairs(xb, rows, K, even);
  each_group([&](int64_t e, int64_t r0, int64_t m) {
    BfGemm(pool, xb + r0 * lda, lda, m, K, Nw, w0 + e * expert_len, out_at(r0));
  });
#else
  std::vector<float> xf(rows * K);
  for (int64_t i = 0; i < rows * K; ++i) xf[i] = ToF32(xb[i]);
  run(xf.data(), w0);
#endif
  return ffi::Error::Success();
}

// The operands of both handlers (the gated one writes half as many columns).
static auto GroupedMatmulBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // x [M, K], sorted by group
      .Arg<ffi::AnyBuffer>()         // w [L * G, S, K', 16 | 32]
      .Arg<ffi::Buffer<ffi::S32>>()  // group sizes [G]
      .Arg<ffi::Buffer<ffi::S32>>()  // layer
      .Ret<ffi::AnyBuffer>();  // y [M, N] (gated: silu(gate) * up), f32 or bf16
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedMatmul, GroupedMatmulImpl<false>,
                              GroupedMatmulBinding());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmGroupedMatmulSilu, GroupedMatmulImpl<true>,
                              GroupedMatmulBinding());
