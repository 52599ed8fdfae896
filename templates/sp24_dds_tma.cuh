// 2:4 semi-structured Y = X W^T (+ bias) on Hopper's sparse warpgroup MMA (wgmma.mma_async.sp,
// sm_90a), fed by TMA. As in sp24_dds.cuh the sparse operand is A, so the kernel computes
// Y^T = W X^T: each consumer warpgroup owns 64 rows of W (output features) and all TILE_T
// rows of X (tokens) of the block's tile; warpgroup 0 is the producer.
//
// One stage covers 64 of K: W's 32 kept values per row (64-byte rows, 64-byte swizzle), X's
// 64 columns (128-byte rows, 128-byte swizzle) and the metadata words of the two k32 tiles
// (layouts/semi24.py's layout, copied as it is: wgmma.sp reads metadata exactly as mma.sp
// m16n8k32 does, warp w of a warpgroup for rows 16w..16w+15). The accumulators go through
// shared memory so that Y [M, N] is written in its own row-major layout - no transpose pass.
#pragma once
#include "bsr_dds_wgmma.cuh"
#include "sg_tma.cuh"

namespace sg {

// WgmmaSp: generated per (TILE_T, dtype) - mma(acc, desc_a, desc_b, metadata), m64 x TILE_T x k32.
template <class WgmmaSp, class Mma, class Elem, int TILE_T, int CONSUMERS, int STAGES>
struct Sp24DdsTma {
  static constexpr int THREADS = 128 * (CONSUMERS + 1), CONSUMER_THREADS = 128 * CONSUMERS;
  static constexpr int TILE_W = 64 * CONSUMERS, ACC = TILE_T / 2, STAGE_K = 64;
  static constexpr int X_BYTES = TILE_T * 128, W_BYTES = TILE_W * 64, META_BYTES = (TILE_W / 16) * 128;
  static constexpr int STAGE_BYTES = X_BYTES + W_BYTES + META_BYTES;
  static constexpr int OUT_STRIDE = TILE_W + 8;  // staged output row, padded against bank conflicts
  static_assert(TILE_T % 8 == 0 && TILE_T <= 256 && TILE_T * OUT_STRIDE * 2 <= STAGES * STAGE_BYTES, "tile shape");
  static_assert(X_BYTES % 1024 == 0 && W_BYTES % 1024 == 0, "swizzle atoms stay 1024-aligned");

  // K-major operand descriptor: rows of `row_bytes` (64 or 128) with the matching swizzle;
  // 8-row groups are 8 rows apart (the leading offset is unused when swizzled).
  template <int ROW_BYTES>
  __device__ static u64 descriptor(u32 addr) {
    constexpr u64 layout = ROW_BYTES == 128 ? 1 : 2;
    return static_cast<u64>((addr & 0x3FFFF) >> 4) | (static_cast<u64>(1) << 16) |
           (static_cast<u64>(8 * ROW_BYTES >> 4) << 32) | (layout << 62);
  }

  __device__ static void produce(const TensorMap* x_map, const TensorMap* w_map, const TensorMap* m_map,
                                 u32 smem, u32 bars, int stages, int k_begin, int m0, int n0) {
    for (int s = 0; s < stages; ++s) {
      const int buf = s % STAGES, k = k_begin + s * STAGE_K;
      const u32 full = bars + 8 * buf, stage = smem + buf * STAGE_BYTES;
      mbar_wait(bars + 8 * (STAGES + buf), ((s / STAGES) & 1) ^ 1);  // fresh barriers count as emptied
      mbar_expect_bytes(full, STAGE_BYTES);  // boxes past the edges are zero-filled, counted in full
      tma_load_2d(stage, x_map, k, m0, full);
      tma_load_2d(stage + X_BYTES, w_map, k / 2, n0, full);
      tma_load_2d(stage + X_BYTES + W_BYTES, m_map, k / 2, n0 / 16, full);  // 16 words per k32 = k / 2
    }
  }

