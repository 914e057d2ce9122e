// RotaryQkQuantizeTranspose: the gradient of a packed QKV projection's output
// under FP8 with rotary embedding. The attention's backward leaves dqkv [B, S,
// 3, H, D]; its q and k parts take the inverse rotation, and the whole of it
// becomes the projection's E5M2 dy in both layouts (with its bias gradient).
// Apart, that is a rotation pass over q and k (read and written) and a
// cast-transpose pass over dqkv; here the cast-transpose's wide kernel
// rotates each pack as it reads it, so dqkv is read once and only codes are
// written.
#include <cstdint>

#include "kernels/cuda/cast_transpose.cuh"
#include "kernels/cuda/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/cuda/rotary.cuh"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

// The rotation of q's and k's adjacent pairs (2i, 2i + 1) in a cast-transpose
// of a packed qkv's rows [B * S, 3 * H * D]: a pack of 8 at column col lies
// inside one head (D % 8 == 0), and rotates where col < 2 * H * D (q and k;
// v passes as it is), by the angles of position row % S from
// MakeRotaryTable's table. Each rotated value is rounded to In as
// RotaryQkInPlace stores it (RotaryGroupKernel's RotatePair, then the
// store), so the codes are those of rotating in place and then quantizing.
struct RotateQkPairs {
  static constexpr bool kTransformsPacks = true;
  const float* cos_table;
  const float* sin_table;
  int64_t seq;
  int64_t dim;
  int64_t qk_cols;  // 2 * H * D
  __device__ __forceinline__ float operator()(float x) const { return x; }
  template <typename In>
  __device__ __forceinline__ void TransformPack(int64_t row, int64_t col, float (&v)[8]) const {
    if (col >= qk_cols) return;
    const int64_t half = dim / 2;
    // Pairs i0 .. i0 + 3 of the head: 16-byte aligned in the table (half % 4
    // == 0, i0 % 4 == 0).
    // 32-bit remainders (the launcher checks rows and columns fit): a 64-bit
    // one is a subroutine of some 60 instructions, twice a row of 8 elements.
    const uint32_t position = static_cast<uint32_t>(row) % static_cast<uint32_t>(seq);
    const uint32_t in_head = static_cast<uint32_t>(col) % static_cast<uint32_t>(dim);
    const int64_t at = int64_t(position) * half + in_head / 2;
    const float4 c = *reinterpret_cast<const float4*>(cos_table + at);
    const float4 s = *reinterpret_cast<const float4*>(sin_table + at);
    const float cs[4] = {c.x, c.y, c.z, c.w};
    const float ss[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float2 rotated = RotatePair(v[2 * m], v[2 * m + 1], cs[m], ss[m]);
      v[2 * m] = In::Load(In::Store(rotated.x));
      v[2 * m + 1] = In::Load(In::Store(rotated.y));
    }
  }
};

}  // namespace

absl::Status CudaOps::RotaryQkQuantizeTranspose(const RotaryArgs& args, Tensor* qkv,
                                                const Fp8Output& fp8, Tensor* y, Tensor* y_t,
                                                Tensor* dbias) {
  RETURN_IF_ERROR(CheckRotaryQkQuantizeTransposeArgs(args, qkv, fp8, y, y_t, dbias));
  const int64_t seq = qkv->dim(1), heads = qkv->dim(3), dim = qkv->dim(4);
  const Tensor rows = PackedQkvRows(*qkv);
  // The one pass takes 2-byte elements in adjacent pairs (TE's default group
  // method) whose packs of 8 stay inside a head, angles from a table of host
  // positions, and the wide kernel's whole tiles; anything else rotates in
  // place, then quantizes.
  const bool fused = DTypeSize(qkv->dtype()) == 2 && args.consecutive &&
                     !HasDevicePosition(args.position) && seq > kFoldedRotaryMaxSeq &&
                     dim % 8 == 0 && WideTilesFit(rows, *y, *y_t) &&
                     rows.dim(0) <= UINT32_MAX && rows.dim(1) <= UINT32_MAX;
  if (!fused) return Ops::RotaryQkQuantizeTranspose(args, qkv, fp8, y, y_t, dbias);
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(const cuda::RotaryTable table, TableFor(*this, args, seq, dim));
  const int64_t cols = rows.dim(1);
  Tensor partial;
  const int64_t partial_rows = CastTransposePartialRows(rows, *y, *y_t);
  if (dbias != nullptr) {
    ASSIGN_OR_RETURN(partial, Allocate(DType::kF32, {partial_rows, cols}));
  }
  const RotateQkPairs rotate{table.cos, table.sin, seq, dim, 2 * heads * dim};
  DispatchFloat(qkv->dtype(), [&](auto in) {
    using In = decltype(in);
    if constexpr (sizeof(typename In::Storage) == 2) {
      DispatchFp8(y->dtype(), [&](auto out) {
        using Out = decltype(out);
        const float* scale = fp8.scale.data_as<const float>();
        float* scale_inv = fp8.scale_inv.data_as<float>();
        if (dbias != nullptr) {
          LaunchCastTranspose<In, Out, true>(context(), stream(), rows, y, y_t, scale,
                                             AmaxOutFor(fp8), scale_inv,
                                             partial.data_as<float>(), nullptr, nullptr, rotate);
        } else {
          LaunchCastTranspose<In, Out, false>(context(), stream(), rows, y, y_t, scale,
                                              AmaxOutFor(fp8), scale_inv, nullptr, nullptr,
                                              nullptr, rotate);
        }
      });
    }
  });
  CUDA_RETURN_IF_LAUNCH_ERROR();
  if (dbias != nullptr) {
    LaunchPartialColumnSums(partial.data_as<const float>(), partial_rows, cols, dbias->dtype(),
                            dbias->data(), stream());
    CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  return absl::OkStatus();
}

}  // namespace cuda
}  // namespace te
