// Split K finished inside the kernel. The splits of an output tile add their float32 partial
// sums into a workspace that is all zeros between launches; the split that arrives last at a
// tile (one counter per tile) adds the bias, rounds the sums into Y and puts zeros back in
// the workspace and its counter. A call is then one launch: no memset before it and no
// finishing pass after it (each costs the host as much as the launch itself).
//
// A group is GROUP threads that own one tile: a whole block (barrier 0, __syncthreads), or a
// warpgroup with a named barrier of its own.
#pragma once
#include "sg_mma.cuh"

namespace sg {

__device__ __forceinline__ void group_sync(int barrier, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(barrier), "r"(threads) : "memory");
}

template <int GROUP>
struct SplitK {
  // Called by every thread of the group after its atomics into the workspace. True in every
  // thread of the group whose split is the tile's last to arrive: every other split's sums
  // are then visible to it. `flag`: a shared-memory word the group may use.
  __device__ static bool last_to_arrive(int* count, int splits, u32 flag, int barrier) {
    __threadfence();  // this thread's sums reach the device before the count says they did
    group_sync(barrier, GROUP);
    if (threadIdx.x % GROUP == 0) {
      const int before = atomicAdd(count, 1);
      __threadfence();  // and the other splits' sums are seen after their counts
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(flag), "r"(before == splits - 1 ? 1 : 0) : "memory");
    }
    group_sync(barrier, GROUP);
    u32 last;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(last) : "r"(flag) : "memory");
    return last != 0;
  }

  // The last split: Y[t, f] = out(sums[t, f] + bias(f)) over tokens t0.. and features f0..
  // of the tile (features fastest: whole rows of the workspace per warp), zeroing the sums
  // and the counter as it goes. The sums are read from L2 (__ldcg): L1 is not coherent.
  template <class Elem, class Bias, class Out>
  __device__ static void finish(float* sums, int* count, Elem* y, int t0, int tokens, int f0, int features, int M,
                                int N, Bias bias, Out out) {
    for (int i = threadIdx.x % GROUP; i < tokens * features; i += GROUP) {
      const int t = t0 + i / features, f = f0 + i % features;
      if (t >= M || f >= N) continue;
      float* sum = sums + (long long)t * N + f;
      y[(long long)t * N + f] = out(__ldcg(sum) + bias(f));
      __stcg(sum, 0.f);
    }
    if (threadIdx.x % GROUP == 0) *count = 0;
  }

  // Gated (sg_epilogue.cuh): Y (N / 2 columns) gets out(gate, up) of the sums at fused
  // features f (f % 16 < 8) and f + 8, each with its bias; both sums are zeroed after.
  template <class Elem, class Bias, class Out>
  __device__ static void finish_gated(float* sums, int* count, Elem* y, int t0, int tokens, int f0, int features,
                                      int M, int N, Bias bias, Out out) {
    const int outputs = features / 2;
    for (int i = threadIdx.x % GROUP; i < tokens * outputs; i += GROUP) {
      const int t = t0 + i / outputs, o = i % outputs, f = f0 + 16 * (o / 8) + o % 8;
      if (t >= M || f >= N) continue;
      float* gate = sums + (long long)t * N + f;
      y[(long long)t * (N / 2) + f / 16 * 8 + f % 8] = out(__ldcg(gate) + bias(f), __ldcg(gate + 8) + bias(f + 8));
      __stcg(gate, 0.f);
      __stcg(gate + 8, 0.f);
    }
    if (threadIdx.x % GROUP == 0) *count = 0;
  }
};

}  // namespace sg
