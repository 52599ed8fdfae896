// Row policies of the gathered-K kernels (sg_gathered_dds*.cuh): where a block row of W keeps
// its stored blocks. first(r) is the index of block row r's first stored block (in `cols`
// and in the values; a row's blocks are consecutive) and count(r) how many it has. A layout
// with another index brings its own policy in its template.
#pragma once

namespace sg {

// Block-CSR: both read from the row offsets.
struct CsrRows {
  const int* offsets;
  __device__ int first(int r) const { return offsets[r]; }
  __device__ int count(int r) const { return offsets[r + 1] - offsets[r]; }
};

}  // namespace sg
