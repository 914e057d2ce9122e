// Every kept FP8 weight copy a forward reads, checked in one launch
// (Ops::QuantizeTransposeKeptMany). Checked one by one, each of the 96
// weights of the 24-layer LM's step took a launch whose blocks all left at
// once while the copy was current: 2.7 us of the GPU and a launch gap each.
//
// Block (x, i) takes item i's tiles x, x + gridDim.x, ... . Every block of an
// item reads the same two scales: where the kept scale is the quantizer's
// they all leave at once (block 0 copying the kept amax out), else they
// quantize as the wide cast-transpose kernel does and the item's last block
// to finish folds the item's amax (the stream slot's per-group counters) and
// records the scale and amax, after every block of the item has read them.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "kernels/cuda/cast_transpose.cuh"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// Items a launch takes: their pointers travel as the kernel's parameters,
// under the 4 KiB every driver takes.
constexpr int kKeptItemsPerLaunch = 40;
static_assert(kKeptItemsPerLaunch <= kFoldGroups, "an item folds in a group of its own");

struct KeptItem {
  const void* x;
  uint8_t* y;
  uint8_t* y_t;
  const float* scale;
  float* amax;
  float* scale_inv;
  float* kept_scale;
  float* kept_amax;
  int32_t rows, cols;
};
struct KeptItems {
  KeptItem item[kKeptItemsPerLaunch];
};
static_assert(sizeof(KeptItems) + sizeof(void*) <= 4096, "kernel parameters past 4 KiB");

template <typename In, typename Out>
__global__ void __launch_bounds__(256)
    QuantizeTransposeKeptManyKernel(const __grid_constant__ KeptItems items,
                                    GridFoldSlot* slot) {
  __shared__ unsigned scratch[32];
  const int i = blockIdx.y;
  const KeptItem& item = items.item[i];
  const float s = *item.scale;
  if (*item.kept_scale == s) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *item.amax = *item.kept_amax;
    return;
  }
  unsigned local = QuantizeWideTiles<In, Out, IdentityFn, false>(
      static_cast<const typename In::Storage*>(item.x), nullptr, item.y, item.y_t, s, nullptr,
      item.rows, item.cols, blockIdx.x, gridDim.x, IdentityFn());
  local = BlockMaxBits(local, scratch);
  if (threadIdx.x != 0) return;
  if (blockIdx.x == 0) *item.scale_inv = 1.0f / s;
  // The item's last block: every block of the item has read the kept scale.
  if (!FoldBlockBits(&slot->group_bits[i], &slot->groups_done[i], gridDim.x, local, item.amax)) {
    return;
  }
  *item.kept_scale = s;
  *item.kept_amax = *item.amax;
}

// Whether an item takes the kernel: whole wide tiles, and a size its int32
// fields hold.
bool TakesKernel(const Ops::KeptQuantizeItem& item) {
  return item.x.rank() == 2 && item.x.dim(0) <= INT32_MAX && item.x.dim(1) <= INT32_MAX &&
         WideTilesFit(item.x, item.y, item.y_t);
}

}  // namespace

absl::Status CudaOps::QuantizeTransposeKeptMany(const std::vector<KeptQuantizeItem>& items) {
  RETURN_IF_ERROR(CheckQuantizeTransposeKeptManyArgs(items));
  // Shapes the wide tiles do not cover go one by one.
  std::vector<const KeptQuantizeItem*> batched;
  for (const KeptQuantizeItem& item : items) {
    if (TakesKernel(item)) {
      batched.push_back(&item);
    } else {
      Tensor y = item.y, y_t = item.y_t;
      RETURN_IF_ERROR(QuantizeTransposeKept(item.x, item.fp8, item.kept, &y, &y_t));
    }
  }
  if (batched.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(Enter());
  // One launch per (x dtype, code dtype) and kKeptItemsPerLaunch items, in
  // the items' order.
  std::stable_sort(batched.begin(), batched.end(), [](const auto* a, const auto* b) {
    return std::make_pair(a->x.dtype(), a->y.dtype()) < std::make_pair(b->x.dtype(), b->y.dtype());
  });
  for (size_t first = 0; first < batched.size();) {
    const DType in = batched[first]->x.dtype(), out = batched[first]->y.dtype();
    size_t end = first;
    int64_t most_tiles = 1;
    KeptItems params{};
    while (end < batched.size() && end - first < kKeptItemsPerLaunch &&
           batched[end]->x.dtype() == in && batched[end]->y.dtype() == out) {
      const KeptQuantizeItem& item = *batched[end];
      const int64_t rows = item.x.dim(0), cols = item.x.dim(1);
      most_tiles = std::max(most_tiles, (rows / kWideTileRows) * (cols / kWideTileCols));
      params.item[end - first] = KeptItem{
          item.x.data(),
          static_cast<uint8_t*>(item.y.data()),
          static_cast<uint8_t*>(item.y_t.data()),
          item.fp8.scale.data_as<const float>(),
          item.fp8.amax.data_as<float>(),
          item.fp8.scale_inv.data_as<float>(),
          item.kept.scale.data_as<float>(),
          item.kept.amax.data_as<float>(),
          static_cast<int32_t>(rows),
          static_cast<int32_t>(cols)};
      ++end;
    }
    const int count = static_cast<int>(end - first);
    DispatchFloat(in, [&](auto in_format) {
      DispatchFp8(out, [&](auto out_format) {
        auto kernel = QuantizeTransposeKeptManyKernel<decltype(in_format), decltype(out_format)>;
        // The device's resident blocks shared among the items: a launch whose
        // scales all moved quantizes at full width, one whose copies are all
        // current is a few blocks an item.
        const int64_t resident = ResidentBlocks(context(), kernel, 256, 0);
        const int64_t per_item =
            std::max<int64_t>(1, std::min(most_tiles, (resident + count - 1) / count));
        kernel<<<dim3(static_cast<unsigned>(per_item), static_cast<unsigned>(count)), 256, 0,
                 stream()>>>(params, fold_slot_);
      });
    });
    CUDA_RETURN_IF_LAUNCH_ERROR();
    first = end;
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
