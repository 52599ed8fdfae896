// 2:4 semi-structured Y = X W^T (+ bias) on Hopper's sparse warpgroup MMA (wgmma.mma_async.sp,
// sm_90a), fed by TMA. As in sp24_dds.cuh the sparse operand is A, so the kernel computes
// Y^T = W X^T: each consumer warpgroup owns 64 rows of W (output features) and all TILE_T
// rows of X (tokens) of the block's tile; warpgroup 0 is the producer.
//
// One stage covers 64 of K (128 for e4m3: the same bytes): W's 32 kept values per row (64-byte
// rows, 64-byte swizzle), X's 64 columns (128-byte rows, 128-byte swizzle) and the metadata
// words of the two k32 tiles (four for e4m3)
// (layouts/semi24.py's layout, copied as it is: wgmma.sp reads metadata exactly as mma.sp
// m16n8k32 does, warp w of a warpgroup for rows 16w..16w+15). The accumulators go through
// shared memory so that Y [M, N] is written in its own row-major layout - no transpose pass.
//
// Persistent: a block walks output tiles blockIdx.x, + gridDim.x, ... so the producer loads
// the next tile's stages while the consumers store this one (the store has its own
// shared-memory buffer, apart from the ring).
//
// CLUSTER > 1: the blocks of a cluster take neighbouring W tiles of the same tokens, and
// each copies 1/CLUSTER of the X box and multicasts it to all - X crosses L2 once per
// cluster. A buffer is refilled only when the consumers of every block have released it.
// (ncu on an H200, 8192x8192 fp16 at M 16384: without it this kernel took fewer cycles
// than cuSPARSELt's but ran at 1.36 GHz against 1.65 - the L2 traffic costs clock.)
//
// Quant (not NoQuantize: the xq variant, one-byte scaled products of at most TILE_T tokens):
// X comes in 16 bits and is quantized here, so a decode step's layer is one launch, not a
// quantization pass and a product (a compiled decode step is host-bound: each launch costs
// about as much host time as the GPU time of both). Every block first finds its tokens'
// scales over the whole of K (sg_quantize.cuh's arithmetic, while the first stages' copies
// of W fly); per stage TMA copies X's 16-bit box beside the stage, and one of the producer
// warpgroup's warps 1-3 writes its bytes into the stage's X buffer in the layout TMA's
// 128-byte swizzle gives, before it marks the stage full. Every block reading all of X makes
// this variant cost more GPU time than the two kernels (tools/probe_quantizing.py): it is
// for a few tokens outside CUDA graphs (semi24/ops.py's quantizes_in_product).
#pragma once
#include "sg_wgmma.cuh"
#include "sg_split_k.cuh"
#include "sg_store_t.cuh"
#include "sg_tma.cuh"
#include "sg_quantize.cuh"

