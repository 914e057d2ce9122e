// Rotary embedding's angles on the device, shared by the rotary kernels
// (position.cu) and the decode attention kernel that rotates a step's query
// and key itself (attention_decode.cu).
#ifndef TE_KERNELS_CUDA_ROTARY_CUH_
#define TE_KERNELS_CUDA_ROTARY_CUH_

#include <cstdint>

#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/ops.h"

namespace te {
namespace cuda {

// cos / sin of the angle of position p and frequency index i, computed in
// double, as on the CPU: near position 10^4 a float angle is off by ~5e-4
// radians. The table kernel and the folded rotation both call this, so they
// give the same bits.
__device__ __forceinline__ void RotaryCosSin(int64_t p, int64_t i, int64_t dim,
                                             double min_timescale, double ratio, bool inverse,
                                             float* c, float* s) {
  const double timescale = min_timescale * pow(ratio, 2.0 * static_cast<double>(i) / dim);
  const double angle = static_cast<double>(inverse ? -p : p) / timescale;
  double sd, cd;
  sincos(angle, &sd, &cd);
  *c = static_cast<float>(cd);
  *s = static_cast<float>(sd);
}

// The angles of a rotation: position p of row s along S is start + s, start
// = position_offset + *position (device int32, may be null), read when the
// kernel runs, so one launch serves every position of a replayed step.
struct RotaryAngles {
  int64_t dim;
  double min_timescale;
  double ratio;
  bool inverse;
  int64_t position_offset;
  const int32_t* position;
  __device__ __forceinline__ int64_t Start() const {
    return position_offset + (position != nullptr ? *position : 0);
  }
};

// (a, b) rotated by the angle whose cosine and sine are c and s: (a c - b s,
// b c + a s), each product and sum rounded on its own as the CPU reference
// rounds them (no fused multiply-add the compiler may or may not form), so
// every kernel that rotates a row gives the same bits.
__device__ __forceinline__ float2 RotatePair(float a, float b, float c, float s) {
  return make_float2(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)),
                     __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
}

// Sequences of at most this many positions rotate without a table.
constexpr int64_t kFoldedRotaryMaxSeq = 16;

// A sequence's table of angles: cos / sin of positions angles.Start() + s at
// [s * half + i], s < seq, i < half = angles.dim / 2, written by a kernel
// queued on the op's stream (position.cu); `memory` holds both.
struct RotaryTable {
  Tensor memory;
  const float* cos = nullptr;
  const float* sin = nullptr;
};
absl::StatusOr<RotaryTable> MakeRotaryTable(CudaOps& ops, const RotaryAngles& angles,
                                            int64_t seq);
// args.table where the caller gave one (checked by CheckRotaryArgs), else
// MakeRotaryTable's for args' angles over seq rows of `dim`.
absl::StatusOr<RotaryTable> TableFor(CudaOps& ops, const RotaryArgs& args, int64_t seq,
                                     int64_t dim);

// The angles of `args` for rows of `dim` elements.
inline RotaryAngles AnglesOf(const RotaryArgs& args, int64_t dim) {
  RotaryAngles angles{};
  angles.dim = dim;
  angles.min_timescale = args.min_timescale;
  angles.ratio = static_cast<double>(args.max_timescale) / args.min_timescale;
  angles.inverse = args.inverse;
  angles.position_offset = args.position_offset;
  angles.position =
      HasDevicePosition(args.position) ? args.position.data_as<const int32_t>() : nullptr;
  return angles;
}

}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ROTARY_CUH_
