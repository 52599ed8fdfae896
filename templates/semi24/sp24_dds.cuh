// 2:4 semi-structured Y = X W^T (+ bias) on the sparse tensor-core instruction mma.sp
// (sm_80 and later). The sparse operand of mma.sp is A, so the kernel computes
// Y^T = W X^T: W [N, K] 2:4 (values [N, K/2], metadata as layouts/semi24.py packs it) is A,
// X [M, K] row-major is exactly the column-major B. Each threadblock owns TILE_W rows of W
// (output features) and TILE_T rows of X (tokens); the accumulators are staged through
// shared memory so that Y [M, N] is written in its own row-major layout, 16 bytes at a time
// - no transpose pass.
#pragma once
#include "sg_split_k.cuh"

namespace sg {

// Chunk i = threadIdx.x, + THREADS, ... below CHUNKS: a trip count known at compile time, so
// the loop unrolls. A chunk past a row or K copies 0 bytes (cp.async's src-size: zero-filled),
// so its address is never dereferenced and needs no clamping.
template <int CHUNKS, int THREADS, class Body>
__device__ __forceinline__ void for_chunks(Body body) {
#pragma unroll
  for (int r = 0; r < (CHUNKS + THREADS - 1) / THREADS; ++r) {
    const int i = threadIdx.x + r * THREADS;
    if (CHUNKS % THREADS == 0 || i < CHUNKS) body(i);
  }
}

// Float outputs (16-bit Y from float accumulators), rounded by Mma's conversions.
template <class Mma>
struct FloatOut {
  using T = u16;
  using Acc = float;
  __device__ static Acc bias(T b) { return Mma::to_float(b); }
  __device__ static T convert(Acc v) { return static_cast<T>(Mma::pack(v, 0.f) & 0xFFFF); }
};

// int8 inputs: int32 accumulators written as they are (exact).
struct Int32Out {
  using T = int;
  using Acc = int;
  __device__ static Acc bias(T b) { return b; }
  __device__ static T convert(Acc v) { return v; }
};

// W's kept values as stored ([N, K/2], 16-bit or one-byte): a stage's 128 bytes of each row,
// swizzled, read into mma.sp's A fragments by ldmatrix. (sg_int4.cuh's Int4Values: 4-bit ones.)
template <class Elem, int TILE_W, int THREADS>
struct KeptValues {
  using Source = const Elem*;
  static constexpr int BYTES = TILE_W * 128, EPC = 16 / sizeof(Elem);

  struct RowScales {};  // (none: the values are the weights)

  __device__ static void load(u32 smem, Source values, int n0, int k0, int K, int N, int k_end) {
    for_chunks<TILE_W * 8, THREADS>([&](int i) {
      const int row = i >> 3, c = i & 7;
      const Elem* at = values + (long long)(n0 + row) * (K / 2) + EPC * c;  // (the same every stage)
      cp_async16(swizzled(smem, row, c), at + k0 / 2, n0 + row < N && k0 + 2 * EPC * c < k_end);
    });
  }

  __device__ static RowScales row_scales(u32, int, int) { return {}; }

