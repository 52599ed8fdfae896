// Fused epilogues: what a forward kernel does to each output X W^T + b before writing it,
// chosen by the spec's `epilogue` (sparsegen/jit/epilogues.py is the reference). The math is in
// float32 on the accumulators, rounded once into Y.
//
// Gated epilogues take a weight that holds the gate and up projections interleaved in
// groups of 8 rows (16w..16w+7 gate, 16w+8..16w+15 up, of the same 8 features): every
// store path's thread holds rows f and f + 8 of one product side by side (mma's m16n8 tiles
// and wgmma's accumulators alike), so gate and up meet in registers and Y has half the rows.
#pragma once

namespace sg {

struct Identity {
  template <class T>
  __device__ static T f(T v) { return v; }
};

struct Relu {
  template <class T>
  // NaN stays NaN, as in torch.relu (v > 0 ? v : 0 would turn it into 0)
  __device__ static T f(T v) { return v <= T(0) ? T(0) : v; }
};

struct Gelu {  // the exact GELU: x Phi(x)
  template <class T>
  __device__ static T f(T v) { return T(0.5f * float(v) * (1.f + erff(float(v) * 0.70710678118654752f))); }
};

struct GeluTanh {  // GPT-2's tanh approximation
  template <class T>
  __device__ static T f(T v) {
    const float x = float(v);
    return T(0.5f * x * (1.f + tanhf(0.79788456080286536f * (x + 0.044715f * x * x * x))));
  }
};

struct Silu {
  template <class T>
  __device__ static T f(T v) { return T(float(v) / (1.f + __expf(-float(v)))); }
};

template <class Act, bool GATED>
struct Epilogue {
  static constexpr bool kGated = GATED;
  template <class T>
  __device__ static T act(T v) { return Act::f(v); }
  __device__ static float gated(float gate, float up) { return Act::f(gate) * up; }
  // Y's column for the gate row f of the fused weight (f % 16 < 8).
  __device__ static int out_feature(int f) { return (f >> 4) * 8 + (f & 7); }
};

using NoEpilogue = Epilogue<Identity, false>;

// One-byte products' dequantization (ScaledSparse24Linear): each sum times its token's and
// its feature's float32 scale, before bias and activation. Null in unscaled kernels.
struct Scales {
  const float* token;    // [M]
  const float* feature;  // [N]
  __device__ float of_token(int t, int M) const { return t < M ? token[t] : 0.f; }
  __device__ float of_feature(int f, int N) const { return f < N ? feature[f] : 0.f; }
};

// A sum scaled where it lies: float sums in place; int32 ones (int8 products) are converted,
// the register then holding the float's bits (the caller reads the array as float).
__device__ __forceinline__ void scale_in_place(float& v, float s) { v *= s; }
__device__ __forceinline__ void scale_in_place(int& v, float s) { v = __float_as_int(static_cast<float>(v) * s); }

}  // namespace sg
