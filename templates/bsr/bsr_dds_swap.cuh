// Block-sparse Y = X W^T (+ bias) on Hopper with W in wgmma's A operand: the kernel computes
// Y^T = W X^T, so a wgmma multiplies 64 rows of W by up to 256 tokens (m64 x n256) instead
// of 64 tokens by the block's rows (m64 x nBM). Per product it reads 2 KB of W and 8 KB of
// X where the X-as-A kernels read 2 KB of each for a quarter of the work - shared memory
// bandwidth is what bounds these kernels. The store transposes through shared memory
// (sg_store_t.cuh), so Y is written in its own layout.
//
// Warpgroup 0 produces (TMA, as sg_gathered_dds_tma.cuh: the block row's nonzero blocks in turn,
// X's matching columns and W's block, 64 of K a stage); two consumers split the tile: the
// block's rows for 128-row blocks, the tokens for 64-row ones. Persistent: a block walks
// tiles blockIdx.x, + gridDim.x, ... and the producer fills the next tile's stages while
// the consumers store.
//
// TRANS_W (trans "nn", the input gradient dX = dY W): W is the transpose of the layer's
// stored weight. Block b of this W is stored block perm[b], untransposed; the producer
// copies it as it is (64 of its rows = 64 of K per box) and wgmma reads it M-major
// (imm-trans-a 1) - no transposed copy of the values each step.
//
// PAIRS (instr "pairs", 64-row blocks): a tile is two block rows, one per consumer, matched
// by the columns they share (bsr.overlap_pairs; pair_rows names them). The producer walks
// the union of their columns (bsr.pair_index), copies X's columns once for both rows and
// each row's block where it has one; a consumer multiplies only where its own row has a
// block. X, most of the bytes a stage moves, is then copied once per union column instead
// of once per block: fewer bytes per useful FLOP wherever the two rows share columns, which
// is what bounds these kernels.
#pragma once
#include "sg_wgmma.cuh"
#include "sg_store_t.cuh"
#include "sg_tma.cuh"

namespace sg {

// Wgmma: generated per (WG_T, dtype) - mma(acc, desc_a, desc_b), m64 x WG_T x k16, K-major.
// CLUSTER 2 (64-row blocks): the two blocks of a cluster take the same tile row and
// neighbouring token tiles, so they read the same W blocks; each copies half the rows of
// every W box and multicasts it to both. A buffer is refilled only once the consumers of
// both blocks have released it.
template <class Wgmma, class Mma, class Elem, int TILE_T, int BM, int BK, int STAGES, bool TRANS_W, bool PAIRS,
          int CLUSTER = 1, class Epi = NoEpilogue>
struct BsrDdsSwap {
  static constexpr int ROWS = PAIRS ? 128 : BM;  // W's rows in one tile
  static constexpr int CONSUMERS = 2, THREADS = 128 * (CONSUMERS + 1), STAGE_K = 64;
  static constexpr int ROW_SPLIT = ROWS / 64, WG_T = TILE_T * ROW_SPLIT / CONSUMERS, ACC = WG_T / 2;
  static constexpr int X_BYTES = TILE_T * 128, STAGE_BYTES = X_BYTES + ROWS * 128, BOX = 64 * 128;
  using Store = TransposedStore<Mma, Elem, WG_T, 64, Epi>;
  static_assert((BM == 64 || BM == 128) && BK % 64 == 0 && WG_T % 64 == 0 && WG_T <= 256, "tile shape");
  static_assert(!PAIRS || BM == 64, "pairs of 64-row block rows");
  static_assert(CLUSTER == 1 || BM == 64, "clusters share 64-row W boxes");
  // 128 accumulators a thread want more than an even share of the registers: the producer
  // gives its own away (RegisterSplit: 168 a thread at launch, 40 + 2 x 232 after).
  static constexpr bool REBALANCE = ACC >= 128;

