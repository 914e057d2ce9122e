// Test helpers for autoregressive decoding (test-only), on any backend:
// decoding a sequence one position at a time must give, row for row, what one
// causal forward of the whole sequence gives.
#ifndef TE_SERVER_LAYERS_DECODE_TESTING_H_
#define TE_SERVER_LAYERS_DECODE_TESTING_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/ops.h"

namespace te::layers::testing {

// Positions t..t + n - 1 of x [B, L, F] as a new [B, n, F] tensor of x's
// dtype (any trailing shape: x [B, L, ...]).
absl::StatusOr<Tensor> PositionsOf(Ops& ops, const Tensor& x, int64_t t, int64_t n);
// Position t alone: [B, 1, F].
inline absl::StatusOr<Tensor> TokenAt(Ops& ops, const Tensor& x, int64_t t) {
  return PositionsOf(ops, x, t, 1);
}

// t's elements as float on the host (read through a float32 copy on t's
// device), for float tensors of any backend; int32 as its values.
absl::StatusOr<std::vector<float>> HostValues(Ops& ops, const Tensor& t);

// x -> y of the same [B, S, F] layout.
using SequenceFn = std::function<absl::StatusOr<Tensor>(const Tensor& x)>;

// The worst row of decoding against one forward: runs `full` on x [B, L, F]
// once, then `step` on consecutive chunks of positions in order (x [B, n, F]
// for each n of `chunks`, which sum to L; empty: L chunks of one; `step`
// owns the cache), and returns the largest relative L2 error of one output
// row (b, t) against the forward's row (b, t).
absl::StatusOr<double> MaxDecodeRowError(Ops& ops, const Tensor& x, const SequenceFn& full,
                                         const SequenceFn& step,
                                         const std::vector<int64_t>& chunks = {});

}  // namespace te::layers::testing

#endif  // TE_SERVER_LAYERS_DECODE_TESTING_H_
