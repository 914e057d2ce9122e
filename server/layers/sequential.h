// Sequential: te.v1.SequentialSpec, a chain of modules and the glue of a
// composite Flax module (reshapes of trailing dims, a split of the last axis,
// residual adds), as one layer. It is a front end of the graph layer
// (graph.h), the server's one composite mechanism: the chain is translated
// into an equivalent te.v1.GraphSpec and the graph runs it.
//
// Translation, stage by stage:
//  * a module stage -> a module node named by the stage name, reading the
//    chain's current tensors (x, then its extra inputs); with
//    pass_attention_mask, a module that takes a mask reads "attention_mask";
//  * reshape {from, to} -> a reshape node to the full shape (the tensor's
//    leading dims, then `to`);
//  * split_last_axis n -> a split node (axis -1, n parts);
//  * FORK remembers the current tensor; its JOIN -> an add node of the
//    current tensor and the remembered one.
// The first stage, when it is a module taking k and v, reads extra_inputs[0]
// and [1]. A reshape's full shape needs the shapes before it, so the graph is
// built per x shape (at VariableSpecs / OutputShape / Init, and at Forward
// for the request's x) and kept for later calls with that shape; a chain
// therefore takes any leading dims, as a module does.
//
// Variables are the modules' own under "<collection>/<stage name>/...", and
// a module's init key and dropout seed are NodeSeed(seed, stage name)
// (kernels/rng.h), as for every graph node and in both clients' chains.
// Errors name "spec.sequential.stages[i]" (INVALID_ARGUMENT).
#ifndef TE_SERVER_LAYERS_SEQUENTIAL_H_
#define TE_SERVER_LAYERS_SEQUENTIAL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// Validates the spec (INVALID_ARGUMENT naming "spec.sequential.stages[i]...":
// names, reshapes, split parts, FORK/JOIN balance, and what the graph finds
// of its structure, such as a module's own spec errors or its input count).
absl::StatusOr<std::unique_ptr<Layer>> MakeSequential(const te::v1::SequentialSpec& spec);

// The graph a chain stands for, for an input x of `input_shape`
// (INVALID_ARGUMENT naming the stage when a shape does not fit). Exposed for
// tests and tools that show what the server runs.
absl::StatusOr<te::v1::GraphSpec> SequentialAsGraph(const te::v1::SequentialSpec& spec,
                                                    const Shape& input_shape);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_SEQUENTIAL_H_
