// Sampled dense-dense product: the weight gradient of a block-sparse linear,
// dW[b] = dY[:, rows of b]^T X[:, cols of b] for each stored block b only (mma.sync, sm_80+).
//
// One threadblock per stored block (BM x BK outputs) walks all M rows of dY and X in stages
// of TILE_K rows. Both operands arrive with the reduction dim (M) as their rows, so they are
// read with ldmatrix.trans. Shared-memory rows hold up to 64 columns (128 bytes); wider
// operands are split into column panels of 64, each swizzled chunk ^ (row % 8).
#pragma once
#include "sg_gather_tile.cuh"

namespace sg {

template <int COLS>
struct Panels {  // a [rows x COLS] 16-bit tile as panels of at most 64 columns
  static constexpr int WIDTH = COLS < 64 ? COLS : 64, ROW_BYTES = WIDTH * 2, CHUNKS = ROW_BYTES / 16;
  __device__ static u32 at(u32 base, int rows, int row, int col) {  // col: multiple of 8
    const int panel = col / WIDTH, chunk = (col % WIDTH) / 8;
    return base + panel * rows * ROW_BYTES + row * ROW_BYTES + ((chunk ^ (row % CHUNKS)) << 4);
  }
};

template <class Mma, class Elem, int BM, int BK, int TILE_K, int WARPS_M, int WARPS_N, int STAGES>
struct BsrSdd {
  static constexpr int THREADS = 32 * WARPS_M * WARPS_N;
  static constexpr int WARP_M = BM / WARPS_M, WARP_N = BK / WARPS_N, MT = WARP_M / 16, NT = WARP_N / 8;
  static constexpr int A_BYTES = TILE_K * BM * 2, STAGE_BYTES = TILE_K * (BM + BK) * 2;
  static_assert(WARP_M % 16 == 0 && WARP_N % 16 == 0 && TILE_K % 16 == 0, "whole mma tiles");

  // Copies TILE_K rows of a [M x COLS] slice (row stride `stride` elements) into panels.
  template <int COLS>
  __device__ static void load(u32 dst, const Elem* src, int m0, int M, int stride) {
    constexpr int PER_ROW = COLS / 8;
    for (int i = threadIdx.x; i < TILE_K * PER_ROW; i += THREADS) {
      const int row = i / PER_ROW, col = (i % PER_ROW) * 8;
      const bool ok = m0 + row < M;
      cp_async16(Panels<COLS>::at(dst, TILE_K, row, col), ok ? src + (long long)(m0 + row) * stride + col : src, ok);
    }
  }

  __device__ static void compute(u32 smem, float (&acc)[MT][NT][4], int wm, int wn) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < TILE_K; k += 16) {
      u32 a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)  // matrices: (k0-7, i0-7) (k0-7, i8-15) (k8-15, i0-7) (k8-15, i8-15)
        ldmatrix_x4_trans(a[mt], Panels<BM>::at(smem, TILE_K, k + (lane & 7) + ((lane >> 4) << 3),
                                                wm * WARP_M + mt * 16 + (((lane >> 3) & 1) << 3)));
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {  // matrices: (k0-7, j0-7) (k8-15, j0-7) (k0-7, j8-15) (k8-15, j8-15)
        u32 r[4];
        ldmatrix_x4_trans(r, Panels<BK>::at(smem + A_BYTES, TILE_K, k + (lane & 7) + (((lane >> 3) & 1) << 3),
                                            wn * WARP_N + np * 16 + ((lane >> 4) << 3)));
        b[2 * np][0] = r[0]; b[2 * np][1] = r[1]; b[2 * np + 1][0] = r[2]; b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) Mma::mma(acc[mt][nt], a[mt], b[nt]);
    }
  }

  __device__ static void run(const Elem* dy, const Elem* x, const long long* flat_index, Elem* dw,
                             int M, int N, int K) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 smem = smem_ptr(smem_raw);
    const long long flat = flat_index[blockIdx.x];
    const int blocks_per_row = K / BK;
    const Elem* a = dy + (flat / blocks_per_row) * BM;   // dY[:, rows of the block]
    const Elem* b = x + (flat % blocks_per_row) * BK;    // X[:, cols of the block]
    const int warp = threadIdx.x >> 5, wm = warp / WARPS_N, wn = warp % WARPS_N;
    const int stages = (M + TILE_K - 1) / TILE_K;
    float acc[MT][NT][4] = {};
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < stages) {
        load<BM>(smem + s * STAGE_BYTES, a, s * TILE_K, M, N);
        load<BK>(smem + s * STAGE_BYTES + A_BYTES, b, s * TILE_K, M, K);
      }
      cp_async_commit();
    }
    for (int s = 0; s < stages; ++s) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      const int next = s + STAGES - 1;
      if (next < stages) {
        load<BM>(smem + (next % STAGES) * STAGE_BYTES, a, next * TILE_K, M, N);
        load<BK>(smem + (next % STAGES) * STAGE_BYTES + A_BYTES, b, next * TILE_K, M, K);
      }
      cp_async_commit();
      compute(smem + (s % STAGES) * STAGE_BYTES, acc, wm, wn);
    }
    Elem* out = dw + (long long)blockIdx.x * BM * BK;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        TileStore<Mma, Elem>::m16n8(acc[mt][nt], nullptr, out, wm * WARP_M + mt * 16 + (lane >> 2),
                                    wn * WARP_N + nt * 8 + 2 * (lane & 3), BM, BK);
  }
};

}  // namespace sg
