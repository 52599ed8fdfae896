// Gathering one pipeline stage of a block-sparse product into shared memory.
//
// A threadblock owns TILE_M rows of X and one block row of W (BM rows of W, BM columns of Y).
// It walks only that block row's nonzero blocks, viewed as one "compressed K" axis of length
// nnz * BK, in stages of 128 bytes per row: each stage gathers the matching columns of X and
// the slices of the W blocks into shared memory (rows of 128 bytes, 16-byte chunks swizzled
// as chunk ^ (row % 8) - the same layout wgmma calls 128-byte swizzle).
#pragma once
#include "sg_mma.cuh"

namespace sg {

template <class Elem, int TILE_M, int BM, int BK, int THREADS>
struct BsrStageLoader {
  static constexpr int CHUNK = 16 / sizeof(Elem);   // elements per 16-byte copy
  static constexpr int STAGE_K = 8 * CHUNK;          // elements of K per stage (128 bytes)
  static constexpr int X_BYTES = TILE_M * 128, STAGE_BYTES = (TILE_M + BM) * 128;
  static_assert((TILE_M * 8) % THREADS == 0, "X copy loop must divide evenly among threads");

  // Each thread always copies the same 16-byte chunk column (tid % 8) of a stage, so one
  // column index per stage and thread says where its chunks come from.
  __device__ static int chunk_k(int stage) { return stage * STAGE_K + (threadIdx.x & 7) * CHUNK; }

  // The index a stage needs is fetched one stage early (see the kernels' main loops), so
  // the copies never wait on a global load of the index.
  __device__ static int lookup_col(int stage, const int* cols, int first, int nnz) {
    const int blk = chunk_k(stage) / BK;
    return blk < nnz ? __ldg(cols + first + blk) : 0;
  }

  __device__ static int num_stages(int nnz) { return (nnz * BK + STAGE_K - 1) / STAGE_K; }

  // Copies past the row's last block, or past row M, are zero-filled: they add nothing.
  __device__ static void load(u32 smem, int stage, int col, const Elem* x, const Elem* values,
                              int first, int nnz, int m0, int M, int K) {
    const int tid = threadIdx.x, chunk = tid & 7;
    const int k = chunk_k(stage);
    const int blk = k / BK, koff = k % BK;
    const bool in_row = blk < nnz;
    const Elem* x_col = x + (long long)col * BK + koff;
    const Elem* w_blk = values + ((long long)(first + (in_row ? blk : 0)) * BM) * BK + koff;
#pragma unroll
    for (int r = tid >> 3; r < TILE_M; r += THREADS / 8) {
      const bool ok = in_row && (m0 + r) < M;
      cp_async16(swizzled(smem, r, chunk), ok ? x_col + (long long)(m0 + r) * K : x, ok);
    }
#pragma unroll
    for (int r = tid >> 3; r < BM; r += THREADS / 8)
      cp_async16(swizzled(smem + X_BYTES, r, chunk), w_blk + r * BK, in_row);
  }
};

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
