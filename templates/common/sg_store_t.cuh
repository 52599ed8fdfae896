// Storing a warpgroup's wgmma accumulators of Y^T (m64 features x TOKENS tokens) into Y [M, N]
// in Y's own row-major layout - no transpose pass - for kernels that put W in wgmma's A.
#pragma once
#include "sg_wgmma.cuh"

namespace sg {

// acc holds Y^T rows (features) 16w + g (+8) and columns (tokens) 8j + 2q (+1): stmatrix
// .trans writes them as token rows of the warpgroup's 64 features, CHUNK_T tokens at a time,
// which its threads then copy out to Y in 16-byte pieces.
template <class Mma, class Elem, int TOKENS, int CHUNK_T, class Epi = NoEpilogue>
struct TransposedStore {
  static constexpr int BYTES = CHUNK_T * 128;  // the warpgroup's staging buffer
  static_assert(TOKENS % CHUNK_T == 0 && CHUNK_T % 16 == 0, "whole x4 stmatrix groups per chunk");

  // buf: this warpgroup's staging buffer; tokens t0.., features f0..f0+63; `barrier`: a named
  // barrier of the warpgroup's own (0 is __syncthreads').
  __device__ static void store(u32 buf, const float (&acc)[TOKENS / 2], const Elem* bias, Elem* y, int t0, int f0,
                               int M, int N, int barrier) {
    if constexpr (Epi::kGated) {
      store_gated(buf, acc, bias, y, t0, f0, M, N, barrier);
      return;
    }
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, f = f0 + warp * 16 + (lane >> 2);
    const float b[2] = {bias && f < N ? Mma::to_float(bias[f]) : 0.f,
                        bias && f + 8 < N ? Mma::to_float(bias[f + 8]) : 0.f};
    // This lane's row address: matrix lane / 8 of an x4 is (tokens 8 (j + lane / 16),
    // features 16w + 8 ((lane / 8) % 2)); its row lane % 8 is one token.
    const int row = 8 * (lane >> 4) + (lane & 7), chunk = 2 * warp + ((lane >> 3) & 1);
#pragma unroll
    for (int c0 = 0; c0 < TOKENS; c0 += CHUNK_T) {
#pragma unroll
      for (int j = c0 / 8; j < (c0 + CHUNK_T) / 8; j += 2) {
        u32 r[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) r[i] = Mma::pack(Epi::act(acc[4 * j + 2 * i] + b[i & 1]), Epi::act(acc[4 * j + 2 * i + 1] + b[i & 1]));
        stmatrix_x4_trans(staged(buf, 8 * j - c0 + row, chunk), r);
      }
      sync(barrier);
      copy_out(buf, y, t0 + c0, f0, M, N);
      sync(barrier);  // read before the next chunk overwrites it
    }
  }

  // Gated (sg_epilogue.cuh): rows 16w + g (gate) and 16w + g + 8 (up) make Y's feature
  // f0 / 2 + 8w + g, one of the warpgroup's 32; results go into the staging rows 2 bytes at
  // a time (half of each row) and are copied out as in store.
  __device__ static void store_gated(u32 buf, const float (&acc)[TOKENS / 2], const Elem* bias, Elem* y, int t0,
                                     int f0, int M, int N, int barrier) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3, f = f0 + warp * 16 + (lane >> 2);
    const float bg = bias && f < N ? Mma::to_float(bias[f]) : 0.f, bu = bias && f + 8 < N ? Mma::to_float(bias[f + 8]) : 0.f;
    const int out = 8 * warp + (lane >> 2);
#pragma unroll
    for (int c0 = 0; c0 < TOKENS; c0 += CHUNK_T) {
#pragma unroll
      for (int j = c0 / 8; j < (c0 + CHUNK_T) / 8; ++j)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const u32 v = Mma::pack(Epi::gated(acc[4 * j + i] + bg, acc[4 * j + 2 + i] + bu), 0.f) & 0xFFFF;
          asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(staged(buf, 8 * j + 2 * (lane & 3) + i - c0, out >> 3) + 2 * (out & 7)),
                       "h"(static_cast<u16>(v)) : "memory");
        }
      sync(barrier);
      copy_out<4>(buf, y, t0 + c0, f0 / 2, M, N / 2);
      sync(barrier);
    }
  }

  // Token row t's 16-byte piece p (features 8p..8p+7), XOR-swizzled by row so that the 8
  // rows of one stmatrix land in different banks.
  __device__ static u32 staged(u32 buf, int t, int p) { return buf + t * 128 + ((p ^ (t & 7)) << 4); }

  __device__ static void stmatrix_x4_trans(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n"
                 ::"r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  }

  // PIECES: 16-byte pieces per staged row (8: 64 features; gated 4).
  template <int PIECES = 8>
  __device__ static void copy_out(u32 buf, Elem* y, int t0, int f0, int M, int N) {
    for (int i = threadIdx.x % 128; i < CHUNK_T * PIECES; i += 128) {
      const int t = i / PIECES, p = i % PIECES;
      if (t0 + t >= M || f0 + 8 * p >= N) continue;
      uint4 v;
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                   : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(staged(buf, t, p)));
      *reinterpret_cast<uint4*>(y + (long long)(t0 + t) * N + f0 + 8 * p) = v;
    }
  }

  __device__ static void sync(int barrier) { asm volatile("bar.sync %0, 128;\n" ::"r"(barrier) : "memory"); }
};

}  // namespace sg
