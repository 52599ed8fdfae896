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

// A ring of `stages` buffers, by one thread: full[i] completes on the producer's arrival
// (and the copies' bytes), empty[i] on `releases` arrivals. The fence makes the barriers
// visible to the copy engine and the cluster; the caller then syncs the block (or cluster).
__device__ __forceinline__ void init_ring(u32 bars, int stages, int releases) {
  for (int i = 0; i < stages; ++i) {
    mbar_init(bars + 8 * i, 1);
    mbar_init(bars + 8 * (stages + i), releases);
  }
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_expect_bytes(u32 bar, int bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Bytes the barrier's current phase also waits for, without an arrival (someone else arrives).
__device__ __forceinline__ void mbar_expect_tx(u32 bar, int bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
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

// An L2 eviction policy for the copies below: "evict_last" for data that should outlast
// the rest in L2.
__device__ __forceinline__ u64 l2_evict_last() {
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// tma_load_2d with an L2 eviction policy.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TensorMap* map, int inner, int outer, u32 bar, u64 policy) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3}], [%4], %5;\n"
               ::"r"(dst), "l"(map), "r"(inner), "r"(outer), "r"(bar), "l"(policy) : "memory");
}

// The same, with the box written to every block of the cluster in `cta_mask`, at dst's
// offset in each, completing the bytes on each block's barrier at bar's offset.
__device__ __forceinline__ void tma_load_2d_multicast(u32 dst, const TensorMap* map, int inner, int outer, u32 bar,
                                                      unsigned short cta_mask) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
               " [%0], [%1, {%2, %3}], [%4], %5;\n"
               ::"r"(dst), "l"(map), "r"(inner), "r"(outer), "r"(bar), "h"(cta_mask) : "memory");
}

// Arrive on the barrier at `bar`'s offset in block `cta` of the cluster. CTA scope on
// purpose: .release.cluster makes ptxas put MEMBAR.ALL.GPU before every arrive, which waits
// for the wgmmas in flight and halved the sp24 kernel's speed (H200). The arrivals here only
// say "done reading", and wgmma.wait_group has already made that so.
__device__ __forceinline__ void mbar_arrive_cluster(u32 bar, u32 cta) {
  asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
               "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(cta) : "memory");
}

__device__ __forceinline__ u32 cluster_rank() {
  u32 rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}

// Every thread of every block of the cluster.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// setmaxnreg moves registers within a block's allocation: ptxas gives a kernel that uses it
// the most its launch bounds allow (64K / THREADS, in 8s). The producer warpgroup keeps 40
// a thread, the consumers take the rest (at most 240); asking for more than the pool holds
// would hang. For kernels whose consumers hold 128 accumulators a thread.
template <int THREADS>
struct RegisterSplit {
  static constexpr int POOL = (65536 / THREADS) / 8 * 8 * THREADS;
  static constexpr int SHARE = (POOL - 128 * 40) / (THREADS - 128) / 8 * 8;
  static constexpr int CONSUMER = SHARE > 240 ? 240 : SHARE;
  __device__ static void producer() { asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n"); }
  __device__ static void consumer() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(CONSUMER)); }
};

__device__ __forceinline__ void tma_prefetch_map(const TensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
}

// init_ring, and the descriptors the block will copy through prefetched: a TMA kernel's start.
template <class... Maps>
__device__ __forceinline__ void start_ring(u32 bars, int stages, int releases, const Maps*... maps) {
  init_ring(bars, stages, releases);
  (tma_prefetch_map(maps), ...);
}

}  // namespace sg