namespace sg {

struct NoQuantize { static constexpr bool ON = false; };

// The weights of one launch: Y's columns [start[g], start[g + 1]) are X times weight g (its
// values' and metadata's maps, its per-feature scales). G > 1 is a grouped product - the
// q, k and v projections of one input in one launch, where a compiled decode step is
// host-bound and each launch costs host time. Every group but the last starts on a tile
// edge (the host checks), so a tile reads one weight.
template <int G>
struct Groups {
  const TensorMap* w[G];
  const TensorMap* m[G];
  const float* feature[G];
  int start[G + 1];  // start[G]: N
  __device__ int of(int n0) const {
    int g = 0;
#pragma unroll
    for (int i = 1; i < G; ++i) g += n0 >= start[i];
    return g;
  }
};

// The xq variant's quantizer: sg_quantize.cuh's, from Src (the activations' 16-bit type).
template <class Src, bool INT8>
struct QuantizeX : Quantizer<Src, INT8> { static constexpr bool ON = true; };

// WgmmaSp: generated per (TILE_T, dtype) - mma(acc, desc_a, desc_b, metadata), m64 x TILE_T x
// k32 (16-bit inputs) or k64 (e4m3, int8: IN_BYTES 1, the same bytes per product); its Acc
// is float, or int for int8. Mma and Elem are the output's (bf16 for e4m3, int32 for int8;
// SCALED: the scales' bf16 or fp16, for either).
template <class WgmmaSp, class Mma, class Elem, int TILE_T, int CONSUMERS, int STAGES, int CLUSTER, int IN_BYTES = 2,
          class Epi = NoEpilogue, bool SCALED = false, class Quant = NoQuantize, int GROUPS = 1>
struct Sp24DdsTma {
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  using Acc = typename WgmmaSp::Acc;
  static constexpr bool INT_OUT = sizeof(Elem) == 4;  // int8: int32 Y, stored straight from registers
  static constexpr int TILE_W = 64 * CONSUMERS, ACC = TILE_T / 2, STAGE_K = 128 / IN_BYTES;
  static constexpr int META_TILES = STAGE_K / 32, META_ROW = META_TILES * 64;  // k32 tiles a stage, per 16 rows
  static constexpr int X_BYTES = TILE_T * 128, W_BYTES = TILE_W * 64, META_BYTES = (TILE_W / 16) * META_ROW;
  static constexpr int STAGE_BYTES = X_BYTES + W_BYTES + META_BYTES, X_PART = X_BYTES / CLUSTER;
  // Big accumulators (TILE_T 256: 128 floats a thread) want more than an even share of the
  // registers; small ones are better off with two blocks an SM, so they keep what ptxas gives.
  static constexpr bool REBALANCE = ACC >= 128;
  // The store goes through shared memory 64 tokens at a time (per consumer, rows of 64
  // features, 128 bytes, per token); small tiles stage 32 so that two blocks fit an SM.
  using Store = TransposedStore<Mma, Elem, TILE_T, TILE_T >= 128 ? 64 : 32, Epi>;
  static constexpr int STAGING_BYTES = CONSUMERS * Store::BYTES;
  static_assert(TILE_T % 16 == 0 && TILE_T <= 256, "tile shape");
  static_assert(X_PART % 1024 == 0 && W_BYTES % 1024 == 0, "swizzle atoms stay 1024-aligned");
  // xq: per stage X's 16-bit box (TILE_T rows of STAGE_K values, unswizzled), on a barrier of its own
  static constexpr bool XQ = Quant::ON;
  static constexpr int X16_BYTES = XQ ? TILE_T * STAGE_K * 2 : 0, X16_ROW = STAGE_K * 2;
  static_assert(!XQ || (CLUSTER == 1 && !REBALANCE && IN_BYTES == 1 && SCALED), "xq: one-byte scaled, small tiles");
  static_assert(GROUPS == 1 || !XQ, "grouped products take quantized X");

  // K-major operand descriptor: rows of `row_bytes` (64 or 128) with the matching swizzle;
  // 8-row groups are 8 rows apart (the leading offset is unused when swizzled).
  template <int ROW_BYTES>
  __device__ static u64 descriptor(u32 addr) {
    constexpr u64 layout = ROW_BYTES == 128 ? 1 : 2;
    return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(1) << 16) |
           (static_cast<u64>(8 * ROW_BYTES >> 4) << 32) | (layout << 62);
  }

  __device__ static void produce(const TensorMap* x_map, const TensorMap* w_map, const TensorMap* m_map,
                                 u32 smem, u32 bars, int s0, int stages, int k_begin, int m0, int n0, u32 rank) {
    for (int s = s0; s < s0 + stages; ++s) {
      const int buf = s % STAGES, k = k_begin + (s - s0) * STAGE_K;
      const u32 full = bars + 8 * buf, stage = smem + buf * STAGE_BYTES;
      const u32 empty = bars + 8 * (STAGES + buf);
      const int emptied = ((s / STAGES) & 1) ^ 1;  // fresh barriers count as emptied
      mbar_wait(empty, emptied);
      mbar_expect_bytes(full, STAGE_BYTES);  // boxes past the edges are zero-filled, counted in full
      if constexpr (CLUSTER == 1)
        tma_load_2d(stage, x_map, k, m0, full);
      else  // this block's share of the X rows, to every block of the cluster
        tma_load_2d_multicast(stage + rank * X_PART, x_map, k, m0 + rank * (TILE_T / CLUSTER), full, (1 << CLUSTER) - 1);
      tma_load_2d(stage + X_BYTES, w_map, k / 2, n0, full);
      tma_load_2d(stage + X_BYTES + W_BYTES, m_map, k / 2, n0 / 16, full);  // 16 words per k32 = k / 2
    }
  }

