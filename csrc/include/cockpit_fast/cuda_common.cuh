// Parallel skeleton pieces shared by the CUDA kernels: vector loads, warp reductions, the
// privatised block histogram and its launch, and the (column tile x row group) grid.
//
// Every CUDA entry point checks its arguments before it takes the device guard: with one
// tensor on the CPU the dispatcher still picks the CUDA kernel, and a guard on a CPU device
// would fail with torch's message instead of ours, which names the op and the tensors.
#pragma once

// Only c10's CUDA headers: ATen/cuda/CUDAContext.h would pull in cuBLAS and cuSPARSE headers
// that a plain nvcc install does not have.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace cockpit_fast {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int64_t kSharedBytes = 48 * 1024;  // dynamic shared memory usable without opt-in

// VEC consecutive values read with one 16-byte (or narrower) load.
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T>
constexpr int widest_vector() {
  return static_cast<int>(16 / sizeof(T));
}

// The vector width every row of an (n, row_len) tensor at ptr can be read with: the widest when
// the base is 16-byte aligned and rows keep that alignment, else 1. row_len = 0 for one flat run.
template <typename T>
int vector_width(const void* ptr, int64_t row_len) {
  constexpr int widest = widest_vector<T>();
  const bool aligned = reinterpret_cast<uintptr_t>(ptr) % (sizeof(T) * widest) == 0;
  return aligned && row_len % widest == 0 ? widest : 1;
}

// Calls f(std::integral_constant<int, VEC>) with VEC = width, which is 1 or widest_vector<T>().
template <typename T, typename F>
void with_vector_width(int width, F&& f) {
  if (width == widest_vector<T>()) {
    f(std::integral_constant<int, widest_vector<T>()>{});
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// values[k] = data[i + k] for k < VEC: one vector load when all VEC lie before `end`, else
// value by value (0 past `end`).
template <typename T, int VEC>
__device__ __forceinline__ void load_values(const T* data, int64_t i, int64_t end, T (&values)[VEC]) {
  if (VEC > 1 && i + VEC <= end) {
    const Pack<T, VEC> pack = *reinterpret_cast<const Pack<T, VEC>*>(data + i);
#pragma unroll
    for (int k = 0; k < VEC; ++k) values[k] = pack.v[k];
  } else {
#pragma unroll
    for (int k = 0; k < VEC; ++k) values[k] = i + k < end ? data[i + k] : T(0);
  }
}

template <typename T>
__device__ inline T warp_sum(T v) {
  for (int offset = kWarpSize / 2; offset > 0; offset >>= 1) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

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

// A block's histogram of `counted` bins plus one discard slot (`counted` itself: NaN, lanes past
// the end). With kShared, `copies` privatised copies in the block's dynamic shared memory, the
// warps spread over them, updated with warp-aggregated atomics and flushed into the global int64
// counts once; without (too large for shared memory), warp-aggregated atomics on the global
// counts, the discard slot dropped.
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

// Calls launch(std::bool_constant<kShared>, shared_bytes, copies) for a histogram kernel of
// `counted` bins (+ the discard slot): privatised copies where one fits, else global counting.
// Checks the launch.
template <typename F>
void launch_histogram(int64_t counted, F&& launch) {
  const int copies = shared_histogram_copies(counted + 1);
  if (copies > 0) {
    launch(std::true_type{}, sizeof(unsigned int) * (counted + 1) * copies, copies);
  } else {
    launch(std::false_type{}, size_t{0}, 1);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

inline int64_t target_blocks() {
  int device = 0, sm_count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  return 4 * static_cast<int64_t>(sm_count);
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Blocks of a flat grid-stride loop over `numel` values read `vec` at a time: enough to fill the
// device, and enough that no block visits 2^31 values (its 32-bit shared counters never overflow).
inline unsigned int flat_blocks(int64_t numel, int vec) {
  const int64_t per_block_cap = int64_t(1) << 31;
  const int64_t needed = std::max(target_blocks(), (numel + per_block_cap - 1) / per_block_cap);
  const int64_t per_block_step = static_cast<int64_t>(kThreads) * vec;
  const int64_t useful = (numel + per_block_step - 1) / per_block_step;
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min(needed, useful)));
}

// Grid over an (n_rows, n_cols) matrix: blockIdx.x a tile of kThreads * VEC columns,
// blockIdx.y a group of consecutive rows. Enough groups to fill the device when tiles are
// few, and groups small enough that a block visits fewer than 2^31 values.
struct RowTileGrid {
  int64_t n_tiles, n_groups, rows_per_group;
  dim3 grid() const {
    return dim3(static_cast<unsigned int>(n_tiles), static_cast<unsigned int>(n_groups));
  }
};

inline RowTileGrid row_tile_grid(int64_t n_rows, int64_t n_cols, int vec) {
  const int64_t tile = static_cast<int64_t>(kThreads) * vec;
  const int64_t n_tiles = (n_cols + tile - 1) / tile;
  TORCH_CHECK(n_tiles < (int64_t(1) << 31), "cockpit_fast: rows of ", n_cols,
              " values are too long for one CUDA grid");
  const int64_t max_rows = (int64_t(1) << 31) / tile;
  int64_t groups = std::max<int64_t>(1, target_blocks() / n_tiles);
  groups = std::max(groups, (n_rows + max_rows - 1) / max_rows);
  groups = std::min<int64_t>({groups, n_rows, 65535});
  const int64_t rows_per_group = (n_rows + groups - 1) / groups;
  TORCH_CHECK(rows_per_group <= max_rows, "cockpit_fast: ", n_rows,
              " samples are too many for one CUDA grid");
  return {n_tiles, (n_rows + rows_per_group - 1) / rows_per_group, rows_per_group};
}

}  // namespace cuda
}  // namespace cockpit_fast
