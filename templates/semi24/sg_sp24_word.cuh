// sg_sp24_word.cuh: where one mma.sp metadata word of a 2:4 W [N, K] sits (layouts/semi24.py).
// The words are [N/16, K/32, 16]: lane slot (g, h) of a 16 x 32 tile covers rows g and g + 8,
// columns 16h..16h+15. The pruning and expanding kernels run one thread per word.
#pragma once

namespace sg {

// Word t's first row and column; false past the last word.
__device__ __forceinline__ bool sp24_word_origin(long long t, int N, int K, long long& row, long long& col) {
  const long long tiles_k = K / 32, words = (long long)N / 16 * tiles_k * 16;
  if (t >= words) return false;
  const int slot = t % 16, g = slot / 2, h = slot % 2;
  const long long tile = t / 16;
  row = (tile / tiles_k) * 16 + g;
  col = (tile % tiles_k) * 32 + 16 * h;
  return true;
}

}  // namespace sg