  // xq, thread 0: stage s's copies - W and its metadata onto the full barrier, whose one
  // arrival is the warpgroup's once the X bytes are written, and the 16-bit X box onto its own.
  __device__ static void issue_quantized(const TensorMap* x_map, const TensorMap* w_map, const TensorMap* m_map,
                                         u32 smem, u32 x16, u32 bars, int s, int k, int n0) {
    const int buf = s % STAGES;
    const u32 full = bars + 8 * buf, stage = smem + buf * STAGE_BYTES, landed = bars + 8 * (2 * STAGES + buf);
    mbar_wait(bars + 8 * (STAGES + buf), ((s / STAGES) & 1) ^ 1);
    mbar_expect_tx(full, W_BYTES + META_BYTES);
    mbar_expect_bytes(landed, X16_BYTES);
    tma_load_2d(x16 + buf * X16_BYTES, x_map, k, 0, landed);
    tma_load_2d(stage + X_BYTES, w_map, k / 2, n0, full);
    tma_load_2d(stage + X_BYTES + W_BYTES, m_map, k / 2, n0 / 16, full);
  }

  // xq, one of the producer warpgroup's warps 1-3: stage s's 16-bit X to bytes, 16 values a
  // lane step, each into its 16-byte chunk of TMA's 128-byte swizzle (chunk c of row r at
  // c ^ (r % 8)); then the stage is full. Each warp takes every third buffer, so three stages
  // convert at once (one warpgroup converting stage after stage was slower than W's copies).
  // Rows past M stay zero: written at a buffer's first use only (s < STAGES). Columns past K
  // were zero-filled in the box: their bytes are zeros.
  static constexpr int CONVERTERS = 3;
  __device__ static void quantize_stage(unsigned char* ring, const unsigned char* x16, u32 bars, int s,
                                        const float* scales, int M) {
    constexpr int CHUNKS = STAGE_K / 16;
    const int buf = s % STAGES, lane = threadIdx.x & 31, rows = s < STAGES ? TILE_T : M;
    mbar_wait(bars + 8 * (2 * STAGES + buf), (s / STAGES) & 1);
    const unsigned char* box = x16 + buf * X16_BYTES;
    unsigned char* x = ring + buf * STAGE_BYTES;
    for (int j = lane; j < rows * CHUNKS; j += 32) {
      const int r = j / CHUNKS, c = j % CHUNKS;
      uint4 bytes = make_uint4(0, 0, 0, 0);
      if (r < M) {
        const uint4* src = reinterpret_cast<const uint4*>(box + r * X16_ROW + c * 32);
        const uint2 lo = Quant::bytes8(src[0], scales[r]), hi = Quant::bytes8(src[1], scales[r]);
        bytes = make_uint4(lo.x, lo.y, hi.x, hi.y);
      }
      *reinterpret_cast<uint4*>(x + r * 128 + ((c ^ (r & 7)) << 4)) = bytes;
    }
    fence_proxy_async();  // each lane's generic writes, before wgmma (the async proxy) reads them
    __syncwarp();
    if (lane == 0) mbar_arrive(bars + 8 * buf);
  }

  // xq, the producer warpgroup on an item's stages: lane 0 of warp 0 issues the copies (from
  // stage `issued` on: those before went out before the scales were known), as far ahead as
  // the ring allows; warps 1-3 quantize the stages of their buffers once their boxes landed.
  // Neither waits for the other but through the ring: a stage is released once the next one
  // is full too, and its box was issued before.
  __device__ static void produce_quantized(const TensorMap* x_map, const TensorMap* w_map, const TensorMap* m_map,
                                           unsigned char* ring, u32 smem, const unsigned char* x16_ring, u32 x16,
                                           u32 bars, int s0, int stages, int issued, int k_begin, int n0,
                                           const float* scales, int M) {
    const int warp = threadIdx.x / 32;
    if (threadIdx.x == 0) {
      for (int i = issued; i < stages; ++i)
        issue_quantized(x_map, w_map, m_map, smem, x16, bars, s0 + i, k_begin + i * STAGE_K, n0);
    } else if (warp > 0) {
      for (int s = s0; s < s0 + stages; ++s)
        if ((s % STAGES) % CONVERTERS == warp - 1) quantize_stage(ring, x16_ring, bars, s, scales, M);
    }
  }

