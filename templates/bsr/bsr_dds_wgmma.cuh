// Block-sparse Y = X W^T (+ bias) on Hopper's warpgroup tensor cores (wgmma, sm_90a),
// fed by cp.async: the stage gather of sg_gather_tile.cuh, whose swizzled rows wgmma reads as
// they are. Each warpgroup owns TILE_M / WARPGROUPS rows and all BM columns.
#pragma once
#include "sg_gather_tile.cuh"
#include "sg_wgmma.cuh"

namespace sg {

template <class Wgmma, class Mma, class Elem, int TILE_M, int BM, int BK, int WARPGROUPS, int STAGES,
          class Epi = NoEpilogue>
struct BsrDdsWgmma {
  static constexpr int THREADS = 128 * WARPGROUPS;
  using Loader = GatherStageLoader<Elem, TILE_M, BM, BK, THREADS>;
  static constexpr int WG_M = TILE_M / WARPGROUPS, SUB = WG_M / 64, ACC = BM / 2;
  static constexpr int AHEAD = STAGES - 2;  // stages loading while one computes, one drains
  static_assert(WG_M % 64 == 0 && STAGES >= 3, "warpgroups own whole m64 tiles");

  __device__ static void compute_stage(u32 smem, float (&acc)[SUB][ACC], int wg) {
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub) pin(acc[sub]);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < 4; ++k) {  // 4 steps of k16: 32 bytes each, inside the swizzle atom
      const u64 b = sw128_descriptor(smem + Loader::X_BYTES + 32 * k);
#pragma unroll
      for (int sub = 0; sub < SUB; ++sub)
        Wgmma::mma(acc[sub], sw128_descriptor(smem + (wg * WG_M + sub * 64) * 128 + 32 * k), b);
    }
    wgmma_commit();
#pragma unroll
    for (int sub = 0; sub < SUB; ++sub) pin(acc[sub]);
  }

  __device__ static void run(const Elem* x, const Elem* values, const int* row_offsets,
                             const int* cols, const Elem* bias, Elem* y, int M, int K, int N) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_ptr(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
    const int block_row = blockIdx.x, m0 = blockIdx.y * TILE_M, wg = threadIdx.x / 128;
    const int first = row_offsets[block_row], nnz = row_offsets[block_row + 1] - first;
    const int stages = Loader::num_stages(nnz);
    float acc[SUB][ACC] = {};

    int col = Loader::lookup_col(0, cols, first, nnz);
#pragma unroll
    for (int s = 0; s < AHEAD; ++s) {
      const int this_col = col;
      col = Loader::lookup_col(s + 1, cols, first, nnz);
      if (s < stages) Loader::load(smem + s * Loader::STAGE_BYTES, s, this_col, x, values, first, nnz, m0, M, K);
      cp_async_commit();
    }
    for (int s = 0; s < stages; ++s) {
      cp_async_wait<AHEAD - 1>();
      fence_proxy_async();
      __syncthreads();  // stage s visible to all; stage s-2's wgmmas finished everywhere
      // wgmma runs asynchronously: start the tensor cores first, then issue the copies for
      // a later stage into the buffer stage s-2 used, while they work.
      compute_stage(smem + (s % STAGES) * Loader::STAGE_BYTES, acc, wg);
      const int next = s + AHEAD, this_col = col;
      col = Loader::lookup_col(next + 1, cols, first, nnz);
      if (next < stages)
        Loader::load(smem + (next % STAGES) * Loader::STAGE_BYTES, next, this_col, x, values,
                     first, nnz, m0, M, K);
      cp_async_commit();
      wgmma_wait<1>();  // stage s-1's wgmmas are done: its buffer may be refilled next time
    }
    wgmma_wait<0>();
    store_wgmma_tile<Mma, BM, false, Epi>(acc, bias, y, m0 + wg * WG_M, block_row * BM, M, N);
  }

};

}  // namespace sg
