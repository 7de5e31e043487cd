// Parallel skeleton pieces shared by the CUDA kernels: vector loads, warp reductions and the
// (column tile x row group) grid. The histogram kernels' skeleton is in cuda_histogram.cuh.
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

inline int64_t target_blocks() {
  int device = 0, sm_count = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device));
  return 4 * static_cast<int64_t>(sm_count);
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

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