  // xq, every thread: the tokens' scales over the whole of K (or the static one), into
  // `scales` [TILE_T]; `bits` holds the largest magnitudes meanwhile (non-negative floats,
  // NaN above infinity, order as their bits). Each warp takes runs of 32 16-byte pieces of a
  // row, UNROLL runs' loads in flight at once, and reduces each run to one atomic.
  __device__ static void token_scales(const unsigned short* x, const float* static_scale, int M, int K, float* scales,
                                      unsigned* bits) {
    constexpr int UNROLL = 8, WARPS = THREADS / 32;
    if (static_scale) {
      for (int t = threadIdx.x; t < TILE_T; t += THREADS) scales[t] = *static_scale;
      __syncthreads();
      return;
    }
    for (int t = threadIdx.x; t < TILE_T; t += THREADS) bits[t] = 0;
    __syncthreads();
    const int pieces = K / 8, runs = (pieces + 31) / 32, lane = threadIdx.x & 31, total = M * runs;
    // Every block reads all of X at once: each starts at its own run, so that they do not all
    // ask the same L2 slice for the same lines at the same time.
    const int shift = static_cast<int>((blockIdx.x + (long long)blockIdx.z * gridDim.x) * 61 % total);
    for (int first = threadIdx.x / 32; first < total; first += WARPS * UNROLL) {
      float amax[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int at = first + u * WARPS, run = at + shift < total ? at + shift : at + shift - total;
        const int row = run / runs, piece = (run - row * runs) * 32 + lane;
        amax[u] = at < total && piece < pieces
            ? Quant::largest_of8(reinterpret_cast<const uint4*>(x + (long long)row * K)[piece]) : 0.f;
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int at = first + u * WARPS, run = at + shift < total ? at + shift : at + shift - total;
        if (at >= total) break;  // (at, run: the same for the whole warp)
        const unsigned most = __reduce_max_sync(0xffffffffu, __float_as_uint(amax[u]));
        if (lane == 0) atomicMax(bits + run / runs, most);
      }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < TILE_T; t += THREADS) scales[t] = Quant::scale_of(__uint_as_float(bits[t]));
    __syncthreads();
  }

