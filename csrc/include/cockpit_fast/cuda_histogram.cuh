// The one skeleton of the CUDA histogram kernels (hist1d, hist2d, outer_hist1d, outer_hist2d).
// An op supplies only its per-value slot computation, as a functor; the skeleton owns the rest:
// the traversal of the values, the privatised block histogram (one shared-memory copy per warp
// where they fit, warp-aggregated atomics within, flushed once per block into the int64
// counts; straight into global memory when even one copy does not fit), the grid and the launch.
//
// Slots are the cells of the row-major counts, plus one discard slot (counts.numel(), never
// written out) for what is not counted: NaN, and lanes past the end of the data.
//
// Two traversals, each with its functor contract (Op::kVec is the values a thread takes at once):
//  - count_flat: one flat run of values, grid-stride.
//      __device__ void slots(int64_t i, int64_t numel, int32_t (&out)[kVec]) const
//    writes the slots of values i .. i + kVec - 1 (the discard slot from numel on).
//  - count_row_tiles: an (n_rows, n_cols) matrix; a block owns a tile of kThreads * kVec
//    columns and a group of rows, a thread kVec consecutive columns of every row of the group.
//      struct Column;                                  // what a thread keeps over its rows
//      __device__ Column column(int64_t j) const;      // for columns j .. j + kVec - 1
//      __device__ void slots(const Column& c, int64_t r, int32_t (&out)[kVec]) const
//    writes the slots of row r's values in those columns (the discard slot from n_cols on).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "cockpit_fast/cuda_common.cuh"

namespace cockpit_fast {
namespace cuda {

// Counts `slot` (if below `limit`) with one atomic per distinct slot per warp: lanes holding
// the same slot are combined first, so data concentrated in a few bins does not serialise.
// Every lane of the warp must make the call together.
template <typename Counter>
__device__ inline void count_in_warp(Counter* histogram, unsigned int slot, unsigned int limit) {
  const unsigned int peers = __match_any_sync(0xffffffffu, slot);
  if ((threadIdx.x % kWarpSize) == static_cast<unsigned int>(__ffs(peers) - 1) && slot < limit) {
    atomicAdd(histogram + slot, static_cast<Counter>(__popc(peers)));
  }
}

// Copies of a shared histogram of `slots` counters a block can hold (one per warp at most);
// 0 when even one does not fit and the kernel must count in global memory.
inline int shared_histogram_copies(int64_t slots) {
  const int64_t fit = kSharedBytes / (slots * static_cast<int64_t>(sizeof(unsigned int)));
  return static_cast<int>(std::min<int64_t>(fit, kWarps));
}

// A block's histogram of `counted` cells plus the discard slot (`counted` itself). With kShared,
// `copies` privatised copies in the block's dynamic shared memory, the warps spread over them,
// flushed into the global int64 counts once; without, atomics on the global counts, the discard
// slot dropped.
template <bool kShared>
class BlockHistogram {
 public:
  // Every thread of the block constructs it together (it clears shared memory and syncs).
  __device__ BlockHistogram(unsigned int* shared, int64_t counted, int copies,
                            unsigned long long* counts)
      : shared_(shared),
        mine_(shared + (threadIdx.x / kWarpSize % copies) * (counted + 1)),
        counted_(counted),
        copies_(copies),
        counts_(counts) {
    if constexpr (kShared) {
      for (int64_t i = threadIdx.x; i < (counted_ + 1) * copies_; i += blockDim.x) shared_[i] = 0;
      __syncthreads();
    }
  }

  // Every lane of the warp calls it together (count_in_warp).
  __device__ void add(int32_t slot) {
    const auto s = static_cast<unsigned int>(slot);
    if constexpr (kShared) {
      count_in_warp(mine_, s, static_cast<unsigned int>(counted_ + 1));
    } else {
      count_in_warp(counts_, s, static_cast<unsigned int>(counted_));
    }
  }

  // Every thread of the block calls it once, after its last add.
  __device__ void flush() {
    if constexpr (kShared) {
      __syncthreads();
      for (int64_t b = threadIdx.x; b < counted_; b += blockDim.x) {
        unsigned long long total = 0;
        for (int c = 0; c < copies_; ++c) total += shared_[c * (counted_ + 1) + b];
        if (total > 0) atomicAdd(counts_ + b, total);
      }
    }
  }

