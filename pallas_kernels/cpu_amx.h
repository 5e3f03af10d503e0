// AMX (tile) support shared by the native CPU kernels that use it (the matmul's GEMM and the
// attention's bf16 path): whether this CPU and this process may use the tiles.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AMX_TILE__) && \
    defined(__AMX_BF16__)
#define JAXLLM_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

// Linux hands a process the AMX tile state only on request (once; then every thread has it).
// Refused, the kernels run their AVX-512 paths (whose bits differ from AMX's), logged once per
// kernel library.
static bool AmxAllowed() {
  static const bool allowed = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;  // ARCH_REQ_XCOMP_PERM
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0) return true;
    std::fprintf(stderr, "jaxllm kernels: AMX refused (%s); bf16 runs the AVX-512 paths, whose "
                 "bits differ from AMX's\n", std::strerror(errno));
    return false;
  }();
  return allowed;
}

// The tile intrinsics are asm that does not tell the compiler which memory they read (the
// config past its first 8 bytes, a tile's rows): stores before them must not move past them.
static inline void CompilerFence() { asm volatile("" ::: "memory"); }
#endif
