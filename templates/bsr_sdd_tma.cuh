// Sampled dense-dense product on Hopper: dW[b] = dY[:, rows of b]^T X[:, cols of b] for the
// stored BM x BK blocks b of a block-sparse weight, on wgmma fed by TMA (sm_90a).
//
// A block's reduction runs over the tokens, which are the rows of both dY and X in memory,
// so both operands arrive token-major: TMA copies STAGE_T tokens x 64 features per box (128-byte
// rows, 128-byte swizzle) and wgmma reads them transposed (MN-major: imm-trans 1). One block
// takes a work item at a time (persistent; whole rounds of items one to a block, the items
// of the last, partial round split along the tokens into parts whose fp32 sums meet in
// global memory): up to GROUP stored blocks of one block row (consecutive in CSR order),
// so the dY slice is read once for GATHER gathered columns of X. Warpgroup 0 produces; the
// CONSUMERS warpgroups split the item's rows (BM 128) and its columns, WG_N each: 256 at
// BM 128, 128 at BM 64 - where four consumers gather 512 columns, so each stage's dY box
// serves twice the columns (fewer bytes per FLOP, which is what bounds this kernel).
// STAGE_T tokens a stage.
#pragma once
#include "bsr_dds_wgmma.cuh"
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
  // 128 accumulators a thread, or four consumers, want more than an even share of the
  // registers: the producer gives its own away (RegisterSplit).
  static constexpr bool REBALANCE = ACC >= 128 || CONSUMERS > 2;

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

  // Stages s0 .. s0 + stages of an item (STAGE_T tokens each); `g0` counts the stages this
  // block has run before, so the ring's buffer and phase carry over from unit to unit.
  __device__ static void produce(const TensorMap* dy_map, const TensorMap* x_map, u32 smem, u32 bars,
                                 const Item& item, int g0, int s0, int stages) {
    for (int s = 0; s < stages; ++s) {
      const int g = g0 + s, buf = g % STAGES, t0 = (s0 + s) * STAGE_T;
      const u32 full = bars + 8 * buf, stage = smem + buf * STAGE_BYTES;
      mbar_wait(bars + 8 * (STAGES + buf), ((g / STAGES) & 1) ^ 1);  // fresh barriers count as emptied
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
  __device__ static void consume(u32 smem, u32 bars, int g0, int stages, int r0, int n0, float (&acc)[ACC]) {
    for (int s = 0; s < stages; ++s) {
      const int g = g0 + s, buf = g % STAGES;
      mbar_wait(bars + 8 * buf, (g / STAGES) & 1);
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
      if (s > 0 && threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + (g - 1) % STAGES));
    }
    wgmma_wait<0>();
    if (stages > 0 && threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + (g0 + stages - 1) % STAGES));
  }

  // acc[4j + 2h] and acc[4j + 2h + 1] hold row acc_row(r0, h) and columns n0 + 8j + 2q, + 1
  // (q = lane % 4) of the warpgroup's part; gathered column c belongs to the item's block
  // c / BK, none past item.count. n0 is a multiple of BK, so a pair's block and column within
  // it are compile-time offsets from per-row bases: few address registers for 128 pairs.
  __device__ static int acc_row(int r0, int h) { return r0 + ((threadIdx.x / 32) & 3) * 16 + ((threadIdx.x & 31) >> 2) + 8 * h; }

  __device__ static void store(const float (&acc)[ACC], Elem* dw, const Item& item, int r0, int n0) {
    const int first = n0 / BK;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      Elem* row = dw + ((item.start + first) * BM + acc_row(r0, h)) * BK + 2 * (threadIdx.x & 3);
#pragma unroll
      for (int j = 0; j < WG_N / 8; ++j)
        if (first + 8 * j / BK < item.count)
          *reinterpret_cast<u32*>(row + (8 * j / BK) * BM * BK + (8 * j) % BK) =
              Mma::pack(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
  }

  // A part of a split item: add it into the item's fp32 slot (BM x GATHER); the warpgroup
  // whose part lands last (`arrivals` counts them) reads the sum back and stores it. `flag`:
  // a shared word of this warpgroup's; `barrier`: a named barrier of its own.
  __device__ static void add_part(float (&acc)[ACC], float* slot, int* arrivals, int parts, Elem* dw,
                                  const Item& item, int r0, int n0, u32 flag, int barrier) {
    const int first = n0 / BK;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float* row = slot + acc_row(r0, h) * GATHER + n0 + 2 * (threadIdx.x & 3);
#pragma unroll
      for (int j = 0; j < WG_N / 8; ++j)
        if (first + 8 * j / BK < item.count) red_add_v2(row + 8 * j, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    }
    __threadfence();  // this thread's additions before the count that publishes them
    warpgroup_sync(barrier);
    if (threadIdx.x % 128 == 0) st_shared_u32(flag, atomicAdd(arrivals, 1) == parts - 1);
    warpgroup_sync(barrier);
    if (!ld_shared_u32(flag)) return;
    __threadfence();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float* row = slot + acc_row(r0, h) * GATHER + n0 + 2 * (threadIdx.x & 3);
#pragma unroll
      for (int j = 0; j < WG_N / 8; ++j) {
        const float2 sum = __ldcg(reinterpret_cast<const float2*>(row + 8 * j));  // from L2, where the adds went
        acc[4 * j + 2 * h] = sum.x, acc[4 * j + 2 * h + 1] = sum.y;
      }
    }
    store(acc, dw, item, r0, n0);
  }

  // Two neighbouring floats added in global memory by one vector reduction (sm_90).
  __device__ static void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
  }

  // The schedule: with `blocks` persistent blocks and `items` work items of `stages` stages,
  // whole rounds of items go one to a block; the items left over (fewer than a round, which
  // would leave most blocks idle at the end) are split along the tokens into `parts` parts.
  struct Schedule {
    int whole, parts, units, stages;
    __device__ Schedule(int items, int blocks, int stages_) : stages(stages_) {
      whole = items / blocks * blocks;
      const int rest = items - whole, most = stages / 8 > 1 ? stages / 8 : 1;  // parts of 8+ stages
      parts = rest == 0 ? 1 : min(min(blocks / rest, most), 16);
      units = whole + rest * parts;
    }
    // unit u: its item, its part (-1: the whole item) and its stages
    __device__ void unit(int u, int& item, int& part, int& s0, int& count) const {
      if (u < whole) {
        item = u, part = -1, s0 = 0, count = stages;
        return;
      }
      item = whole + (u - whole) / parts, part = (u - whole) % parts;
      s0 = part * stages / parts, count = (part + 1) * stages / parts - s0;
    }
  };

  // item_starts: `bound` entries, the items' first blocks, then -1 (the host sizes it
  // without counting items). partials: an fp32 slot (BM x GATHER) per split item, zeroed;
  // arrivals: CONSUMERS counters per split item, zeroed.
  __device__ static void run(const TensorMap* dy_map, const TensorMap* x_map, const long long* flat_index,
                             const long long* item_starts, Elem* dw, float* partials, int* arrivals, int M, int nnz,
                             int blocks_per_row, int bound) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 smem = (smem_ptr(smem_raw) + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
    const u32 bars = smem + STAGES * STAGE_BYTES;               // full[STAGES], empty[STAGES], flags
    const Schedule plan(count_items(item_starts, bound), gridDim.x, (M + STAGE_T - 1) / STAGE_T);
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) start_ring(bars, STAGES, CONSUMERS, dy_map, x_map);
    __syncthreads();
    // Each unit's item, its part (-1: whole), its first stage and stage count, and the stages
    // this block ran before it (g).
    const auto walk = [&](auto&& fn) {
      for (int u = blockIdx.x, g = 0; u < plan.units; u += gridDim.x) {
        int i, part, s0, stages;
        plan.unit(u, i, part, s0, stages);
        fn(i, Item(flat_index, item_starts[i], nnz, blocks_per_row), part, s0, stages, g);
        g += stages;
      }
    };
    if (wg == 0) {
      if constexpr (REBALANCE) RegisterSplit<THREADS>::producer();
      if (threadIdx.x == 0)
        walk([&](int, const Item& item, int, int s0, int stages, int g) {
          produce(dy_map, x_map, smem, bars, item, g, s0, stages);
        });
      return;
    }
    if constexpr (REBALANCE) RegisterSplit<THREADS>::consumer();
    const int c = wg - 1, r0 = 64 * (c % ROW_SPLIT), n0 = WG_N * (c / ROW_SPLIT);
    walk([&](int i, const Item& item, int part, int, int stages, int g) {
      float acc[ACC] = {};
      consume(smem, bars, g, stages, r0, n0, acc);
      if (part < 0) return store(acc, dw, item, r0, n0);
      const int k = i - plan.whole;  // the split item's slot
      add_part(acc, partials + static_cast<long long>(k) * BM * GATHER, arrivals + k * CONSUMERS + c, plan.parts,
               dw, item, r0, n0, bars + 16 * STAGES + 4 * c, 1 + c);
    });
  }

  // The items before item_starts' -1 padding (binary search: it is sorted that way).
  __device__ static int count_items(const long long* item_starts, int bound) {
    int lo = 0, hi = bound;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (item_starts[mid] >= 0) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }
};

}  // namespace sg
