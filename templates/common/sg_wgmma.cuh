// Hopper's warpgroup tensor cores (wgmma, sm_90a): shared-memory descriptors for the
// 128-byte swizzle (the layout of the stage buffers every layout's loaders fill), fences,
// commit and wait, and the store of wgmma accumulators through sg_store.cuh.
#pragma once
#include "sg_store.cuh"

namespace sg {

// Shared-memory matrix descriptor: start address, stride of 1024 bytes between groups of
// 8 rows, 128-byte swizzle. The leading offset is unused for swizzled K-major operands.
__device__ __forceinline__ u64 sw128_descriptor(u32 addr) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(1) << 16) |
         (static_cast<u64>(1024 >> 4) << 32) | (static_cast<u64>(1) << 62);
}

// The same swizzle for an MN-major (transposed) operand: rows of 128 bytes hold 64 elements
// of M (or N), one row per k; `chunk_bytes` apart are the next 64 of M, 8 rows (1024 bytes)
// apart the next 8 of k.
__device__ __forceinline__ u64 sw128_mn_descriptor(u32 addr, int chunk_bytes) {
  return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(chunk_bytes >> 4) << 16) |
         (static_cast<u64>(1024 >> 4) << 32) | (static_cast<u64>(1) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// cp.async writes through the generic proxy; wgmma reads through the async proxy.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving accumulator reads/writes across in-flight wgmmas.
template <int N>
__device__ __forceinline__ void pin(float (&acc)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

template <int N>
__device__ __forceinline__ void pin(int (&acc)[N]) {  // int8 products' s32 accumulators
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(acc[i])::"memory");
}

// wgmma's accumulators: per m64 tile, warp w of the group holds rows 16w..16w+15, laid
// out per n8 column tile exactly like mma.sync's m16n8 accumulators. row0: the group's first row.
// CLEAR zeroes each accumulator as soon as it is stored (for the next tile; doing it in a
// separate loop afterwards keeps all of them live at once and spills).
template <class Mma, int BM, bool CLEAR, class Epi, int SUB, class Elem>
__device__ __forceinline__ void store_wgmma_tile(float (&acc)[SUB][BM / 2], const Elem* bias, Elem* y,
                                                 int row0, int n0, int M, int N) {
  using Store = TileStore<Mma, Elem, Epi>;
  const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
#pragma unroll
  for (int sub = 0; sub < SUB; ++sub) {
    const int row = row0 + sub * 64 + warp * 16 + (lane >> 2);
    if constexpr (Epi::kGated) {  // n8 tiles 2p (gate) and 2p + 1 (up)
#pragma unroll
      for (int j = 0; j < BM / 8; j += 2) {
        Store::m16n8_gated(&acc[sub][4 * j], &acc[sub][4 * j + 4], bias, y, row, n0 + 8 * j + 2 * (lane & 3), M, N);
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (CLEAR) acc[sub][4 * j + i] = 0.f;
      }
    } else if constexpr (BM >= 32) {  // groups of 4 n8 tiles: 16-byte stores
#pragma unroll
      for (int q = 0; q < BM / 32; ++q) {
        float* const c[4] = {&acc[sub][16 * q], &acc[sub][16 * q + 4], &acc[sub][16 * q + 8], &acc[sub][16 * q + 12]};
        Store::m16n32(c, bias, y, row, n0 + 32 * q, M, N);
#pragma unroll
        for (int i = 0; i < 16; ++i)
          if (CLEAR) acc[sub][16 * q + i] = 0.f;
      }
    } else {
#pragma unroll
      for (int j = 0; j < BM / 8; ++j) {
        float* c = &acc[sub][4 * j];
        Store::m16n8(c, bias, y, row, n0 + 8 * j + 2 * (lane & 3), M, N);
        if (CLEAR) c[0] = c[1] = c[2] = c[3] = 0.f;
      }
    }
  }
}

}  // namespace sg
