// Writing an accumulator tile of m16n8 fragments to Y (bias, epilogue, 16-byte stores):
// shared by every layout's mma.sync and wgmma kernels.
#pragma once
#include "sg_mma.cuh"

namespace sg {

__device__ __forceinline__ u32 pick4(const u32 (&v)[4], int k) {
  return k == 0 ? v[0] : k == 1 ? v[1] : k == 2 ? v[2] : v[3];
}

// The four lanes of a quad each hold two columns of one row for each of 4 adjacent n8
// tiles. A 4x4 transpose over shuffles leaves lane t with all 8 columns of tile t: one
// 16-byte store where there were four 4-byte ones (which flooded the store queue and
// wrote half sectors to L2).
__device__ __forceinline__ void quad_transpose(const u32 (&v)[4], u32 (&w)[4]) {
  const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int src = (t - i) & 3;  // lane src sent its pair of tile t this round
    const u32 got = __shfl_sync(0xffffffffu, pick4(v, (t + i) & 3), (lane & ~3) | src);
#pragma unroll
    for (int k = 0; k < 4; ++k)
      if (k == src) w[k] = got;
  }
}

// Epilogue shared by the kernels: accumulators laid out as mma's m16n8 tiles -> Y (+ bias),
// through Epi (sg_epilogue.cuh).
template <class Mma, class Elem, class Epi = NoEpilogue>
struct TileStore {
  __device__ static float to_float(Elem v) {
    if constexpr (Mma::kIsFloat) return v; else return Mma::to_float(v);
  }
  __device__ static void pair(Elem* dst, float lo, float hi) {
    if constexpr (Mma::kIsFloat) {
      *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
    } else {
      *reinterpret_cast<u32*>(dst) = Mma::pack(lo, hi);
    }
  }
  // c: one m16n8 tile's 4 accumulators at rows m, m+8 and columns n, n+1 (n even).
  __device__ static void m16n8(const float* c, const Elem* bias, Elem* y, int m, int n, int M, int N) {
    float b0 = 0.f, b1 = 0.f;
    if (bias) { b0 = to_float(bias[n]); b1 = to_float(bias[n + 1]); }
    if (m < M) pair(y + (long long)m * N + n, Epi::act(c[0] + b0), Epi::act(c[1] + b1));
    if (m + 8 < M) pair(y + (long long)(m + 8) * N + n, Epi::act(c[2] + b0), Epi::act(c[3] + b1));
  }

  // Gated: g and u are the m16n8 tiles of fused rows n.. and n + 8.. (n % 16 < 8); Y has
  // N / 2 columns and gets Epi::gated at column Epi::out_feature(n), n + 1.
  __device__ static void m16n8_gated(const float* g, const float* u, const Elem* bias, Elem* y, int m, int n, int M,
                                     int N) {
    float b[4] = {};
    if (bias) { b[0] = to_float(bias[n]); b[1] = to_float(bias[n + 1]); b[2] = to_float(bias[n + 8]); b[3] = to_float(bias[n + 9]); }
    Elem* row = y + (long long)m * (N / 2) + Epi::out_feature(n);
    if (m < M) pair(row, Epi::gated(g[0] + b[0], u[0] + b[2]), Epi::gated(g[1] + b[1], u[1] + b[3]));
    if (m + 8 < M) pair(row + 8 * (N / 2), Epi::gated(g[2] + b[0], u[2] + b[2]), Epi::gated(g[3] + b[1], u[3] + b[3]));
  }

  // 16-bit outputs, 4 adjacent n8 tiles c[0..3] starting at column n (16-byte aligned);
  // rows m and m + 8 as in m16n8.
  __device__ static void m16n32(float* const (&c)[4], const Elem* bias, Elem* y, int m, int n, int M, int N) {
    const int t = threadIdx.x & 3;
    float b[4][2] = {};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (bias) { b[j][0] = to_float(bias[n + 8 * j + 2 * t]); b[j][1] = to_float(bias[n + 8 * j + 2 * t + 1]); }
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      u32 v[4], w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = Mma::pack(Epi::act(c[j][2 * half] + b[j][0]), Epi::act(c[j][2 * half + 1] + b[j][1]));
      quad_transpose(v, w);
      const int row = m + 8 * half;
      if (row < M) *reinterpret_cast<uint4*>(y + (long long)row * N + n + 8 * t) = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
};

}  // namespace sg
