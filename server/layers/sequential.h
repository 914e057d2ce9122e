// Sequential: te.v1.SequentialSpec, a chain of modules and the glue of a
// composite Flax module (reshapes, a split of the last axis, residual adds),
// as one layer. The server runs the whole chain on the device, so a client's
// composite layer costs one call per step instead of one per module with
// every intermediate tensor crossing the wire.
//
// Forward keeps each module's saved forward; Backward runs the chain in
// reverse: a reshape's backward reshapes back, a split's stacks the parts'
// gradients, a JOIN hands its gradient to both branches and the FORK adds the
// two. Variables are the modules' own under "<collection>/<stage name>/...".
#ifndef TE_SERVER_LAYERS_SEQUENTIAL_H_
#define TE_SERVER_LAYERS_SEQUENTIAL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// Validates the spec (INVALID_ARGUMENT naming "spec.sequential.stages[i]...")
// and builds every module stage with CreateLayer.
absl::StatusOr<std::unique_ptr<Layer>> MakeSequential(const te::v1::SequentialSpec& spec);

// Stage i's init and dropout seeds come from kernels/rng.h's StageSeed, as
// in the clients' Sequential, so both give the same numbers.

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_SEQUENTIAL_H_
