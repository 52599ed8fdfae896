// Block-sparse Y = X W^T (+ bias) on mma.sync tensor cores (sm_80 and later), for any
// layout of block rows (Rows: the row policy, sg_rows.cuh). Y dense [M, N]; X dense
// [M, K] row-major; W's blocks [BM, BK] row-major per block, a block row's stored blocks
// consecutive. The stage gather is in sg_gather_tile.cuh; warps split the
// TILE_M x BM output tile WARPS_M x WARPS_N ways and read operands with ldmatrix.
#pragma once
#include "sg_gather_tile.cuh"

namespace sg {

template <class Mma, class Elem, int TILE_M, int BM, int BK, int WARPS_M, int WARPS_N, int STAGES,
          class Rows, class Epi = NoEpilogue>
struct GatheredDds {
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  using Loader = GatherStageLoader<Elem, TILE_M, BM, BK, THREADS>;
  static constexpr int WARP_M = TILE_M / WARPS_M, WARP_N = BM / WARPS_N;
  static constexpr int MT = WARP_M / 16, NT = WARP_N / 8;   // mma tiles per warp
  static_assert(WARP_N % 16 == 0 && WARP_M % 16 == 0, "warp tile must hold whole mma pairs");

  using Frag = typename Mma::Frag;  // float[4], or an f16 accumulator's u32[2]

  __device__ static void compute_stage(u32 smem, Frag (&acc)[MT][NT], int wm, int wn) {
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
        ldmatrix_x4(r, swizzled(smem + Loader::X_BYTES, row, kc + ((lane >> 3) & 1)));
        b[2 * np][0] = r[0]; b[2 * np][1] = r[1]; b[2 * np + 1][0] = r[2]; b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) Mma::mma(acc[mt][nt], a[mt], b[nt]);
    }
  }

  __device__ static void run(const Elem* x, const Elem* values, Rows rows, const int* cols,
                             const Elem* bias, Elem* y, int M, int K, int N) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 smem = smem_ptr(smem_raw);
    const int block_row = blockIdx.x, m0 = blockIdx.y * TILE_M;
    const int first = rows.first(block_row), nnz = rows.count(block_row);
    const int stages = Loader::num_stages(nnz);
    const int warp = threadIdx.x >> 5, wm = warp / WARPS_N, wn = warp % WARPS_N;
    Frag acc[MT][NT] = {};

    int col = Loader::lookup_col(0, rows, block_row, cols, first, nnz);
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      const int this_col = col;
      col = Loader::lookup_col(s + 1, rows, block_row, cols, first, nnz);
      if (s < stages) Loader::load(smem + s * Loader::STAGE_BYTES, s, this_col, x, values, first, nnz, m0, M, K);
      cp_async_commit();
    }
    for (int s = 0; s < stages; ++s) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage s landed for everyone; stage s-1's buffer is free to refill
      const int next = s + STAGES - 1, this_col = col;
      col = Loader::lookup_col(next + 1, rows, block_row, cols, first, nnz);  // used one iteration from now
      if (next < stages)
        Loader::load(smem + (next % STAGES) * Loader::STAGE_BYTES, next, this_col, x, values,
                     first, nnz, m0, M, K);
      cp_async_commit();
      compute_stage(smem + (s % STAGES) * Loader::STAGE_BYTES, acc, wm, wn);
    }
    const int lane = threadIdx.x & 31;
    using Store = TileStore<Mma, Elem, Epi>;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; nt += Epi::kGated ? 2 : 1) {
        const int m = m0 + wm * WARP_M + mt * 16 + (lane >> 2), n = block_row * BM + wn * WARP_N + nt * 8 + 2 * (lane & 3);
        float room[2][4];
        if constexpr (Epi::kGated)
          Store::m16n8_gated(frag_floats(acc[mt][nt], room[0]), frag_floats(acc[mt][nt + 1], room[1]), bias, y,
                             m, n, M, N);
        else
          Store::m16n8(frag_floats(acc[mt][nt], room[0]), bias, y, m, n, M, N);
      }
  }
};

}  // namespace sg
