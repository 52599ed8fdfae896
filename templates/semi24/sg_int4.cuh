// 4-bit 2:4 weights with 16-bit activations (W4A16): the weights policy of Sp24Dds
// (sp24_dds.cuh) that reads W's kept values as 4-bit integers and dequantizes them in
// registers into mma.sp's 16-bit A fragments.
//
// Storage (sparsegen/semi24/int4.py packs it): per 16 W rows and k32 step (16 kept values a
// row), one 128-byte line of 32 words, word l holding the 8 values lane l's A fragment needs:
// nibble h + 2c + 4p is row g + 8h, kept column 8c + 2q + p (g = l / 4, q = l % 4), stored as
// value + 8 (0..15). Lines run along K, then along W's rows: [N/16][K/32][32] words. So a
// lane's fragment is one 32-bit shared load, no ldmatrix, and a stage of 16 rows is 512
// contiguous bytes. Scales: the activations' type, [groups][N], one per row and group of
// `group` columns (whole stages of 128 columns, or all of K): a stage reads one row of them.
// A grouped launch (sp24_w4.cu.j2) hands each block its own weight's pointers, offset back by the
// rows before it, so that the rows of Y's columns index them as they index one weight.
#pragma once
#include "sp24_dds.cuh"

namespace sg {

// Per 16-bit type: v + 8 (a nibble) or-ed into the bits of 128 (bf16) or 1024 (fp16) is that
// number plus v exactly (one unit in the last place there); fma(x, 1, -(base + 8)) leaves the
// signed value, and fma(value, scale, -0) its product with the scale, rounded once - the
// dequantized weight bit for bit (int4.py's dequantized).
template <bool BF16>
struct Int4Magic {
  static constexpr u32 kBase = BF16 ? 0x43004300u : 0x64006400u, kOne = BF16 ? 0x3F803F80u : 0x3C003C00u,
                       kMinusBase = BF16 ? 0xC308C308u : 0xE408E408u;
  static constexpr u32 kBaseBytes = BF16 ? 0x43434343u : 0x64646464u;  // kBase's high byte, for prmt
  __device__ static u32 fma2(u32 a, u32 b, u32 c) {
    u32 d;
    if constexpr (BF16)
      asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    else
      asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
};

template <class Mma>
struct Int4Bits;
template <>
struct Int4Bits<Bf16> : Int4Magic<true> {};
template <>
struct Int4Bits<Fp16> : Int4Magic<false> {};

// A pair held as base + 8 + value in each half (or-ed into kBase's bits): the signed values
// times their scale, each rounded once.
template <class Mma>
__device__ __forceinline__ u32 scaled_pair(u32 shifted, u32 scale2) {
  using Bits = Int4Bits<Mma>;
  return Bits::fma2(Bits::fma2(shifted, Bits::kOne, Bits::kMinusBase), scale2, 0x80008000u);
}

// Values i and i + 4 of a lane's word (nibbles i, i + 4: row g + 8(i % 2), kept columns
// 8(i / 2) + 2q and + 1) dequantized by their row's scale, `scale2` holding it twice.
template <class Mma>
__device__ __forceinline__ u32 dequantized_pair(u32 word, int i, u32 scale2) {
  return scaled_pair<Mma>(((word >> (4 * i)) & 0x000F000Fu) | Int4Bits<Mma>::kBase, scale2);
}

// All four pairs of a lane's word, a[i] = dequantized_pair(word, i, scale2[i % 2]) bit for bit,
// in fewer instructions: the even nibbles (0, 2, 4, 6) and the odd ones masked into the low
// halves of bytes once, then each pair is one byte permute (prmt) of two of those bytes with
// the base's high byte - where shifting each pair into place took a shift, a mask and the mask
// constant moved into a register again (a LOP3 takes one immediate).
template <u32 SELECTOR>
__device__ __forceinline__ u32 byte_permute(u32 low, u32 high) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(low), "r"(high), "n"(SELECTOR));
  return d;
}