  // Consumer warpgroup c (rows 64c.. of the W tile): the metadata words of stage `stage`.
  // Lanes 4g + h (h = 0, 1) supply word 2g + h of their warp's 16-row tile (sparsity
  // selector 0); the other two lanes pass the same.
  __device__ static void load_meta(u32 stage, int c, u32 (&e)[2]) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const u32 meta = stage + X_BYTES + W_BYTES + (4 * c + warp) * 128;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(e[j]) : "r"(meta + 4 * (16 * j + 2 * (lane >> 2) + (lane & 1))));
      // Past N or K the copies were zero-filled: values 0, but metadata 0 names position 0
      // twice (undefined). Packed words never are 0 (a nibble's positions increase), so
      // such a word becomes positions {0, 1}. No branch around the wgmma: a divergent
      // path makes ptxas serialize every wgmma of the kernel.
      e[j] = e[j] ? e[j] : 0x44444444u;
    }
  }

  // The stage's two k32 products, issued and committed as one group.
  __device__ static void stage_products(u32 stage, int c, float (&acc)[ACC], const u32 (&e)[2]) {
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

  // Keeps metadata registers live (so unreused) until here.
  __device__ static void keep(const u32 (&e)[2]) { asm volatile("" ::"r"(e[0]), "r"(e[1]) : "memory"); }

  __device__ static void release(u32 bars, int s) {
    if (threadIdx.x % 128 == 0) mbar_arrive(bars + 8 * (STAGES + s % STAGES));
  }

  // Stages in pairs, with one group of products in flight while the next stage is waited
  // for. The tensor cores read the metadata registers while the products run, not when
  // they are issued (seen on an H200: a word reloaded while its stage was in flight
  // corrupted that stage's second product), so even stages use `even`, odd ones `odd`, and
  // each pair stays live until its stage is known finished (wait_group 1 in the next
  // stage). tests/test_compile.py checks the SASS for it. A loop that swaps one pair of
  // registers per stage instead makes ptxas serialize every wgmma.
  __device__ static void consume(u32 smem, u32 bars, int stages, int c, float (&acc)[ACC]) {
    u32 even[2], odd[2];
    int s = 0;
    for (; s + 1 < stages; s += 2) {
      u32 stage = wait_stage(smem, bars, s);
      load_meta(stage, c, even);
      stage_products(stage, c, acc, even);
      wgmma_wait<1>();  // stage s-1 is finished: its buffer goes back to the producer
      if (s > 0) keep(odd), release(bars, s - 1);
      stage = wait_stage(smem, bars, s + 1);
      load_meta(stage, c, odd);
      stage_products(stage, c, acc, odd);
      wgmma_wait<1>();
      keep(even), release(bars, s);
    }
    if (s < stages) {  // an odd count: the last stage (stage s-1, in flight, used `odd`)
      const u32 stage = wait_stage(smem, bars, s);
      load_meta(stage, c, even);
      stage_products(stage, c, acc, even);
    }
    wgmma_wait<0>();
  }

  // acc holds Y^T rows (features) 16w + g (+8) and columns (tokens) 8j + 2q (+1): written
  // transposed into a [TILE_T][TILE_W] tile in the drained ring, then copied out by rows.
  __device__ static void store(unsigned char* smem_raw, float (&acc)[ACC], const Elem* bias, Elem* y,
                               int m0, int n0, int M, int N, int c) {
    Elem* out = reinterpret_cast<Elem*>(smem_raw);
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, g = lane >> 2, q = lane & 3;
    named_barrier_sync();  // every consumer is done reading the ring
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int f = c * 64 + warp * 16 + g + 8 * half;
      const float b = bias && n0 + f < N ? Mma::to_float(bias[n0 + f]) : 0.f;
#pragma unroll
      for (int j = 0; j < TILE_T / 8; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const u32 packed = Mma::pack(acc[4 * j + 2 * half + i] + b, 0.f);
          out[(8 * j + 2 * q + i) * OUT_STRIDE + f] = static_cast<Elem>(packed & 0xFFFF);
        }
    }
    named_barrier_sync();
    const int tid = threadIdx.x - 128;
    for (int i = tid; i < TILE_T * (TILE_W / 8); i += CONSUMER_THREADS) {
      const int t = i / (TILE_W / 8), col = i % (TILE_W / 8);
      if (m0 + t < M && n0 + 8 * col < N)
        *reinterpret_cast<uint4*>(y + (long long)(m0 + t) * N + n0 + 8 * col) =
            *reinterpret_cast<const uint4*>(out + t * OUT_STRIDE + 8 * col);
    }
  }

  // Split K: the block's partial tile of Y^T is added into a float32 buffer.
  __device__ static void add_partial(float (&acc)[ACC], float* partial, int m0, int n0, int M, int N, int c) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int j = 0; j < TILE_T / 8; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int f = n0 + c * 64 + warp * 16 + g + 8 * (i >> 1), t = m0 + 8 * j + 2 * q + (i & 1);
        if (f < N && t < M) atomicAdd(partial + (long long)t * N + f, acc[4 * j + i]);
      }
  }

  // Only the consumer warpgroups (barrier 1; 0 is __syncthreads').
  __device__ static void named_barrier_sync() {
    asm volatile("bar.sync 1, %0;\n" ::"n"(CONSUMER_THREADS) : "memory");
  }

  __device__ static void run(const TensorMap* x_map, const TensorMap* w_map, const TensorMap* m_map,
                             const Elem* bias, Elem* y, float* partial, int M, int K, int N, int k_split) {
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = smem_ptr(smem_raw), smem = (base + 1023) & ~1023u;  // swizzle atoms are 1024-aligned
    unsigned char* ring = smem_raw + (smem - base);
    const u32 bars = smem + STAGES * STAGE_BYTES;  // full[STAGES], then empty[STAGES]
    const int n0 = blockIdx.x * TILE_W, m0 = blockIdx.y * TILE_T, wg = threadIdx.x / 128;
    const int k_begin = blockIdx.z * k_split, k_end = min(K, k_begin + k_split);
    const int stages = (k_end - k_begin + STAGE_K - 1) / STAGE_K;
    if (threadIdx.x == 0) {
      for (int i = 0; i < STAGES; ++i) {
        mbar_init(bars + 8 * i, 1);
        mbar_init(bars + 8 * (STAGES + i), CONSUMERS);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
      tma_prefetch_map(x_map);
      tma_prefetch_map(w_map);
      tma_prefetch_map(m_map);
    }
    __syncthreads();
    if (wg == 0) {
      if (threadIdx.x == 0) produce(x_map, w_map, m_map, smem, bars, stages, k_begin, m0, n0);
      return;
    }
    float acc[ACC] = {};
    consume(smem, bars, stages, wg - 1, acc);
    if (partial)
      add_partial(acc, partial, m0, n0, M, N, wg - 1);
    else
      store(ring, acc, bias, y, m0, n0, M, N, wg - 1);
  }
};

}  // namespace sg
