// Block-sparse Y = X W^T (+ bias) on Hopper: TMA copies feed wgmma, warp-specialized; for any
// layout of block rows (Rows: the row policy, sg_rows.cuh).
//
// Warpgroup 0 is the producer: one thread walks the block row's stored blocks and issues
// TMA tile copies of X's matching columns and of W's blocks into a ring of STAGES buffers,
// each guarded by a "full" mbarrier (bytes landed) and an "empty" one (consumers done).
// The other CONSUMERS warpgroups only wait, multiply (wgmma straight from shared memory)
// and finally store. Cooperative (PINGPONG false): the consumers split each tile's rows.
// Ping-pong: each consumer takes whole tiles in turn, so one stores its tile while the
// next one's products run - the epilogue hides behind the tensor cores. A stage is 64 elements of K; it holds SUBS sub-tiles of SUB_K
// elements (one block's width when BK < 64), each in the swizzle that matches its width.
#pragma once
#include "sg_rows.cuh"
#include "sg_wgmma.cuh"
#include "sg_tma.cuh"

namespace sg {

template <class Wgmma, class Mma, class Elem, int TILE_M, int BM, int BK, int CONSUMERS, int STAGES,
          bool PINGPONG, class Rows, class Epi = NoEpilogue>
struct GatheredDdsTma {
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  static constexpr int STAGE_K = 64, SUB_K = BK < 64 ? BK : 64, SUBS = STAGE_K / SUB_K;
  static constexpr int SUB_BYTES = SUB_K * 2;                   // 32, 64 or 128: the swizzle
  static constexpr int X_BYTES = TILE_M * 128, STAGE_BYTES = (TILE_M + BM) * 128;
  static constexpr int WG_M = PINGPONG ? TILE_M : TILE_M / CONSUMERS, MSUB = WG_M / 64, ACC = BM / 2;
  static_assert(sizeof(Elem) == 2 && WG_M % 64 == 0, "16-bit types, whole m64 tiles per warpgroup");

  // K-major operand in a sub-tile of SUB_BYTES-wide rows: 8-row groups are 8 * SUB_BYTES
  // apart; the layout code names the swizzle (1: 128 B, 2: 64 B, 3: 32 B).
  __device__ static u64 descriptor(u32 addr) {
    constexpr u64 layout = SUB_BYTES == 128 ? 1 : SUB_BYTES == 64 ? 2 : 3;
    return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(1) << 16) |
           (static_cast<u64>(8 * SUB_BYTES >> 4) << 32) | (layout << 62);
  }

  // Shared address of k16 step `k` (0..3) of rows starting at `row` in a region of `rows`.
  __device__ static u32 operand(u32 region, int rows, int row, int k) {
    const int sub = (16 * k) / SUB_K, within = (16 * k) % SUB_K;
    return region + sub * rows * SUB_BYTES + row * SUB_BYTES + within * 2;
  }

  // Stages are counted across all the tiles a block handles (`g`), so the ring's buffer
  // and phase carry over from one tile to the next.
  __device__ static void produce(const TensorMap* x_map, const TensorMap* w_map, u32 smem, u32 bars,
                                 Rows rows, int block_row, const int* cols, int first, int nnz, int g0,
                                 int stages, int m0, int K, int w_rows) {
    for (int s = 0; s < stages; ++s) {
      const int g = g0 + s, buf = g % STAGES;
      const u32 full = bars + 8 * buf, empty = bars + 8 * (STAGES + buf);
      mbar_wait(empty, ((g / STAGES) & 1) ^ 1);  // a fresh barrier counts as already emptied
      mbar_expect_bytes(full, STAGE_BYTES);
      const u32 stage = smem + buf * STAGE_BYTES;
#pragma unroll
      for (int j = 0; j < SUBS; ++j) {
        const int k = s * STAGE_K + j * SUB_K, blk = k / BK, koff = k % BK;
        const bool in_row = blk < nnz;  // past the row's end: read outside both tensors -> zeros
        const int x_k = in_row ? rows.col(cols, block_row, first, blk) * BK + koff : K;
        const int w_row = in_row ? (first + blk) * BM : w_rows;
        tma_load_2d(stage + j * TILE_M * SUB_BYTES, x_map, x_k, m0, full);
        tma_load_2d(stage + X_BYTES + j * BM * SUB_BYTES, w_map, koff, w_row, full);
      }
    }
  }