  // Consumer warpgroup c (rows 64c.. of the W tile): the metadata words of stage `stage`,
  // each warp those of its 16 rows, as mma.sp reads them (sg_mma.cuh's sparse_metadata).
  __device__ static void load_meta(u32 stage, int c, u32 (&e)[2]) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const u32 meta = stage + X_BYTES + W_BYTES + (4 * c + warp) * META_ROW;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      e[j] = sparse_metadata<STAGE_K / 2>(meta + META_ROW / 2 * j, lane);  // two products a stage
      // Past N or K the copies were zero-filled: values 0, but metadata 0 names position 0
      // twice (undefined). Packed words never are 0 (a nibble's positions increase), so
      // such a word becomes positions {0, 1}. No branch around the wgmma: a divergent
      // path makes ptxas serialize every wgmma of the kernel.
      e[j] = e[j] ? e[j] : 0x44444444u;
    }
  }

  // The stage's two products (k32, or k64 for e4m3), issued and committed as one group.
  __device__ static void stage_products(u32 stage, int c, Acc (&acc)[ACC], const u32 (&e)[2]) {
    pin(acc);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 2; ++j)
      WgmmaSp::mma(acc, descriptor<64>(stage + X_BYTES + c * 64 * 64 + 32 * j), descriptor<128>(stage + 64 * j), e[j]);
    wgmma_commit();
    pin(acc);
  }

  __device__ static u32 wait_stage(u32 smem, u32 bars, int s) {
    const int buf = s % STAGES;
    mbar_wait(bars + 8 * buf, (s / STAGES) & 1);
    return smem + buf * STAGE_BYTES;
  }

  __device__ static void init_landed(u32 bars) {
    for (int i = 0; i < STAGES; ++i) mbar_init(bars + 8 * (2 * STAGES + i), 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }

  // Keeps metadata registers live (so unreused) until here.
  __device__ static void keep(const u32 (&e)[2]) { asm volatile("" ::"r"(e[0]), "r"(e[1]) : "memory"); }

  // Buffer s % STAGES is read: tell this block's producer, and with a cluster every block's
  // (each multicasts into it).
  __device__ static void release(u32 bars, int s) {
    if (threadIdx.x % 128 != 0) return;
    const u32 empty = bars + 8 * (STAGES + s % STAGES);
    if constexpr (CLUSTER == 1)
      mbar_arrive(empty);
    else
#pragma unroll
      for (int cta = 0; cta < CLUSTER; ++cta) mbar_arrive_cluster(empty, cta);
  }

  // Stages in pairs, with one group of products in flight while the next stage is waited
  // for. The tensor cores read the metadata registers while the products run, not when
  // they are issued (seen on an H200: a word reloaded while its stage was in flight
  // corrupted that stage's second product), so even stages use `even`, odd ones `odd`, and
  // each pair stays live until its stage is known finished (wait_group 1 in the next
  // stage). tests/test_compile.py checks the SASS for it. A loop that swaps one pair of
  // registers per stage instead makes ptxas serialize every wgmma.
  // Stages s0 .. s0 + stages - 1 of the block's running count (buffer and barrier phase).
  __device__ static void consume(u32 smem, u32 bars, int s0, int stages, int c, Acc (&acc)[ACC]) {
    u32 even[2], odd[2];
    int s = s0;
    for (; s + 1 < s0 + stages; s += 2) {
      u32 stage = wait_stage(smem, bars, s);
      load_meta(stage, c, even);
      stage_products(stage, c, acc, even);
      wgmma_wait<1>();  // stage s-1 is finished: its buffer goes back to the producer
      if (s > s0) keep(odd), release(bars, s - 1);
      stage = wait_stage(smem, bars, s + 1);
      load_meta(stage, c, odd);
      stage_products(stage, c, acc, odd);
      wgmma_wait<1>();
      keep(even), release(bars, s);
    }
    if (s < s0 + stages) {  // an odd count: the last stage (stage s-1, in flight, used `odd`)
      const u32 stage = wait_stage(smem, bars, s);
      load_meta(stage, c, even);
      stage_products(stage, c, acc, even);
    }
    wgmma_wait<0>();
    // The buffers not given back yet, so the producer can fill them with the next tile's
    // stages during the store: the last one, and with an odd count the one before it.
    if ((stages & 1) && stages > 1) release(bars, s0 + stages - 2);
    release(bars, s0 + stages - 1);
  }

  // fn(token, feature, value) for each accumulator of consumer c inside M x N (warp w holds
  // rows 16w.. of the consumer's 64 features, per n8 tile of tokens as mma.sync's m16n8).
  template <class V, class Fn>
  __device__ static void for_each_output(const V (&acc)[ACC], int m0, int n0, int M, int N, int c, Fn fn) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < TILE_T / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int f = n0 + c * 64 + warp * 16 + g + 8 * (i >> 1), t = m0 + 8 * j + 2 * q + (i & 1);
        if (f < N && t < M) fn(t, f, acc[4 * j + i]);
      }
  }

  // Split K: consumer c's partial tile of Y^T (its 64 features, TILE_T tokens) goes to its
  // split's slice of the float32 workspace; the tile's last split writes Y (sg_split_k.cuh).
  // `flag`: a word of the consumer's staging buffer, which the split path does not otherwise use.
  template <class V>
  __device__ static void add_split(const V (&acc)[ACC], float* sums, int* counts, const Elem* bias, Elem* y,
                                   u32 flag, int m0, int n0, int M, int N, int c) {
    using Split = SplitK<128>;
    for_each_output(acc, m0, n0, M, N, c,
                    [&](int t, int f, V v) { Split::put(sums, t, f, M, N, static_cast<float>(v)); });
    const int tiles_w = ((N + TILE_W - 1) / TILE_W + CLUSTER - 1) / CLUSTER * CLUSTER;  // as Raster's groups
    int* count = counts + ((m0 / TILE_T) * tiles_w + n0 / TILE_W) * CONSUMERS + c;
    if (!Split::last_to_arrive(count, gridDim.z, flag, c + 2))
      return;
    const auto bias_at = [&](int f) { return bias ? Mma::to_float(bias[f]) : 0.f; };
    if constexpr (Epi::kGated)
      Split::finish_gated(sums, count, y, m0, TILE_T, n0 + 64 * c, 64, M, N, bias_at, [](float gate, float up) {
        return static_cast<Elem>(Mma::pack(Epi::gated(gate, up), 0.f) & 0xFFFF);
      });
    else
      Split::finish(sums, count, y, m0, TILE_T, n0 + 64 * c, 64, M, N, bias_at,
                    [](float v) { return static_cast<Elem>(Mma::pack(Epi::act(v), 0.f) & 0xFFFF); });
  }

  // int32 Y (int8 inputs; the host never splits K for them) straight from the registers:
  // 8 features of 4 tokens a warp store, whole 32-byte sectors.
  __device__ static void store_int(const Acc (&acc)[ACC], const Elem* bias, Elem* y, int m0, int n0, int M, int N,
                                   int c) {
    for_each_output(acc, m0, n0, M, N, c,
                    [&](int t, int f, Acc v) { y[(long long)t * N + f] = v + (bias ? bias[f] : 0); });
  }

  // SCALED: consumer c's sums times their tokens' and features' scales, in place (the index
  // mapping of for_each_output); the array then holds floats whatever Acc is.
  using Floats = float[ACC];
  __device__ static Floats& rescale(Acc (&acc)[ACC], Scales scales, int m0, int n0, int M, int N, int c) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, f = n0 + c * 64 + warp * 16 + (lane >> 2);
    const float feature[2] = {scales.of_feature(f, N), scales.of_feature(f + 8, N)};
