// Graph: te.v1.GraphSpec, a composite Flax module as one layer (DESIGN.md
// section 11). Nodes are modules (any LayerSpec but a graph)
// and glue ops (reshape, split, concatenate, add, scale, cast, transpose,
// dropout, causal_mask); edges are named tensors. The server runs the whole
// DAG on the device, so a step of the composite is one call and no
// activation crosses the wire. Like every Layer it is const and
// thread-compatible; all state lives in the caller's Variables and
// SavedForward.
//
// Checks, all INVALID_ARGUMENT naming "spec.graph.nodes[i] (<name>)" (or
// "spec.graph.outputs[j]") and the problem:
//  * MakeGraph: node names empty (but a module's, below) or repeated; a
//    tensor written twice (or a graph input written); a tensor read but
//    never written; a cycle; outputs empty or never written; an op's arity or
//    fields (split.parts < 2, a reshape shape with zeros or two -1, a cast to
//    a non-float dtype, a dropout rate outside [0, 1), a non-finite scale);
//    a module's own spec errors; a mask on a module that takes none; a
//    causal_mask fed to a module whose mask type is not causal.
//  * VariableSpecs / OutputShape / Init, from x's shape: every shape the
//    graph meets (split parts not dividing the axis, transpose axes that are
//    no permutation, a reshape of another element count, concatenated or
//    added shapes that differ), and each module's own VariableSpecs /
//    OutputShape errors, prefixed by its node. The extra inputs' shapes are
//    not known there: a module's x must derive from the graph's x.
//  * Forward: the same with the request's x and extra inputs, before any
//    node runs.
//
// Variables: a module node's are its own under the node's name
// ("params/TEUnfusedMLP_0/DenseGeneral_0/kernel",
// "fp8_metas/DenseGeneral_1/kernel_amax_history"); its init key and dropout
// seed are DeriveSeed(seed, node name), and a dropout node's seed
// DeriveSeed(dropout_seed, node name) (kernels/rng.h). Each module node has its
// own FP8 state, which the session's UpdateFp8Metas moves as for one module.
// A param node (self.param) is the variable "params/<node name>", drawn at
// init from its initializer with the seed DeriveSeed(seed, node name); the
// jax.numpy nodes (binary, unary, where, reduce, einsum, slice, softmax) hold
// none (graph_numpy*.cc, graph_einsum.cc, graph_param.cc).
//
// Inputs: "x", "extra_inputs[i]" (the graph takes exactly as many extra
// inputs as the highest index it reads, plus one) and "attention_mask": a
// module whose mask is "attention_mask" gets the request's padding lengths;
// one whose mask is a causal_mask node's output gets none (its own causal
// mask type applies causality, as TE's causal types ignore the mask).
//
// Outputs: y = LayerOutputs.y; the outputs after it are LayerOutputs.aux (a
// loss function's aux outputs) and get no gradient; the second, when named,
// is LayerOutputs.ln_out too. y's dtype is what the graph makes of x's (a
// cast changes it); Backward takes dy in any float dtype.
//
// A module node named "" has the root scope: its variables keep the module's
// own names ("params/kernel"), so a graph over a layer that is one module
// (AddGraph) reads that layer's variables. It must be the graph's only module.
//
// Declared extra inputs (InitLayerRequest / AddGraphRequest.extra_inputs):
// without them an extra input has x's dtype (a float, or int32 ids where x
// feeds an Embed) and an unknown shape until a forward, so a module's x must
// not derive from one. With them each has its declared dtype, any of float32,
// bfloat16, float16, int32 and bool (int32 labels beside a float x), and a
// shape that inference knows for every x (DeclaredExtraShape): a graph's
// shape and dtype errors over its extra inputs come at init, and a forward
// whose extra input has another dtype or shape is INVALID_ARGUMENT naming
// "extra_inputs[i]".
#ifndef TE_SERVER_LAYERS_GRAPH_H_
#define TE_SERVER_LAYERS_GRAPH_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// A graph's extra inputs as the traced call had them, beside that call's x.
struct DeclaredExtras {
  Shape x;                    // the x they were declared with
  std::vector<DType> dtypes;  // extra_inputs[i]'s
  std::vector<Shape> shapes;
};

// The shape a declared extra input has beside an x of `x`: `declared` with
// its leading dims that equal `declared_x`'s (a batch, a sequence) taken
// from `x` (te.v1: "leading dimensions follow x's at later calls").
Shape DeclaredExtraShape(const Shape& declared, const Shape& declared_x, const Shape& x);

// Whether two declarations describe the same inputs: both none, or the same
// dtypes and each shape of `b` the one `a`'s gives for b's x.
bool SameDeclaredExtras(const std::optional<DeclaredExtras>& a,
                        const std::optional<DeclaredExtras>& b);

// OK when an extra input of `dtype` and `shape`, beside an x of `x`, is
// what `extras` declares for extra_inputs[i] (i < its count); else
// INVALID_ARGUMENT naming `field` ("extra_inputs[i]") and both.
absl::Status CheckDeclaredExtra(const DeclaredExtras& extras, size_t i, DType dtype,
                                const Shape& shape, const Shape& x, const std::string& field);

// Validates the graph's structure and builds every module node with
// CreateLayer. The nodes run in a dependency order computed here (among
// ready nodes, the first listed first). `extras`, when given, declares one
// dtype and shape per extra input the graph reads (INVALID_ARGUMENT naming
// "extra_inputs" for another count or a dtype the graph cannot take).
absl::StatusOr<std::unique_ptr<Layer>> MakeGraph(
    const te::v1::GraphSpec& spec, std::optional<DeclaredExtras> extras = std::nullopt);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_GRAPH_H_
