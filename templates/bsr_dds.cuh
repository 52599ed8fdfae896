// Block-sparse Y = X W^T (+ bias): Y dense [M, N], X dense [M, K] row-major, W block-CSR
// with blocks [BM, BK] (BM rows of N, BK columns of K), values stored row-major per block.
//
// A threadblock owns TILE_M rows of Y and one block row of W (BM columns of Y). It walks
// only that block row's nonzero blocks, viewed as one "compressed K" axis of length
// nnz * BK, in stages of 128 bytes per row: each stage gathers the matching columns of X
// and the slices of the W blocks into swizzled shared memory with cp.async, STAGES deep.
#pragma once
#include "sg_mma.cuh"

namespace sg {

template <class Mma, class Elem, int TILE_M, int BM, int BK, int WARPS_M, int WARPS_N, int STAGES>
struct BsrDds {
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int CHUNK = 16 / sizeof(Elem);          // elements per 16-byte copy
  static constexpr int STAGE_K = 8 * CHUNK;                 // elements of K per stage (128 bytes)
  static constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = BM / WARPS_N;
  static constexpr int MT = WARP_M / 16, NT = WARP_N / 8;   // mma tiles per warp
  static constexpr int X_BYTES = TILE_M * 128, STAGE_BYTES = (TILE_M + BM) * 128;
  static_assert(WARP_N % 16 == 0 && WARP_M % 16 == 0, "warp tile must hold whole mma pairs");
  static_assert((TILE_M * 8) % THREADS == 0, "X copy loop must divide evenly among threads");

  // Each thread always copies the same 16-byte chunk column (tid % 8) of a stage, so one
  // column index per stage and thread says where its chunks come from.
  __device__ static int chunk_k(int stage) { return stage * STAGE_K + (threadIdx.x & 7) * CHUNK; }

  // The column index a stage needs is fetched one stage early (see run()), so the copy
  // never waits on a global load of the index.
  __device__ static int lookup_col(int stage, const int* cols, int first, int nnz) {
    const int blk = chunk_k(stage) / BK;
    return blk < nnz ? __ldg(cols + first + blk) : 0;
  }

  __device__ static void load_stage(u32 smem, int stage, int col, const Elem* x, const Elem* values,
                                    int first, int nnz, int m0, int M, int K) {
    const int tid = threadIdx.x, chunk = tid & 7;
    const int k = chunk_k(stage);  // position on the compressed K axis
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

  __device__ static void compute_stage(u32 smem, float (&acc)[MT][NT][4], int wm, int wn) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int kc = 0; kc < 8; kc += 2) {  // 32 bytes of K per mma step
      u32 a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], swizzled(smem, wm * WARP_M + mt * 16 + (lane & 15), kc + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {
        u32 r[4];
        const int row = wn * WARP_N + np * 16 + ((lane >> 4) << 3) + (lane & 7);
        ldmatrix_x4(r, swizzled(smem + X_BYTES, row, kc + ((lane >> 3) & 1)));
        b[2 * np][0] = r[0]; b[2 * np][1] = r[1]; b[2 * np + 1][0] = r[2]; b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) Mma::mma(acc[mt][nt], a[mt], b[nt]);
    }
  }

  __device__ static void store(float (&acc)[MT][NT][4], const Elem* bias, Elem* y,
                               int m0, int n0, int M, int N, int wm, int wn) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = n0 + wn * WARP_N + nt * 8 + 2 * t;
      float b0 = 0.f, b1 = 0.f;
      if (bias) { b0 = to_float(bias[n]); b1 = to_float(bias[n + 1]); }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int m = m0 + wm * WARP_M + mt * 16 + g + 8 * half;
          if (m < M) store_pair(y + (long long)m * N + n, acc[mt][nt][2 * half] + b0,
                                acc[mt][nt][2 * half + 1] + b1);
        }
    }
  }

  __device__ static float to_float(Elem v) {
    if constexpr (Mma::kIsFloat) return v; else return Mma::to_float(v);
  }
  __device__ static void store_pair(Elem* dst, float lo, float hi) {
    if constexpr (Mma::kIsFloat) {
      *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
    } else {
      *reinterpret_cast<u32*>(dst) = Mma::pack(lo, hi);
    }
  }

  __device__ static void run(const Elem* x, const Elem* values, const int* row_offsets,
                             const int* cols, const Elem* bias, Elem* y, int M, int K, int N) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 smem = smem_ptr(smem_raw);
    const int block_row = blockIdx.x, m0 = blockIdx.y * TILE_M;
    const int first = row_offsets[block_row], nnz = row_offsets[block_row + 1] - first;
    const int stages = (nnz * BK + STAGE_K - 1) / STAGE_K;
    const int warp = threadIdx.x >> 5, wm = warp / WARPS_N, wn = warp % WARPS_N;
    float acc[MT][NT][4] = {};

    int col = lookup_col(0, cols, first, nnz);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      const int this_col = col;
      col = lookup_col(s + 1, cols, first, nnz);
      if (s < stages) load_stage(smem + s * STAGE_BYTES, s, this_col, x, values, first, nnz, m0, M, K);
      cp_async_commit();
    }
    for (int s = 0; s < stages; ++s) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage s landed for everyone; stage s-1's buffer is free to refill
      const int next = s + STAGES - 1, this_col = col;
      col = lookup_col(next + 1, cols, first, nnz);  // used one iteration from now
      if (next < stages)
        load_stage(smem + (next % STAGES) * STAGE_BYTES, next, this_col, x, values, first, nnz, m0, M, K);
      cp_async_commit();
      compute_stage(smem + (s % STAGES) * STAGE_BYTES, acc, wm, wn);
    }
    store(acc, bias, y, m0, block_row * BM, M, N, wm, wn);
  }
};

}  // namespace sg