#pragma unroll
    for (int j = 0; j < TILE_T / 8; ++j)
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const float token = scales.of_token(m0 + 8 * j + 2 * (lane & 3) + p, M);
        scale_in_place(acc[4 * j + p], token * feature[0]);
        scale_in_place(acc[4 * j + 2 + p], token * feature[1]);
      }
    return reinterpret_cast<Floats&>(acc);
  }

  // A finished tile of consumer c to Y (through the split-K workspace when `partial`).
  template <class V>
  __device__ static void write(const V (&acc)[ACC], float* partial, int* tile_counts, const Elem* bias, Elem* y,
                               u32 staging, int m0, int n0, int M, int N, int c) {
    if (partial)
      add_split(acc, partial, tile_counts, bias, y, staging, m0, n0, M, N, c);
    else if constexpr (INT_OUT)
      store_int(acc, bias, y, m0, n0, M, N, c);
    else
      Store::store(staging, acc, bias, y, m0, n0 + c * 64, M, N, c + 2);
  }

  // Work items: CLUSTER neighbouring W tiles of one token tile, one per block of a cluster.
  // Items go GROUP_T token tiles at a time, token tile fastest, so the blocks running at once
  // share a few X tiles and a few W tiles: both stay in L2 instead of W streaming from DRAM
  // once per token tile (memory traffic costs power, and this kernel is power-bound).
  struct Raster {
    static constexpr int GROUP_T = 8;
    int tiles_t, groups_n, items;
    __device__ Raster(int M, int N)
        : tiles_t((M + TILE_T - 1) / TILE_T), groups_n(((N + TILE_W - 1) / TILE_W + CLUSTER - 1) / CLUSTER),
          items(tiles_t * groups_n) {}
    __device__ int rows(int item) const {  // token tiles in item's group (the last may have fewer)
      const int first = item / (GROUP_T * groups_n) * GROUP_T;
      return min(GROUP_T, tiles_t - first);
    }
    __device__ int m0(int item) const {
      return (item / (GROUP_T * groups_n) * GROUP_T + item % (GROUP_T * groups_n) % rows(item)) * TILE_T;
    }
    __device__ int n0(int item, u32 rank) const {
      return (item % (GROUP_T * groups_n) / rows(item) * CLUSTER + rank) * TILE_W;
    }
  };

  __device__ static void run(const TensorMap* x_map, const TensorMap* w_map, const TensorMap* m_map, Scales scales,
                             const Elem* bias, Elem* y, float* partial, int* tile_counts, int M, int K, int N,
                             int k_split, const unsigned short* x16 = nullptr) {
    static_assert(GROUPS == 1, "grouped products start at run_groups");
    const Groups<1> one{{w_map}, {m_map}, {scales.feature}, {0, N}};
    run_groups(x_map, one, scales.token, bias, y, partial, tile_counts, M, K, N, k_split, x16);
  }

  __device__ static void run_groups(const TensorMap* x_map, const Groups<GROUPS>& groups, const float* x_scale,
                                    const Elem* bias, Elem* y, float* partial, int* tile_counts, int M, int K, int N,
                                    int k_split, const unsigned short* x16 = nullptr) {
    const TensorMap *w_map = groups.w[0], *m_map = groups.m[0];  // (xq: the only group)
    Scales scales{x_scale, groups.feature[0]};
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = smem_ptr(smem_raw), smem = (base + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
    const u32 staging = smem + STAGES * STAGE_BYTES, x16_ring = staging + STAGING_BYTES;
    const u32 bars = x16_ring + STAGES * X16_BYTES;  // full[STAGES], empty[STAGES] (xq: landed[STAGES])
    const u32 rank = CLUSTER == 1 ? 0 : cluster_rank();
    const Raster raster(M, N);
    const int first = blockIdx.x / CLUSTER, step = gridDim.x / CLUSTER;
    const int k_begin = blockIdx.z * k_split, k_end = min(K, k_begin + k_split), wg = threadIdx.x / 128;
    const int stages = (k_end - k_begin + STAGE_K - 1) / STAGE_K;
    if (threadIdx.x == 0) {
      start_ring(bars, STAGES, CONSUMERS * CLUSTER, x_map, w_map, m_map);
      if constexpr (XQ) init_landed(bars);
    }
    if constexpr (CLUSTER == 1) __syncthreads(); else cluster_sync();  // partners' barriers are ready
    int s0 = 0;  // the block's running stage count
    if constexpr (XQ) {
      __shared__ float token_scale[TILE_T];
      __shared__ unsigned largest[TILE_T];
      unsigned char* ring = smem_raw + (smem - base);
      const int early = first < raster.items ? min(stages, STAGES) : 0;  // W's first copies, before the scales
      if (threadIdx.x == 0)
        for (int i = 0; i < early; ++i)
          issue_quantized(x_map, w_map, m_map, smem, x16_ring, bars, i, k_begin + i * STAGE_K, raster.n0(first, 0));
      token_scales(x16, scales.token, M, K, token_scale, largest);
      scales.token = token_scale;
      if (wg == 0) {
        for (int item = first; item < raster.items; item += step, s0 += stages)
          produce_quantized(x_map, w_map, m_map, ring, smem, ring + (x16_ring - smem), x16_ring, bars, s0, stages,
                            item == first ? early : 0, k_begin, raster.n0(item, 0), token_scale, M);
        return;
      }
    } else if (wg == 0) {
      // The producer needs few registers: hand them to the consumers' accumulators.
      if constexpr (REBALANCE) RegisterSplit<THREADS>::producer();
      if (threadIdx.x == 0)
        for (int item = first; item < raster.items; item += step, s0 += stages) {
          const int n0 = raster.n0(item, rank), g = groups.of(n0);
          produce(x_map, groups.w[g], groups.m[g], smem, bars, s0, stages, k_begin, raster.m0(item), n0 - groups.start[g],
                  rank);
        }
    }
    if (wg > 0) {
      if constexpr (REBALANCE) RegisterSplit<THREADS>::consumer();
      for (int item = first; item < raster.items; item += step, s0 += stages) {
        const int m0 = raster.m0(item), n0 = raster.n0(item, rank);
        const int c = wg - 1;
        Acc acc[ACC] = {};
        consume(smem, bars, s0, stages, c, acc);
        const u32 own = staging + c * Store::BYTES;
        if constexpr (SCALED) {  // (the group's scales, by its own feature index)
          const int g = groups.of(n0), at = groups.start[g];
          const Scales own_scales{scales.token, groups.feature[g]};
          write(rescale(acc, own_scales, m0, n0 - at, M, groups.start[g + 1] - at, c), partial, tile_counts, bias, y,
                own, m0, n0, M, N, c);
        }
        else
          write(acc, partial, tile_counts, bias, y, own, m0, n0, M, N, c);
      }
    }
    // No block may leave while another still arrives on its barriers or copies into it.
    if constexpr (CLUSTER > 1) cluster_sync();
  }
};

}  // namespace sg