  __device__ static void release(u32 bars, int g) {
    if (threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + g % STAGES));
  }

  // row0: this warpgroup's first row in the tile. `order` (ping-pong only) is signalled once
  // every stage of this tile has been waited for.
  __device__ static void consume(u32 smem, u32 bars, int g0, int stages, int row0,
                                 float (&acc)[MSUB][ACC], u32 order = 0) {
    for (int s = 0; s < stages; ++s) {
      const int g = g0 + s, buf = g % STAGES;
      mbar_wait(bars + 8 * buf, (g / STAGES) & 1);
      const u32 stage = smem + buf * STAGE_BYTES;
#pragma unroll
      for (int i = 0; i < MSUB; ++i) pin(acc[i]);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const u64 b = descriptor(operand(stage + X_BYTES, BM, 0, k));
#pragma unroll
        for (int i = 0; i < MSUB; ++i)
          Wgmma::mma(acc[i], descriptor(operand(stage, TILE_M, row0 + i * 64, k)), b);
      }
      wgmma_commit();
#pragma unroll
      for (int i = 0; i < MSUB; ++i) pin(acc[i]);
      wgmma_wait<1>();  // stage s-1 is finished: hand its buffer back to the producer
      if (s > 0) release(bars, g - 1);
    }
    // Every thread of the warpgroup arrives, not one per warpgroup: a lagging warp (still
    // storing the previous tile) could otherwise find `order` two phases on and wait on the
    // wrong parity forever - seen with empty and one-stage tiles in a row.
    if (order) mbar_arrive(order);
    wgmma_wait<0>();
    if (stages > 0) release(bars, g0 + stages - 1);
  }

  // Persistent: each block walks tiles blockIdx.x, +gridDim.x, ... (block rows fastest, so
  // blocks running together share X's rows in L2). While the consumers store one tile, the
  // producer is already filling the ring with the next.
  __device__ static void run(const TensorMap* x_map, const TensorMap* w_map, Rows rows, const int* cols,
                             const Elem* bias, Elem* y, int M, int K, int N, int w_rows) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_ptr(smem_raw) + 1023) & ~1023u;  // swizzle atoms need 1024 alignment
    // full[STAGES], empty[STAGES], then (ping-pong) the barrier that orders mainloops
    const u32 bars = smem + STAGES * STAGE_BYTES, order = bars + 16 * STAGES;
    const int wg = threadIdx.x / 128, block_rows = N / BM;
    const int tiles = block_rows * ((M + TILE_M - 1) / TILE_M);
    if (threadIdx.x == 0) {
      mbar_init(order, 128);  // the whole consumer warpgroup arrives (see consume)
      start_ring(bars, STAGES, PINGPONG ? 1 : CONSUMERS, x_map, w_map);
    }
    __syncthreads();
    if (wg == 0 && threadIdx.x != 0) return;
    float acc[MSUB][ACC] = {};
    for (int t = blockIdx.x, g = 0, i = 0; t < tiles; t += gridDim.x, ++i) {
      const int block_row = t % block_rows, m0 = (t / block_rows) * TILE_M;
      const int first = rows.first(block_row), nnz = rows.count(block_row);
      const int stages = (nnz * BK + STAGE_K - 1) / STAGE_K;
      if (wg == 0) {
        produce(x_map, w_map, smem, bars, rows, block_row, cols, first, nnz, g, stages, m0, K, w_rows);
      } else if (!PINGPONG) {
        consume(smem, bars, g, stages, (wg - 1) * WG_M, acc);
        store_wgmma_tile<Mma, BM, true, Epi>(acc, bias, y, m0 + (wg - 1) * WG_M, block_row * BM, M, N);
      } else if (i % CONSUMERS == wg - 1) {
        // Wait until the previous tile's consumer has seen all its stages arrive: then no
        // ring slot this tile needs can still be two phases behind.
        if (i > 0) mbar_wait(order, (i - 1) & 1);
        consume(smem, bars, g, stages, 0, acc, order);
        store_wgmma_tile<Mma, BM, true, Epi>(acc, bias, y, m0, block_row * BM, M, N);
      }
      g += stages;
    }
  }
};

}  // namespace sg