 private:
  unsigned int* shared_;
  unsigned int* mine_;
  int64_t counted_;
  int copies_;
  unsigned long long* counts_;
};

// The traversals: pass.count(histogram) adds the slot of every value of the block's share.
// Each loop bound is the same for the whole block, so every lane makes every add (count_in_warp).
template <typename Op>
struct FlatPass {
  Op op;
  int64_t numel;

  template <typename Histogram>
  __device__ __forceinline__ void count(Histogram& histogram) const {
    constexpr int VEC = Op::kVec;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * VEC;
    for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * VEC; base < numel; base += stride) {
      int32_t slots[VEC];
      op.slots(base + static_cast<int64_t>(threadIdx.x) * VEC, numel, slots);
#pragma unroll
      for (int k = 0; k < VEC; ++k) histogram.add(slots[k]);
    }
  }
};

template <typename Op>
struct RowTilePass {
  Op op;
  int64_t n_rows, rows_per_group;

  template <typename Histogram>
  __device__ __forceinline__ void count(Histogram& histogram) const {
    constexpr int VEC = Op::kVec;
    const typename Op::Column column =
        op.column((static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC);
    const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
    const int64_t r_end = min(n_rows, r_begin + rows_per_group);
    for (int64_t r = r_begin; r < r_end; ++r) {
      int32_t slots[VEC];
      op.slots(column, r, slots);
#pragma unroll
      for (int k = 0; k < VEC; ++k) histogram.add(slots[k]);
    }
  }
};

template <bool kShared, typename Pass>
__global__ void histogram_kernel(const Pass pass, int64_t counted, int copies,
                                 unsigned long long* __restrict__ counts) {
  extern __shared__ unsigned int shared_counts[];
  BlockHistogram<kShared> histogram(shared_counts, counted, copies, counts);
  pass.count(histogram);
  histogram.flush();
}

// Launches the histogram kernel of `pass` over `grid` into `counts` (int64, zero-filled):
// privatised shared-memory copies where one fits, else global counting. Checks the launch.
template <typename Pass>
void launch_histogram(const Pass& pass, dim3 grid, at::Tensor& counts) {
  const int64_t counted = counts.numel();
  auto* out = reinterpret_cast<unsigned long long*>(counts.data_ptr<int64_t>());
  const cudaStream_t stream = current_stream();
  const int copies = shared_histogram_copies(counted + 1);
  if (copies > 0) {
    const size_t shared_bytes = sizeof(unsigned int) * (counted + 1) * copies;
    histogram_kernel<true><<<grid, kThreads, shared_bytes, stream>>>(pass, counted, copies, out);
  } else {
    histogram_kernel<false><<<grid, kThreads, 0, stream>>>(pass, counted, 1, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Blocks of a flat grid-stride loop over `numel` values read `vec` at a time: enough to fill the
// device, and enough that no block visits 2^31 values (its 32-bit shared counters never overflow).
inline unsigned int flat_blocks(int64_t numel, int vec) {
  const int64_t per_block_cap = int64_t(1) << 31;
  const int64_t needed = std::max(target_blocks(), (numel + per_block_cap - 1) / per_block_cap);
  const int64_t per_block_step = static_cast<int64_t>(kThreads) * vec;
  const int64_t useful = (numel + per_block_step - 1) / per_block_step;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(needed, useful)));
}

// Counts the slots op gives for `numel` values into `counts` (on the device of the data).
template <typename Op>
void count_flat(const Op& op, int64_t numel, at::Tensor& counts) {
  const c10::cuda::CUDAGuard guard(counts.device());
  launch_histogram(FlatPass<Op>{op, numel}, dim3(flat_blocks(numel, Op::kVec)), counts);
}

// Counts the slots op gives for an (n_rows, n_cols) matrix into `counts`.
template <typename Op>
void count_row_tiles(const Op& op, int64_t n_rows, int64_t n_cols, at::Tensor& counts) {
  const c10::cuda::CUDAGuard guard(counts.device());
  const RowTileGrid grid = row_tile_grid(n_rows, n_cols, Op::kVec);
  launch_histogram(RowTilePass<Op>{op, n_rows, grid.rows_per_group}, grid.grid(), counts);
}

}  // namespace cuda
}  // namespace cockpit_fast