  // Rows row.. row + 15 of the tile, instruction step j of the stage.
  __device__ static void fragment(u32 (&a)[4], u32 smem, int row, int j, int lane, RowScales) {
    ldmatrix_x4(a, swizzled(smem, row + (lane & 15), 2 * j + (lane >> 4)));
  }
};

// SpMma::K is the instruction's dense K: 32 for 16-bit types (m16n8k32), 64 for one-byte
// ones (m16n8k64). Their operands occupy the same bytes (A 16 x 32 bytes kept, B 8 x 32 or
// 8 x 64 bytes), so loads and ldmatrix are shared; only the metadata doubles per step.
// SpMma::Acc is what the instruction accumulates (int for int8), Out::Acc what the store
// takes: the same, except SCALED (one-byte products dequantized by Scales into float Y).
// WARPS_K > 1 splits each stage's instruction steps among that many warps of the same W rows
// and tokens (more warps in flight for a decode tile whose W stage is small, without more
// shared memory); their sums meet in shared memory before the store (sum_k_warps).
template <class SpMma, class Out, class Elem, int TILE_T, int WARPS_W, int WARPS_T, int STAGES,
          class Epi = NoEpilogue, bool SCALED = false,
          class Weights = KeptValues<Elem, 64 * WARPS_W, 32 * WARPS_W * WARPS_T>, int WARPS_K = 1>
struct Sp24Dds {
  using Acc = typename SpMma::Acc;
  using OutAcc = typename Out::Acc;
  using OutT = typename Out::T;
  static constexpr int TILE_THREADS = 32 * WARPS_W * WARPS_T, THREADS = TILE_THREADS * WARPS_K;
  static constexpr int TILE_W = 64 * WARPS_W, WARP_T = TILE_T / WARPS_T;
  static constexpr int MT = 4, NT = WARP_T / 8;       // m16 tiles of W and n8 tiles of X per warp
  static constexpr int EPC = 16 / sizeof(Elem);       // elements per 16-byte chunk
  static constexpr int STEP_K = SpMma::K, STAGE_K = 4 * STEP_K;  // dense K per stage: 256 bytes of an X row
  static constexpr int STEP_TILES = STEP_K / 32, META_TILES = STAGE_K / 32;  // k32 metadata tiles
  static constexpr int META_GROUP_BYTES = META_TILES * 64;  // 16 words per tile per 16 rows
  static constexpr int X_HALF = TILE_T * 128, X_BYTES = 2 * X_HALF;
  static constexpr int W_BYTES = Weights::BYTES;       // a stage's kept values (128 bytes a row as stored)
  static constexpr int META_BYTES = (TILE_W / 16) * META_GROUP_BYTES;
  static constexpr int STAGE_BYTES = X_BYTES + W_BYTES + META_BYTES;
  static constexpr int OUT_STRIDE = TILE_W + 8;        // staged output row, padded against bank conflicts
  static constexpr int OUT_VEC = 16 / sizeof(OutT);    // outputs per 16-byte store
  static_assert(WARP_T % 8 == 0 && TILE_T * OUT_STRIDE * sizeof(OutT) <= STAGES * STAGE_BYTES, "tile shape");
  static_assert(4 % WARPS_K == 0 && (WARPS_K - 1) * MT * NT * 4 * TILE_THREADS * sizeof(Acc) <= STAGES * STAGE_BYTES,
                "k-warps: a whole number of instruction steps each, their sums within the stages' bytes");

  // One stage: X[m0.., k0..k0+127] (two swizzled 128-byte halves), W's kept values for the
  // same columns (one 128-byte row each) and their metadata words. Copies past M, N or
  // k_end (K, or the end of this block's split of K) are zero-filled, and the instruction steps
  // past k_end are skipped in compute().
  __device__ static void load(u32 smem, int k0, const Elem* x, typename Weights::Source values, const int* meta,
                              int m0, int n0, int M, int K, int N, int k_end) {
    // (each chunk's address at K = 0 plus k0: the first part is the same every stage, hoisted)
    for_chunks<TILE_T * 16, THREADS>([&](int i) {
      const int row = i >> 4, c = i & 15;
      const Elem* at = x + (long long)(m0 + row) * K + EPC * c;
      cp_async16(swizzled(smem + (c >> 3) * X_HALF, row, c & 7), at + k0, m0 + row < M && k0 + EPC * c < k_end);
    });
    const u32 w_smem = smem + X_BYTES;
    Weights::load(w_smem, values, n0, k0, K, N, k_end);
    const u32 m_smem = w_smem + W_BYTES;
    for_chunks<(TILE_W / 16) * META_TILES * 4, THREADS>([&](int i) {   // chunks of 4 words
      const int group = i / (META_TILES * 4), c = i % (META_TILES * 4);
      const int* at = meta + ((long long)(n0 / 16 + group) * (K / 32) + (c >> 2)) * 16 + 4 * (c & 3);
      cp_async16(m_smem + group * META_GROUP_BYTES + c * 16, at + k0 / 2,  // (k0 / 32 tiles of 16 words)
                 n0 + 16 * group < N && k0 + 32 * (c >> 2) < k_end);
    });
  }

  // The warp's instruction steps of the stage (j = wk, wk + WARPS_K, ...); W's row scales, one
  // per row for the whole stage, are read once.
  __device__ static void compute(u32 smem, int k0, int k_end, Acc (&acc)[MT][NT][4], int ww, int wt, int wk) {
    const int lane = threadIdx.x & 31;
    const u32 w_smem = smem + X_BYTES, m_smem = w_smem + W_BYTES;
    typename Weights::RowScales row_scales[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) row_scales[mt] = Weights::row_scales(w_smem, ww * 64 + mt * 16, lane);
#pragma unroll
    for (int jj = 0; jj < 4 / WARPS_K; ++jj) {   // instruction steps
      const int j = jj * WARPS_K + wk;
      if (k0 + STEP_K * j >= k_end) break;
      u32 a[MT][4], e[MT], b[NT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row = ww * 64 + mt * 16;
        Weights::fragment(a[mt], w_smem, row, j, lane, row_scales[mt]);
        e[mt] = sparse_metadata<STEP_K>(m_smem + (row / 16) * META_GROUP_BYTES + STEP_TILES * j * 64, lane);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        ldmatrix_x4(b[nt], swizzled(smem + (j >> 1) * X_HALF, wt * WARP_T + nt * 8 + (lane & 7),
                                    4 * (j & 1) + (lane >> 3)));
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) SpMma::mma(acc[mt][nt], a[mt], b[nt], e[mt]);
    }
  }

