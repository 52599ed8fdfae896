// Split K finished inside the kernel. Each split of an output tile writes its float32 partial
// sums to its own slice of a workspace (split s at sums + s * M * N); the split that arrives
// last at a tile (one counter per tile) adds the slices in split order - the same additions
// in the same order whichever split ran first, so Y's bits do not depend on timing - adds the
// bias, rounds into Y and puts the counter back to zero. Every split writes its whole slice
// before it counts itself in, so the slices need no zeroing: only the counters (a buffer of
// their own) are zeros between launches. A call is then one launch: no memset before it and
// no finishing pass after it (each costs the host as much as the launch itself).
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

  // This block's split's partial sum of output (t, f) (blockIdx.z: the split), written
  // through to L2 (__stcg), where the last split reads it.
  __device__ static void put(float* sums, int t, int f, int M, int N, float v) {
    __stcg(sums + (long long)blockIdx.z * M * N + (long long)t * N + f, v);
  }

  // Output (t, f)'s splits added in split order, read from L2 (__ldcg: L1 is not coherent).
  // Nothing is written here, so the loads of several splits are in flight at once.
  __device__ static float total(const float* sums, int t, int f, int M, int N) {
    const float* sum = sums + (long long)t * N + f;
    const long long slice = (long long)M * N;
    float acc = 0.f;
#pragma unroll 4
    for (int s = 0; s < (int)gridDim.z; ++s) acc += __ldcg(sum + s * slice);
    return acc;
  }

  // Four neighbouring outputs (t, f..f+3) at once: one 16-byte load per split (N and f a
  // multiple of 4), each output's splits still added in split order.
  __device__ static float4 total4(const float* sums, int t, int f, int M, int N) {
    const float4* sum = reinterpret_cast<const float4*>(sums + (long long)t * N + f);
    const long long slice = (long long)M * N / 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
    for (int s = 0; s < (int)gridDim.z; ++s) {
      const float4 v = __ldcg(sum + s * slice);
      acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
    }
    return acc;
  }

  // The last split: Y[t, f] = out(total(t, f) + bias(f)) over tokens t0.. and features f0..
  // of the tile (features fastest: whole rows of each slice per warp), four features a thread
  // (fewer loads in flight for the same bytes: this loop is the launch's tail); then the
  // counter is zero too. N, f0 and `features` are multiples of 4 (2:4 weights have rows in 16s,
  // tiles start at multiples of 64).
  template <class Elem, class Bias, class Out>
  __device__ static void finish(float* sums, int* count, Elem* y, int t0, int tokens, int f0, int features,
                                int M, int N, Bias bias, Out out) {
    const int quads = features / 4;
    for (int i = threadIdx.x % GROUP; i < tokens * quads; i += GROUP) {
      const int t = t0 + i / quads, f = f0 + 4 * (i % quads);
      if (t >= M || f >= N) continue;
      const float4 v = total4(sums, t, f, M, N);
      Elem* row = y + (long long)t * N + f;
      row[0] = out(v.x + bias(f)), row[1] = out(v.y + bias(f + 1));
      row[2] = out(v.z + bias(f + 2)), row[3] = out(v.w + bias(f + 3));
    }
    if (threadIdx.x % GROUP == 0) *count = 0;
  }

  // Gated (sg_epilogue.cuh): Y (N / 2 columns) gets out(gate, up) of the totals at fused
  // features f (f % 16 < 8) and f + 8, each with its bias.
  template <class Elem, class Bias, class Out>
  __device__ static void finish_gated(float* sums, int* count, Elem* y, int t0, int tokens, int f0, int features,
                                      int M, int N, Bias bias, Out out) {
    const int outputs = features / 2;
    for (int i = threadIdx.x % GROUP; i < tokens * outputs; i += GROUP) {
      const int t = t0 + i / outputs, o = i % outputs, f = f0 + 16 * (o / 8) + o % 8;
      if (t < M && f < N)
        y[(long long)t * (N / 2) + f / 16 * 8 + f % 8] =
            out(total(sums, t, f, M, N) + bias(f), total(sums, t, f + 8, M, N) + bias(f + 8));
    }
    if (threadIdx.x % GROUP == 0) *count = 0;
  }
};

}  // namespace sg
