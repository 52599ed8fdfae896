// Row policies of the gathered-K kernels (sg_gathered_dds*.cuh): where a block row of W keeps
// its stored blocks. The kernel contract - a policy provides:
//   first(r)              the index of block row r's first stored block in the values (a row's
//                         blocks are consecutive [BM, BK] tiles, row-major within a tile);
//   count(r)              how many blocks row r stores;
//   col(cols, r, first, blk)  the block column of row r's blk-th stored block: read from the
//                         layout's index `cols`, or computed (an arithmetic layout keeps none
//                         and its kernel is passed a null `cols`).
// A layout with another index brings its own policy in its template.
#pragma once

namespace sg {

// A policy whose block columns are an index in memory: entry first + blk of `cols`.
__device__ __forceinline__ int indexed_col(const int* cols, int first, int blk) { return __ldg(cols + first + blk); }

// Block-CSR: first and count from the row offsets, columns from the index.
struct CsrRows {
  const int* offsets;
  __device__ int first(int r) const { return offsets[r]; }
  __device__ int count(int r) const { return offsets[r + 1] - offsets[r]; }
  __device__ static int col(const int* cols, int, int first, int blk) { return indexed_col(cols, first, blk); }
};

}  // namespace sg