template <class Mma>
__device__ __forceinline__ void dequantized_word(u32 (&a)[4], u32 word, const u32 (&scale2)[2]) {
  using Bits = Int4Bits<Mma>;
  u32 base_bytes;
  asm("mov.b32 %0, %1;\n" : "=r"(base_bytes) : "n"(Bits::kBaseBytes));
  const u32 even = word & 0x0F0F0F0Fu, odd = (word >> 4) & 0x0F0F0F0Fu;  // nibbles 0, 2, 4, 6 / 1, 3, 5, 7
  // pair i: nibbles i and i + 4, bytes i / 2 and i / 2 + 2 of `even` (i even) or `odd`
  const u32 shifted[4] = {byte_permute<0x4240>(even, base_bytes), byte_permute<0x4240>(odd, base_bytes),
                          byte_permute<0x4341>(even, base_bytes), byte_permute<0x4341>(odd, base_bytes)};
#pragma unroll
  for (int i = 0; i < 4; ++i) a[i] = scaled_pair<Mma>(shifted[i], scale2[i & 1]);
}

template <class Mma, int TILE_W, int THREADS>
struct Int4Values {
  struct Source {
    const u32* q;
    const u16* scales;
    int group;
    int scale_stride;  // a row of scales: the weight's N (a grouped launch's weights each their own)
  };
  static constexpr int LINE = 128, Q_BYTES = TILE_W * 32;  // per stage: 4 lines per 16 rows
  static constexpr int BYTES = Q_BYTES + TILE_W * 2;      // and a scale per row
  static_assert(TILE_W % 64 == 0, "whole 16-byte chunks of scales");

  __device__ static void load(u32 smem, Source w, int n0, int k0, int K, int N, int k_end) {
    // 16-byte chunks, 32 per 16 rows. k0 is a whole number of stages: the chunk's line at K = 0
    // (the same every stage: hoisted out of the stage loop) plus k0 words (k0 / 32 lines of 32)
    for_chunks<TILE_W * 2, THREADS>([&](int i) {
      const int rows16 = i >> 5, c = i & 31;
      const u32* line = w.q + ((long long)(n0 / 16 + rows16) * (K / 32) + (c >> 3)) * 32 + 4 * (c & 7);
      cp_async16(smem + i * 16, line + k0, n0 + 16 * rows16 < N && k0 + 32 * (c >> 3) < k_end);
    });
    // (the two groups quantizers write, 128 and all of K, without an integer division: warp 0
    // alone copies the scales, and every warp waits for it at the next stage's barrier)
    const int group_row = w.group == 128 ? k0 >> 7 : k0 < w.group ? 0 : k0 / w.group;
    for_chunks<TILE_W / 8, THREADS>([&](int i) {
      cp_async16(smem + Q_BYTES + i * 16, w.scales + (long long)group_row * w.scale_stride + n0 + 8 * i,
                 n0 + 8 * i < N && k0 < k_end);
    });
  }

  // Rows row + g and row + g + 8's scales (g = lane / 4), each held twice: one pair a stage, as
  // a stage's columns lie in one group.
  struct RowScales {
    u32 twice[2];
  };

  __device__ static RowScales row_scales(u32 smem, int row, int lane) {
    u32 s0, s1;
    const u32 scale = smem + Q_BYTES + 2 * (row + (lane >> 2));
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(s0) : "r"(scale));
    asm volatile("ld.shared.u16 %0, [%1];\n" : "=r"(s1) : "r"(scale + 16));
    return {{s0 | (s0 << 16), s1 | (s1 << 16)}};
  }

  __device__ static void fragment(u32 (&a)[4], u32 smem, int row, int j, int lane, RowScales scales) {
    u32 word;
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(word) : "r"(smem + (row / 16) * 4 * LINE + j * LINE + 4 * lane));
    dequantized_word<Mma>(a, word, scales.twice);
  }
};

}  // namespace sg
