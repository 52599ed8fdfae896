// Hopper's asynchronous data movement: mbarriers and TMA tensor copies (sm_90).
#pragma once
#include "sg_mma.cuh"

namespace sg {

// The driver's CUtensorMap is 128 opaque bytes, 64-byte aligned; cuda.h is not available
// to NVRTC, so the kernels take this stand-in by value as a __grid_constant__ parameter.
struct alignas(64) TensorMap { unsigned long long opaque[16]; };

__device__ __forceinline__ void mbar_init(u32 bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}

__device__ __forceinline__ void mbar_expect_bytes(u32 bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// Spin until the barrier's phase with this parity has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, int parity) {
  u32 done;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

// 2-D tile copy global -> shared; completes `bytes` on the barrier. Boxes reaching past the
// tensor's edge are zero-filled and still count in full.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int inner, int outer, u32 bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
               " [%0], [%1, {%2, %3}], [%4];\n"
               ::"r"(dst), "l"(map), "r"(inner), "r"(outer), "r"(bar) : "memory");
}

__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

}  // namespace sg
