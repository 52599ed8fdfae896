// Device-only building blocks shared by sparsegen's templates: async copies into
// swizzled shared memory, ldmatrix, tensor-core mma. No host code (NVRTC JIT mode).
#pragma once
#include "sg_epilogue.cuh"

namespace sg {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// Shared-memory tiles are rows of 128 bytes (8 chunks of 16 bytes). Chunk c of row r
// lives at chunk c ^ (r % 8), so the 8 rows an ldmatrix reads hit 8 distinct bank groups.
__device__ __forceinline__ u32 swizzled(u32 base, int row, int chunk) {
  return base + row * 128 + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ u32 smem_ptr(const void* p) {
  return static_cast<u32>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; when `valid` is false the destination is zero-filled instead,
// which pads partial tiles without a branch around the copy.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
  int bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// The same, transposing each 8x8 matrix: for operands stored with the reduction dim as rows.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// Round fp32 bits to tf32 (round-to-nearest) so fp32 inputs lose as little as possible.
__device__ __forceinline__ u32 to_tf32(u32 x) {
  u32 y;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(y) : "f"(__uint_as_float(x)));
  return y;
}

// One m16n8 tile of C += A * B: k16 for 16-bit types, k8 for tf32 (32 bytes of K either way).
#define SG_MMA(SHAPE, TYPES)                                                              \
  asm volatile("mma.sync.aligned." SHAPE ".row.col.f32." TYPES ".f32 "                   \
               "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"                 \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                          \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]))

// Frag: one m16n8 accumulator tile as a lane holds it (rows m, m + 8; columns n, n + 1).
struct Bf16 {
  using Frag = float[4];
  __device__ static void mma(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    SG_MMA("m16n8k16", "bf16.bf16");
  }
  __device__ static u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  __device__ static float to_float(u16 v) { return __uint_as_float(static_cast<u32>(v) << 16); }
  static constexpr bool kIsFloat = false;
};

struct Fp16 {
  using Frag = float[4];
  __device__ static void mma(float (&c)[4], const u32 (&a)[4], const u32 (&b)[2]) {
    SG_MMA("m16n8k16", "f16.f16");
  }
  __device__ static u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  __device__ static float to_float(u16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(v));
    return f;
  }
  static constexpr bool kIsFloat = false;
};

struct Tf32 {
  using Frag = float[4];
  __device__ static void mma(float (&c)[4], const u32 (&a_raw)[4], const u32 (&b_raw)[2]) {
    const u32 a[4] = {to_tf32(a_raw[0]), to_tf32(a_raw[1]), to_tf32(a_raw[2]), to_tf32(a_raw[3])};
    const u32 b[2] = {to_tf32(b_raw[0]), to_tf32(b_raw[1])};
    SG_MMA("m16n8k8", "tf32.tf32");
  }
  static constexpr bool kIsFloat = true;
};

#undef SG_MMA

// fp16 operands accumulating in fp16 (KernelSpec acc "f16"): mma's f16 C/D, two f16x2
// registers holding the same rows and columns as Fp16's four floats. Every k16 step rounds
// the running sum to fp16 - the accumulator such an experiment means to measure.
struct Fp16AccF16 : Fp16 {
  using Frag = u32[2];
  __device__ static void mma(u32 (&c)[2], const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%0,%1};\n"
                 : "+r"(c[0]), "+r"(c[1])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// An accumulator tile as 4 floats for the store: a float one is read in place, an f16 one
// widened into `room`.
__device__ __forceinline__ const float* frag_floats(const float (&c)[4], float (&)[4]) { return c; }
__device__ __forceinline__ const float* frag_floats(const u32 (&c)[2], float (&room)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) room[i] = Fp16::to_float(static_cast<u16>(c[i >> 1] >> (16 * (i & 1))));
  return room;
}

// The metadata word a lane passes to a sparse product (selector 0), read from a 16-row
// group's k32 tiles as layouts/semi24.py stores them (16 words each, 64 bytes apart;
// `tiles`: the product's first). K = 32 (16-bit types): lanes 4g, 4g+1 pass stored word
// 2g + h as it is (row g's groups of columns 16h.. low, row g + 8's high). K = 64 (one-byte
// types): lane 4g + 2t + u passes all 8 groups of row g + 8u in tile t, built from stored
// words 2g and 2g + 1 by one byte permute (probed on an H100, for mma.sp m16n8k64 and
// wgmma.sp k64 alike), so every dtype shares one storage layout.
template <int K>
__device__ __forceinline__ u32 sparse_metadata(u32 tiles, int lane) {
  u32 e;
  if constexpr (K == 32) {
    asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(e) : "r"(tiles + 4 * (2 * (lane >> 2) + (lane & 1))));
  } else {
    u32 lo, hi;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];\n" : "=r"(lo), "=r"(hi)
                 : "r"(tiles + 64 * ((lane & 3) >> 1) + 8 * (lane >> 2)));
    e = __byte_perm(lo, hi, (lane & 1) ? 0x7632 : 0x5410);
  }
  return e;
}

// One-byte types as the 2:4 pruning kernels read them (raw bytes): the value as a float.
struct Int8 {
  __device__ static float to_float(unsigned char v) { return static_cast<float>(static_cast<signed char>(v)); }
};

// e4m3fn (bias 7, no infinities; 0x7F/0xFF are NaN), decoded exactly without fp8 hardware.
struct E4m3 {
  __device__ static float to_float(unsigned char v) {
    const u32 e = (v >> 3) & 0xF, m = v & 7;
    const float magnitude = e ? __uint_as_float(((e + 120) << 23) | (m << 20)) : m * 0x1p-9f;
    return (v & 0x7F) == 0x7F ? __uint_as_float(0x7FC00000u) : (v & 0x80 ? -magnitude : magnitude);
  }
};

}  // namespace sg
