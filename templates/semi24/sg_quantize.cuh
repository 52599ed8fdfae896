// ScaledSparse24Linear's activation quantization, shared by sp24_quantize (its own pass) and
// sp24_dds's quantizing variant (xq: X read in 16 bits, quantized on the way into shared
// memory). The arithmetic of semi24/scaled.py's row_scales and quantize: a row's scale is its
// largest |x| times the constant 1/LARGEST (at least 1e-12), a value x / scale correctly
// rounded, saturated, then rounded half to even (int8) or to the nearest even e4m3: both paths
// give the same bytes.
#pragma once
#include "sg_mma.cuh"

namespace sg {

template <class Src, bool INT8>
struct Quantizer {
  static constexpr float LARGEST = INT8 ? 127.0f : 448.0f, INVERSE = 1.0f / LARGEST, TINY = 1e-12f;

  // max that keeps a NaN, as torch.amax does
  __device__ static float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

  // The eight 16-bit values of a 16-byte piece, as floats.
  __device__ static void unpack8(uint4 raw, float (&v)[8]) {
    const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = Src::to_float(static_cast<unsigned short>(words[i / 2] >> (16 * (i % 2))));
  }

  __device__ static float largest_of8(uint4 raw) {
    float v[8], amax = 0.f;
    unpack8(raw, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = nan_max(amax, fabsf(v[i]));
    return amax;
  }

  __device__ static float scale_of(float amax) {
    const float scale = amax * INVERSE;
    return scale < TINY ? TINY : scale;  // (a NaN stays NaN, as clamp_min keeps it)
  }

  // One value: x / scale, saturated (NaN kept).
  __device__ static float saturated(float x, float scale) {
    const float q = __fdiv_rn(x, scale);
    return q < -LARGEST ? -LARGEST : (q > LARGEST ? LARGEST : q);
  }

  __device__ static unsigned pair_bytes(float lo, float hi) {
    if constexpr (INT8) {
      return (static_cast<unsigned>(__float2int_rn(lo)) & 0xFF) | (static_cast<unsigned>(__float2int_rn(hi)) & 0xFF) << 8;
    } else {
      unsigned short r;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
      return r;
    }
  }

  // The eight bytes of a 16-byte piece of 16-bit values.
  __device__ static uint2 bytes8(uint4 raw, float scale) {
    float v[8];
    unpack8(raw, v);
    uint2 out;
    out.x = pair_bytes(saturated(v[0], scale), saturated(v[1], scale)) | pair_bytes(saturated(v[2], scale), saturated(v[3], scale)) << 16;
    out.y = pair_bytes(saturated(v[4], scale), saturated(v[5], scale)) | pair_bytes(saturated(v[6], scale), saturated(v[7], scale)) << 16;
    return out;
  }
};

}  // namespace sg