  __device__ static void produce(const TensorMap* x_map, const TensorMap* w_map, u32 smem, u32 bars,
                                 const int* cols, const long long* perm, const int2* halves, int first, int g0,
                                 int stages, int m0, u32 rank) {
    // X's columns are re-read by every tile row with a block there, the tiles running about
    // the same time: kept in L2 ahead of W's blocks, 0-2% faster on an H100 at block 64 (the
    // reverse, X first out, was 1.1-2x slower; an ad-hoc A/B in BENCHMARKS.md).
    const u64 x_policy = l2_evict_last();
    for (int s = 0; s < stages; ++s) {
      const int g = g0 + s, buf = g % STAGES, k = s * STAGE_K, blk = k / BK, koff = k % BK;
      const u32 full = bars + 8 * buf, stage = smem + buf * STAGE_BYTES;
      mbar_wait(bars + 8 * (STAGES + buf), ((g / STAGES) & 1) ^ 1);  // a fresh barrier counts as emptied
      if constexpr (PAIRS) {  // the stored block of each row of the pair, -1 where it has none
        const int2 half = __ldg(halves + first + blk);
        mbar_expect_bytes(full, X_BYTES + BOX * ((half.x >= 0) + (half.y >= 0)));
        tma_load_2d(stage, x_map, __ldg(cols + first + blk) * BK + koff, m0, full, x_policy);
        load_block(stage + X_BYTES, w_map, half.x, koff, full, rank);
        load_block(stage + X_BYTES + BOX, w_map, half.y, koff, full, rank);
        continue;
      }
      mbar_expect_bytes(full, STAGE_BYTES);
      tma_load_2d(stage, x_map, __ldg(cols + first + blk) * BK + koff, m0, full, x_policy);
      if constexpr (TRANS_W) {  // rows koff.. of stored block perm[b] (BK x BM): BM / 64 boxes of 64 x 64
        const int stored = static_cast<int>(__ldg(perm + first + blk));
#pragma unroll
        for (int h = 0; h < BM / 64; ++h) load_w(stage + X_BYTES + h * BOX, w_map, 64 * h, stored * BK + koff, full, rank);
      } else {
        load_w(stage + X_BYTES, w_map, koff, (first + blk) * BM, full, rank);
      }
    }
  }

  // Rows koff.. of a 64-row stored block (PAIRS); none where the row has no block here.
  __device__ static void load_block(u32 dst, const TensorMap* w_map, int stored, int koff, u32 full, u32 rank) {
    if (stored < 0) return;
    if constexpr (TRANS_W) load_w(dst, w_map, 0, stored * BK + koff, full, rank);
    else load_w(dst, w_map, koff, stored * 64, full, rank);
  }

  // A W box at (inner, outer) into dst: the host's box (BM rows; 64 in a cluster), or in a
  // cluster each block's share of its 64 rows (the host's boxes are 64 / CLUSTER rows),
  // copied to the same place in every block.
  __device__ static void load_w(u32 dst, const TensorMap* w_map, int inner, int outer, u32 full, u32 rank) {
    constexpr int SHARE = 64 / CLUSTER;
    if constexpr (CLUSTER == 1) tma_load_2d(dst, w_map, inner, outer, full);
    else tma_load_2d_multicast(dst + rank * SHARE * 128, w_map, inner, outer + rank * SHARE, full, (1 << CLUSTER) - 1);
  }

  // Whether this warpgroup's rows (r0: 0 or 64, the pair's first or second row) have a
  // block in stage s; always, without PAIRS.
  __device__ static bool has_block(const int2* halves, int first, int s, int r0) {
    if constexpr (!PAIRS) return true;
    const int2 half = __ldg(halves + first + s * STAGE_K / BK);
    return (r0 == 0 ? half.x : half.y) >= 0;
  }

  // Warpgroup rows r0.. of the block (W, operand A) and tokens t0.. of the tile (X, B).
  __device__ static void consume(u32 smem, u32 bars, int g0, int stages, int r0, int t0, float (&acc)[ACC],
                                 const int2* halves, int first) {
    for (int s = 0; s < stages; ++s) {
      const int g = g0 + s, buf = g % STAGES;
      const bool mine = has_block(halves, first, s, r0);
      mbar_wait(bars + 8 * buf, (g / STAGES) & 1);
      const u32 stage = smem + buf * STAGE_BYTES;
      if (mine) {
        pin(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < 4; ++k)  // k16 steps: 32 bytes along the 128-byte swizzled rows
          Wgmma::mma(acc, w_descriptor(stage + X_BYTES, r0, k), sw128_descriptor(stage + t0 * 128 + 32 * k));
        wgmma_commit();
        pin(acc);
        wgmma_wait<1>();  // stage s-1 is finished: hand its buffer back to the producer
      } else {
        wgmma_wait<0>();  // nothing of this row here (pairs): only stage s-1 to finish
      }
      if (s > 0) release(bars, g - 1);
    }
    wgmma_wait<0>();
    if (stages > 0) release(bars, g0 + stages - 1);  // the producer may be filling the next tile's
  }