  // acc[mt][nt] holds Y^T rows (features) g, g+8 and columns (tokens) 2q, 2q+1: written
  // transposed into a [TILE_T][TILE_W] tile, then copied out row by row. Gated: rows g
  // (gate) and g + 8 (up) of each 16 make one of TILE_W / 2 features.
  __device__ static void store(unsigned char* smem_raw, OutAcc (&acc)[MT][NT][4], const OutT* bias, OutT* y,
                               int m0, int n0, int M, int N, int ww, int wt, int wk) {
    OutT* out = reinterpret_cast<OutT*>(smem_raw);
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < (wk == 0 ? MT : 0); ++mt)  // (k-warp 0 holds the sums)
#pragma unroll
      for (int half = 0; half < (Epi::kGated ? 1 : 2); ++half) {
        const int f = ww * 64 + mt * 16 + g + 8 * half;
        const OutAcc b = bias && n0 + f < N ? Out::bias(bias[n0 + f]) : OutAcc(0);
        const OutAcc bu = Epi::kGated && bias && n0 + f + 8 < N ? Out::bias(bias[n0 + f + 8]) : OutAcc(0);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int t = wt * WARP_T + nt * 8 + 2 * q + i;
            if constexpr (Epi::kGated)
              out[t * OUT_STRIDE + Epi::out_feature(f)] = Out::convert(Epi::gated(acc[mt][nt][i] + b, acc[mt][nt][2 + i] + bu));
            else
              out[t * OUT_STRIDE + f] = Out::convert(Epi::act(acc[mt][nt][2 * half + i] + b));
          }
      }
    __syncthreads();
    constexpr int WIDTH = Epi::kGated ? TILE_W / 2 : TILE_W, SHRINK = Epi::kGated ? 2 : 1;
    for (int i = threadIdx.x; i < TILE_T * (WIDTH / OUT_VEC); i += THREADS) {
      const int t = i / (WIDTH / OUT_VEC), c = i % (WIDTH / OUT_VEC);
      if (m0 + t < M && n0 / SHRINK + OUT_VEC * c < N / SHRINK)
        *reinterpret_cast<uint4*>(y + (long long)(m0 + t) * (N / SHRINK) + n0 / SHRINK + OUT_VEC * c) =
            *reinterpret_cast<const uint4*>(out + t * OUT_STRIDE + OUT_VEC * c);
    }
  }

  // Split K (small M): the block's partial tile of Y^T goes to its split's slice of the float32
  // workspace; the tile's last split writes Y (sg_split_k.cuh; the host never splits int32 sums).
  // Every thread is past compute(), so the first word of shared memory is free for the flag.
  __device__ static void add_split(OutAcc (&acc)[MT][NT][4], float* sums, int* counts, const OutT* bias, OutT* y,
                                   unsigned char* smem_raw, int m0, int n0, int M, int N, int ww, int wt, int wk) {
    using Split = SplitK<THREADS>;
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int mt = 0; mt < (wk == 0 ? MT : 0); ++mt)  // (k-warp 0 holds the sums)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int f = n0 + ww * 64 + mt * 16 + g + 8 * (i >> 1), t = m0 + wt * WARP_T + nt * 8 + 2 * q + (i & 1);
          if (f < N && t < M) Split::put(sums, t, f, M, N, static_cast<float>(acc[mt][nt][i]));
        }
    int* count = counts + blockIdx.y * gridDim.x + blockIdx.x;
    if (!Split::last_to_arrive(count, gridDim.z, smem_ptr(smem_raw), 0))
      return;
    const auto bias_at = [&](int f) { return bias ? static_cast<float>(Out::bias(bias[f])) : 0.f; };
    if constexpr (Epi::kGated)
      Split::finish_gated(sums, count, y, m0, TILE_T, n0, TILE_W, M, N, bias_at,
                          [](float gate, float up) { return Out::convert(static_cast<OutAcc>(Epi::gated(gate, up))); });
    else
      Split::finish(sums, count, y, m0, TILE_T, n0, TILE_W, M, N, bias_at,
                    [](float v) { return Out::convert(static_cast<OutAcc>(Epi::act(v))); });
  }

  // SCALED: the warp's sums times their tokens' and features' scales, in place (add_split's
  // index mapping); the array then holds OutAcc (float) whatever Acc is.
  using Outs = OutAcc[MT][NT][4];
  __device__ static Outs& rescale(Acc (&acc)[MT][NT][4], Scales scales, int m0, int n0, int M, int N, int ww, int wt) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        const float token = scales.of_token(m0 + wt * WARP_T + nt * 8 + 2 * q + p, M);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int h = 0; h < 2; ++h)
            scale_in_place(acc[mt][nt][2 * h + p], token * scales.of_feature(n0 + ww * 64 + mt * 16 + g + 8 * h, N));
      }
    return reinterpret_cast<Outs&>(acc);
  }

  // blockIdx.z takes K in slices of k_split; with `partial` (the workspace) set, the blocks'
  // sums go there and the last split of each tile writes Y, else they go straight into Y.
  __device__ static void run(const Elem* x, typename Weights::Source values, const int* meta, Scales scales,
                             const OutT* bias,
                             OutT* y, float* partial, int* tile_counts, int M, int K, int N, int k_split) {
    extern __shared__ __align__(128) unsigned char smem_raw[];
    const u32 smem = smem_ptr(smem_raw);
    const int n0 = blockIdx.x * TILE_W, m0 = blockIdx.y * TILE_T;
    const int warp = threadIdx.x >> 5, ww = warp % WARPS_W, wt = warp / WARPS_W % WARPS_T, wk = warp / (WARPS_W * WARPS_T);
    const int k_begin = blockIdx.z * k_split, k_end = min(K, k_begin + k_split);
    const int stages = (k_end - k_begin + STAGE_K - 1) / STAGE_K;
    Acc acc[MT][NT][4] = {};
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < stages) load(smem + s * STAGE_BYTES, k_begin + s * STAGE_K, x, values, meta, m0, n0, M, K, N, k_end);
      cp_async_commit();
    }
    for (int s = 0; s < stages; ++s) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();  // stage s landed for everyone; stage s-1's buffer is free to refill
      const int next = s + STAGES - 1;
      if (next < stages)
        load(smem + (next % STAGES) * STAGE_BYTES, k_begin + next * STAGE_K, x, values, meta, m0, n0, M, K, N, k_end);
      cp_async_commit();
      compute(smem + (s % STAGES) * STAGE_BYTES, k_begin + s * STAGE_K, k_end, acc, ww, wt, wk);
    }
    sum_k_warps(acc, smem_raw, wk);
    if constexpr (SCALED)
      write(rescale(acc, scales, m0, n0, M, N, ww, wt), partial, tile_counts, bias, y, smem_raw, m0, n0, M, N, ww, wt,
            wk);
    else
      write(acc, partial, tile_counts, bias, y, smem_raw, m0, n0, M, N, ww, wt, wk);
  }

  // WARPS_K > 1: k-warps 1.. put their sums in the pipeline's (drained) buffers, k-warp 0 adds
  // them to its own, in k-warp order (the same sums every run).
  __device__ static void sum_k_warps(Acc (&acc)[MT][NT][4], unsigned char* smem_raw, int wk) {
    if constexpr (WARPS_K > 1) {
      constexpr int SUMS = MT * NT * 4;
      Acc* shared = reinterpret_cast<Acc*>(smem_raw);
      Acc* flat = &acc[0][0][0];
      const int slot = threadIdx.x % TILE_THREADS;
      cp_async_wait<0>();
      __syncthreads();
      if (wk > 0)
#pragma unroll
        for (int i = 0; i < SUMS; ++i) shared[((wk - 1) * SUMS + i) * TILE_THREADS + slot] = flat[i];
      __syncthreads();
      if (wk == 0)
#pragma unroll
        for (int r = 0; r < WARPS_K - 1; ++r)
#pragma unroll
          for (int i = 0; i < SUMS; ++i) flat[i] += shared[(r * SUMS + i) * TILE_THREADS + slot];
      __syncthreads();  // the buffers are free for the store
    }
  }

  __device__ static void write(OutAcc (&acc)[MT][NT][4], float* partial, int* tile_counts, const OutT* bias, OutT* y,
                               unsigned char* smem_raw, int m0, int n0, int M, int N, int ww, int wt, int wk) {
    if (partial) {
      add_split(acc, partial, tile_counts, bias, y, smem_raw, m0, n0, M, N, ww, wt, wk);
      return;
    }
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's buffers become the output tile
    store(smem_raw, acc, bias, y, m0, n0, M, N, ww, wt, wk);
  }
};

}  // namespace sg
