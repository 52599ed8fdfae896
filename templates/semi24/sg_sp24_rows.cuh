// sg_sp24_rows.cuh: one row's 16 columns of a 16-bit 2:4 W between its stored form - 8 values
// and 16 bits of mma.sp metadata, a nibble i0 | i1 << 2 per group of 4 - and dense elements.
// Every index is a compile-time constant after unrolling: nothing goes to local memory.
#pragma once

namespace sg {

using Bits16 = unsigned short;  // a bf16 or fp16 element as its bits (these kernels only move them)

// 16 bytes as 8 elements and back (two per 32-bit word, the lower one first).
__device__ __forceinline__ void unpack8(const uint4 q, Bits16 (&v)[8]) {
  const unsigned words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = static_cast<Bits16>(e % 2 ? words[e / 2] >> 16 : words[e / 2] & 0xFFFF);
}

__device__ __forceinline__ uint4 pack8(const Bits16 (&v)[8]) {
  unsigned words[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) words[w] = static_cast<unsigned>(v[2 * w]) | static_cast<unsigned>(v[2 * w + 1]) << 16;
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// The 16 dense elements of one row (zeros where nothing is stored), as two 16-byte stores:
// `half` holds the row's four nibbles (group j at bits 4j), `values` its 8 stored elements.
__device__ __forceinline__ void expand_row(unsigned half, const Bits16* values, Bits16* dense) {
  Bits16 kept[8], lo[8], hi[8];
  unpack8(*reinterpret_cast<const uint4*>(values), kept);
#pragma unroll
  for (int e = 0; e < 16; ++e) {
    const int j = e / 4, i0 = half >> (4 * j) & 3, i1 = half >> (4 * j + 2) & 3;
    const Bits16 v = e % 4 == i0 ? kept[2 * j] : e % 4 == i1 ? kept[2 * j + 1] : Bits16(0);
    if (e < 8) lo[e] = v; else hi[e - 8] = v;
  }
  reinterpret_cast<uint4*>(dense)[0] = pack8(lo);
  reinterpret_cast<uint4*>(dense)[1] = pack8(hi);
}

}  // namespace sg
