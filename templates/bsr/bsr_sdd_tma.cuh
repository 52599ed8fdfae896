// Sampled dense-dense product on Hopper: dW[b] = dY[:, rows of b]^T X[:, cols of b] for the
// stored BM x BK blocks b of a block-sparse weight, on wgmma fed by TMA (sm_90a).
//
// A block's reduction runs over the tokens, which are the rows of both dY and X in memory,
// so both operands arrive token-major: TMA copies STAGE_T tokens x 64 features per box (128-byte
// rows, 128-byte swizzle) and wgmma reads them transposed (MN-major: imm-trans 1). One block
// takes a work item: up to GROUP stored blocks of one block row (consecutive in CSR order),
// so the dY slice is read once for GATHER gathered columns of X. Warpgroup 0 produces; the
// CONSUMERS warpgroups split the item's rows (BM 128) and its columns, WG_N each: 256 at
// BM 128, 128 at BM 64. Four consumers at BM 64 gather 512 columns, so a stage's dY box
// serves twice the columns: the default for layers with many blocks (sdd_spec's
// many_blocks), with 4 stages of 48 tokens; smaller layers keep two and 64-token stages.
#pragma once
#include "sg_wgmma.cuh"
#include "sg_tma.cuh"

namespace sg {

// Wgmma: generated per (WG_N, dtype) - mma(acc, desc_a, desc_b), m64 x WG_N x k16, both MN-major.
template <class Wgmma, class Mma, class Elem, int BM, int BK, int STAGES, int CONSUMERS, int STAGE_T>
struct BsrSddTma {
  static constexpr int THREADS = 128 * (CONSUMERS + 1), ROW_SPLIT = BM / 64, COL_SPLIT = CONSUMERS / ROW_SPLIT;
  static constexpr int WG_N = BM == 64 ? 128 : 256, GATHER = WG_N * COL_SPLIT, GROUP = GATHER / BK;
  static constexpr int CHUNKS = GATHER / 64, ACC = WG_N / 2, BOX = STAGE_T * 128, BOXES_PER_BLOCK = BK / 64;
  static constexpr int A_BYTES = (BM / 64) * BOX, STAGE_BYTES = A_BYTES + CHUNKS * BOX;
  static_assert((BM == 64 || BM == 128) && (BK == 64 || BK == 128) && COL_SPLIT >= 1, "blocks of 64 or 128");
  static_assert(STAGE_T % 16 == 0, "whole k16 steps of tokens a stage");

  // MN-major operands: 64-element chunks of M (or N) one box apart.
  __device__ static u64 descriptor(u32 addr) { return sw128_mn_descriptor(addr, BOX); }

  // The work item: `count` stored blocks from `start` on, all in block row `row`; X's
  // first column of each in `cols`.
  struct Item {
    long long start;
    int row, count, cols[GROUP];
    __device__ Item(const long long* flat_index, long long start_, int nnz, int blocks_per_row) : start(start_) {
      const long long first = flat_index[start];
      row = static_cast<int>(first / blocks_per_row), count = 0;
#pragma unroll
      for (int i = 0; i < GROUP; ++i) {
        const long long flat = start + i < nnz ? flat_index[start + i] : -1;
        const bool same_row = flat >= 0 && flat / blocks_per_row == row && count == i;
        count += same_row;
        cols[i] = same_row ? static_cast<int>(flat % blocks_per_row) * BK : 0;
      }
    }
  };

  __device__ static void produce(const TensorMap* dy_map, const TensorMap* x_map, u32 smem, u32 bars,
                                 const Item& item, int stages) {
    for (int s = 0; s < stages; ++s) {
      const int buf = s % STAGES, t0 = s * STAGE_T;
      const u32 full = bars + 8 * buf, stage = smem + buf * STAGE_BYTES;
      mbar_wait(bars + 8 * (STAGES + buf), ((s / STAGES) & 1) ^ 1);  // fresh barriers count as emptied
      mbar_expect_bytes(full, A_BYTES + item.count * BOXES_PER_BLOCK * BOX);
#pragma unroll
      for (int a = 0; a < BM / 64; ++a) tma_load_2d(stage + a * BOX, dy_map, item.row * BM + 64 * a, t0, full);
#pragma unroll
      for (int n = 0; n < CHUNKS; ++n) {  // 64-column chunk n of the gathered columns
        const int blk = n / BOXES_PER_BLOCK;
        if (blk < item.count)
          tma_load_2d(stage + A_BYTES + n * BOX, x_map, item.cols[blk] + 64 * (n % BOXES_PER_BLOCK), t0, full);
      }
    }
  }

  // Warpgroup c: rows r0.. of the item's BM, gathered columns n0.. (WG_N of them).
  __device__ static void consume(u32 smem, u32 bars, int stages, int r0, int n0, float (&acc)[ACC]) {
    for (int s = 0; s < stages; ++s) {
      const int buf = s % STAGES;
      mbar_wait(bars + 8 * buf, (s / STAGES) & 1);
      const u32 stage = smem + buf * STAGE_BYTES;
      pin(acc);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < STAGE_T / 16; ++k)  // 16 tokens a step: 16 rows of 128 bytes
        Wgmma::mma(acc, descriptor(stage + (r0 / 64) * BOX + k * 16 * 128),
                   descriptor(stage + A_BYTES + (n0 / 64) * BOX + k * 16 * 128));
      wgmma_commit();
      pin(acc);
      wgmma_wait<1>();  // stage s-1 is finished: its buffer goes back to the producer
      if (s > 0 && threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + (s - 1) % STAGES));
    }
    wgmma_wait<0>();
  }

  // acc holds rows 16w + g (+8) and columns 8j + 2q (+1) of the warpgroup's part: column c
  // of the gathered ones belongs to the item's block c / BK.
  __device__ static void store(const float (&acc)[ACC], Elem* dw, const Item& item, int r0, int n0) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
#pragma unroll
    for (int j = 0; j < WG_N / 8; ++j) {
      const int col = n0 + 8 * j + 2 * (lane & 3), blk = col / BK;
      if (blk >= item.count) continue;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = r0 + warp * 16 + (lane >> 2) + 8 * half;
        Elem* out = dw + ((item.start + blk) * BM + r) * BK + col % BK;
        *reinterpret_cast<u32*>(out) = Mma::pack(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
      }
    }
  }

  __device__ static void run(const TensorMap* dy_map, const TensorMap* x_map, const long long* flat_index,
                             const long long* item_starts, Elem* dw, int M, int nnz, int blocks_per_row) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_ptr(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
    const u32 bars = smem + STAGES * STAGE_BYTES;               // full[STAGES], then empty[STAGES]
    const long long start = item_starts[blockIdx.x];
    if (start < 0) return;  // a padding slot: the host sizes the grid without counting items
    const Item item(flat_index, start, nnz, blocks_per_row);
    const int wg = threadIdx.x / 128, stages = (M + STAGE_T - 1) / STAGE_T;
    if (threadIdx.x == 0) start_ring(bars, STAGES, CONSUMERS, dy_map, x_map);
    __syncthreads();
    if (wg == 0) {
      if (threadIdx.x == 0) produce(dy_map, x_map, smem, bars, item, stages);
      return;
    }
    const int c = wg - 1, r0 = 64 * (c % ROW_SPLIT), n0 = WG_N * (c / ROW_SPLIT);
    float acc[ACC] = {};
    consume(smem, bars, stages, r0, n0, acc);
    store(acc, dw, item, r0, n0);
  }
};

}  // namespace sg
