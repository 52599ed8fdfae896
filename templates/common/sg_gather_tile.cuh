// Gathering one pipeline stage of a block-sparse product into shared memory, for any
// layout that stores W as block rows of BM x BK blocks, each block's column in `cols`.
//
// A threadblock owns TILE_M rows of X and one block row of W (BM rows of W, BM columns of Y).
// It walks only that block row's stored blocks - where they start and how many there are is
// the layout's row policy (sg_rows.cuh) - viewed as one "compressed K" axis of length
// nnz * BK, in stages of 128 bytes per row: each stage gathers the matching columns of X and
// the slices of the W blocks into shared memory (rows of 128 bytes, 16-byte chunks swizzled
// as chunk ^ (row % 8) - the same layout wgmma calls 128-byte swizzle).
#pragma once
#include "sg_rows.cuh"
#include "sg_store.cuh"

namespace sg {

template <class Elem, int TILE_M, int BM, int BK, int THREADS>
struct GatherStageLoader {
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

  // The same through a row policy (sg_rows.cuh), which may compute the column instead.
  template <class Rows>
  __device__ static int lookup_col(int stage, const Rows& rows, int r, const int* cols, int first, int nnz) {
    const int blk = chunk_k(stage) / BK;
    return blk < nnz ? rows.col(cols, r, first, blk) : 0;
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

}  // namespace sg