  // Operand A at W's rows r0.., k16 step k: K-major rows of 128 bytes; or (TRANS_W) M-major,
  // box r0 / 64 (64 of W's rows across, one row per k), 16 of its rows a step.
  __device__ static u64 w_descriptor(u32 region, int r0, int k) {
    if constexpr (TRANS_W) return sw128_mn_descriptor(region + (r0 / 64) * BOX + k * 16 * 128, BOX);
    return sw128_descriptor(region + r0 * 128 + 32 * k);
  }

  // Buffer g % STAGES is read: tell this block's producer, and in a cluster every block's
  // (each multicasts into it).
  __device__ static void release(u32 bars, int g) {
    if (threadIdx.x % 128 != 0) return;
    const u32 empty = bars + 8 * (STAGES + g % STAGES);
    if constexpr (CLUSTER == 1) mbar_arrive(empty);
    else
#pragma unroll
      for (int cta = 0; cta < CLUSTER; ++cta) mbar_arrive_cluster(empty, cta);
  }

  // The first row of Y a consumer stores: its rows r0.. of the tile row's block row, or
  // with PAIRS of its block row in the pair (past N for an odd one out: nothing stored).
  __device__ static int first_row(const int2* pair_rows, int tile_row, int r0) {
    if constexpr (!PAIRS) return tile_row * ROWS + r0;
    const int2 rows = __ldg(pair_rows + tile_row);
    return 64 * (r0 == 0 ? rows.x : rows.y);
  }

  // PAIRS: row_offsets and cols index the pairs' union columns, halves their blocks.
  // Tiles: (tile row, group of CLUSTER neighbouring token tiles), tile rows fastest, so the
  // blocks running at once share X's rows in L2; block `rank` of a cluster takes the
  // group's token tile `rank`. Persistent: a cluster walks groups c, c + clusters, ...
  __device__ static void run(const TensorMap* x_map, const TensorMap* w_map, const int* row_offsets,
                             const int* cols, const long long* perm, const int2* halves, const int2* pair_rows,
                             const Elem* bias, Elem* y, int M, int K, int N) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_ptr(smem_raw) + 1023) & ~1023u;  // swizzle atoms need 1024 alignment
    const u32 staging = smem + STAGES * STAGE_BYTES, bars = staging + CONSUMERS * Store::BYTES;
    const int wg = threadIdx.x / 128, block_rows = (N / BM + ROWS / BM - 1) / (ROWS / BM);  // tile rows
    const int groups = block_rows * (((M + TILE_T - 1) / TILE_T + CLUSTER - 1) / CLUSTER);
    const u32 rank = CLUSTER == 1 ? 0 : cluster_rank();
    const int first_group = blockIdx.x / CLUSTER, step = gridDim.x / CLUSTER;
    if (threadIdx.x == 0) start_ring(bars, STAGES, CONSUMERS * CLUSTER, x_map, w_map);
    if constexpr (CLUSTER == 1) __syncthreads(); else cluster_sync();  // partners' barriers are ready
    if (wg == 0) {
      if constexpr (REBALANCE) RegisterSplit<THREADS>::producer();
      if (threadIdx.x == 0)
        for (int t = first_group, g = 0; t < groups; t += step) {
          const int block_row = t % block_rows, first = row_offsets[block_row];
          const int stages = (row_offsets[block_row + 1] - first) * BK / STAGE_K;
          produce(x_map, w_map, smem, bars, cols, perm, halves, first, g, stages,
                  (t / block_rows * CLUSTER + rank) * TILE_T, rank);
          g += stages;
        }
    } else {
      if constexpr (REBALANCE) RegisterSplit<THREADS>::consumer();
      const int c = wg - 1, r0 = ROW_SPLIT == 2 ? 64 * c : 0, t0 = ROW_SPLIT == 2 ? 0 : WG_T * c;
      for (int t = first_group, g = 0; t < groups; t += step) {
        const int block_row = t % block_rows, first = row_offsets[block_row];
        const int stages = (row_offsets[block_row + 1] - first) * BK / STAGE_K;
        float acc[ACC] = {};
        consume(smem, bars, g, stages, r0, t0, acc, halves, first);
        // (a cluster's token tile past M stores nothing)
        Store::store(staging + c * Store::BYTES, acc, bias, y, (t / block_rows * CLUSTER + rank) * TILE_T + t0,
                     first_row(pair_rows, block_row, r0), M, N, 2 + c);
        g += stages;
      }
    }
    // No block may leave while its partner still arrives on its barriers or copies into it.
    if constexpr (CLUSTER > 1) cluster_sync();
  }
};

}  // namespace sg
