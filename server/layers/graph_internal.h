// Internals of the graph layer (graph.h), shared by its files: the checked
// structure and its topological order (graph_build.cc), shape and dtype
// inference (graph_infer.cc), the glue ops' forward and backward
// (graph_ops.cc), jax.numpy's nodes (graph_numpy*.cc, graph_einsum.cc,
// graph_param.cc) and the executor (graph.cc). Not part of the layer API.
#ifndef TE_SERVER_LAYERS_GRAPH_INTERNAL_H_
#define TE_SERVER_LAYERS_GRAPH_INTERNAL_H_

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "server/layers/blocks.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers::graph {

enum class NodeKind {
  kModule,
  kReshape,
  kSplit,
  kConcatenate,
  kAdd,
  kScale,
  kCast,
  kTranspose,
  kDropout,
  kCausalMask,
  kSoftmaxCrossEntropy,  // inputs logits, labels: the loss (graph_lm.cc)
  kAttend,               // nn.Embed.attend: reads an Embed node's embedding (graph_lm.cc)
  // jax.numpy on traced tensors (graph_numpy.cc, graph_einsum.cc).
  kBinary,
  kUnary,
  kWhere,
  kReduce,
  kEinsum,
  kSlice,
  kSoftmax,
  kParam,  // self.param: no inputs, reads the variable params/<name> (graph_param.cc)
};

// The jax.numpy kinds but param, which graph.cc runs itself (it reads a variable).
bool IsNumpyKind(NodeKind kind);

// An einsum's equation, parsed: each term's labels (letters as their
// character code, kEllipsis where "..." stands).
struct EinsumTerms {
  static constexpr int kEllipsis = -1;
  std::vector<int> a, b, out;
};

// A named edge. Tensors are numbered in the order they are first named: the
// graph's inputs first ("x" is tensor 0), then each node's outputs.
struct TensorDef {
  std::string name;
  int producer = -1;     // the writing node; -1 for the graph's inputs
  int extra_index = -1;  // i for "extra_inputs[i]"
  // "attention_mask" or a causal_mask node's output: read only as a module's
  // mask, carries no data on the device and no gradient.
  bool is_mask = false;
};

struct Node {
  NodeKind kind = NodeKind::kModule;
  std::string name;
  std::string field;        // "spec.graph.nodes[i] (<name>)", for messages
  std::vector<int> inputs;  // tensor ids
  std::vector<int> outputs;
  int mask = -1;            // a module's mask tensor, -1 when none

  // kModule. mask_type: the attention mask type of a module that takes a
  // mask (unset for modules that take none). returns_ln_out: the module's
  // LayerOutputs.ln_out exists, so it may have a second output.
  std::unique_ptr<Layer> module;
  std::optional<MaskType> mask_type;
  bool returns_ln_out = false;
  // A TE module of the padding type whose mask is a causal_mask node's
  // output: it applies that mask elementwise, as TE's unfused softmax does
  // (nonzero = masked out: make_causal_mask's ones, the keys j <= i).
  bool causal_node_elementwise = false;

  // Glue fields as the spec gives them; Infer resolves them against shapes.
  std::vector<int64_t> shape;  // reshape (one -1 at most)
  int axis = 0;                // split, concatenate (may be negative)
  int parts = 0;               // split
  float factor = 1.0f;         // scale
  DType dtype = DType::kF32;   // cast
  std::vector<int> axes;       // transpose; empty: reversed (numpy's default)
  float rate = 0.0f;           // dropout
  std::vector<int> broadcast_dims;

  // A flax_embed module node: its table's shape and dtype, for attend nodes.
  bool is_embed = false;
  int64_t vocab = 0, features = 0;
  DType param_dtype = DType::kF32;
  // kAttend: the Embed node it reads (index), and attend's dtype (nullopt: promote).
  int embed = -1;
  std::optional<DType> attend_dtype;

  // jax.numpy nodes. binary: its op and scalar as given (the scalar is
  // rounded to the operand's dtype at the forward, JAX's weak typing).
  BinaryOp binary_op = BinaryOp::kAdd;
  std::optional<double> scalar;
  bool scalar_first = false;
  UnaryOp unary_op = UnaryOp::kNegative;
  std::optional<double> where_x, where_y;  // where's constants
  ReduceOp reduce_op = ReduceOp::kSum;     // reduce (axes in `axes`, empty: all)
  bool keepdims = false;
  EinsumTerms einsum;
  bool tf32 = true;                        // einsum at PRECISION_DEFAULT
  std::vector<int64_t> start, limit, stride;  // slice (stride empty: 1s)
  bool log = false;                        // softmax (axis in `axis`)
  te::v1::Initializer initializer;         // param (shape in `shape`, dtype in `dtype`)
};

// A checked graph: every tensor written once, every read tensor written, no
// cycle, and `order` a topological order of the nodes (ties in spec order).
struct Graph {
  std::vector<Node> nodes;
  std::vector<TensorDef> tensors;
  int num_extra = 0;        // the graph reads extra_inputs[0 .. num_extra)
  std::vector<int> extras;  // tensor id of extra_inputs[i]; -1 when not read
  int attention_mask = -1;  // tensor id of "attention_mask"; -1 when not read
  std::vector<int> outputs; // y, then ln_out when given
  std::vector<int> order;
  // Forward: the tensors whose last reader is node k, dropped after it ran
  // (graph outputs are never dropped), so peak memory follows the live set.
  std::vector<std::vector<int>> last_read_by;
};

inline constexpr int kX = 0;  // the tensor id of "x"

// Parses and checks the spec's structure (INVALID_ARGUMENT naming
// "spec.graph.nodes[i] (<name>)..." or "spec.graph.outputs..."), creating
// every module node's layer with CreateLayer.
absl::StatusOr<Graph> BuildGraph(const te::v1::GraphSpec& spec);

// What inference knows of a tensor.
struct TensorInfo {
  bool known = false;  // false: its shape derives from an extra input (unknown at init)
  Shape shape;
  std::optional<DType> dtype;  // nullopt: the graph's input dtype, not known yet
};

// A node's fields resolved against its input's shape.
struct NodePlan {
  Shape to;                         // reshape: the new shape, -1 resolved
  int axis = 0;                     // split, concatenate: in [0, rank)
  std::vector<int> perm;            // transpose: out.dim(i) = in.dim(perm[i])
  std::vector<int> broadcast_dims;  // dropout: in [0, rank), sorted, unique
  Shape keep;                       // reduce: x's shape with the reduced axes 1
  std::vector<int64_t> stride;      // slice: one per axis
  // einsum as batched GEMMs (graph_einsum.cc): a permuted (`perm_a`,
  // empty: a itself) to [batch, M, K], or [batch, K, M] when transpose_a
  // takes it as it is; b to [batch, K, N] or [batch, N, K]; the product
  // [batch, M, N] permuted to the output. Each group (batch, M, K, N) is the
  // labels of that class, so the *_dims shapes list them one by one.
  struct Einsum {
    std::vector<int> perm_a, perm_b;  // y.dim(i) = x.dim(perm[i]), as Transpose's
    bool transpose_a = false, transpose_b = false;
    Shape mk_dims, kn_dims, mn_dims;  // [batch.., M.., K..] etc.: the labels' sizes
    std::vector<int> back_a, back_b;  // mk_dims -> a's order, kn_dims -> b's
    std::vector<int> perm_out;        // mn_dims -> the output's order
    int64_t batch = 1, m = 1, n = 1, k = 1;
  } einsum;
};

// What a jax.numpy node keeps for its backward: the operands and outputs
// it needs (handles, no copies).
struct NumpySaved {
  std::vector<Tensor> kept;
  int64_t bytes() const;
};

struct Plan {
  std::vector<TensorInfo> tensors;  // by tensor id
  std::vector<NodePlan> nodes;      // by node index
};

// Called for each module node, in order, with its x's shape (known).
using ModuleVisitor = std::function<absl::Status(const Node& node, const Shape& x)>;

// Shapes and dtypes of every tensor from the graph's inputs: x, and the extra
// inputs when `extras` has one per extra input (empty: x's dtype and an
// unknown shape, as at init without declared extra inputs, where a module's x
// must not depend on them). INVALID_ARGUMENT naming the
// node where a shape or dtype does not fit, or a module's own
// VariableSpecs/OutputShape error (from `on_module`, may be null) prefixed by
// the node.
absl::StatusOr<Plan> Infer(const Graph& graph, const TensorInfo& x,
                           const std::vector<TensorInfo>& extras, const ModuleVisitor& on_module);

// ---- decoding (graph_decode.cc) ------------------------------------------------
// How a module node runs one position at a time (generation's decode steps,
// ForwardOptions::internal_decode): position-wise modules (norms, dense
// layers, activations, Embed) as they are; causal self-attention modules
// (MultiHeadAttention, TransformerLayer) through their cache; anything else
// (DotProductAttention, Flax's attention, a composite) not at all.
enum class DecodeRole { kPositionWise, kCached, kUnsupported };
DecodeRole DecodeRoleOf(const Layer& module);
// The tensor a decode step returns: the logits a softmax_cross_entropy node
// takes when it makes y (the loss needs labels the step does not have),
// else y.
int DecodeOutput(const Graph& graph);
// by node: whether it feeds tensor `id` (the nodes a decode step runs).
std::vector<bool> NodesFeeding(const Graph& graph, int id);

// ---- glue ops (graph_ops.cc) --------------------------------------------------
// Forward of a glue node on its input tensors: fills *out (one per output;
// undefined for causal_mask's, which carries no data). Dropout runs unless
// `deterministic`, with `seed` = DeriveSeed(dropout_seed, node name), and fills
// *dropout for the backward.
absl::Status GlueForward(Ops& ops, const Node& node, const NodePlan& plan,
                         const std::vector<Tensor>& in, bool deterministic, uint64_t seed,
                         std::vector<Tensor>* out, DropoutSaved* dropout);

// Backward of a glue node: `dout` has one gradient per output (undefined: no
// gradient reached it, counted as zeros); fills *din with one per input
// (undefined: none, e.g. causal_mask's), each in its input's dtype.
absl::Status GlueBackward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                          const DropoutSaved& dropout, const std::vector<Tensor>& dout,
                          std::vector<Tensor>* din);

// ---- jax.numpy nodes (graph_numpy*.cc, graph_einsum.cc, graph_param.cc) ----------
// The op fields of a binary, unary, where, reduce, einsum, slice, softmax or
// param node and their arity (INVALID_ARGUMENT naming the field).
absl::Status ParseNumpyNode(const te::v1::GraphSpec::Node& spec, Node* node);
absl::Status ParseEinsum(const std::string& equation, const std::string& where, EinsumTerms* terms);
absl::Status ParseParam(const te::v1::GraphSpec::Param& spec, const std::string& where, Node* node);

// Inference of such a node from its inputs' infos: fills *out (one per
// output) and the node's plan.
absl::Status InferNumpyNode(const Node& node, const std::vector<TensorInfo>& in,
                            std::vector<TensorInfo>* out, NodePlan* plan);
absl::Status InferEinsum(const Node& node, const TensorInfo& a, const TensorInfo& b,
                         TensorInfo* out, NodePlan* plan);
// The dtype a numpy or param node gives for its inputs' dtypes (inference's
// rule without shapes, for Layer::OutputDType).
DType NumpyOutputDType(const Node& node, const std::vector<DType>& in);

// Forward and backward of an IsNumpyKind node: as GlueForward / GlueBackward.
absl::Status NumpyForward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                          const std::vector<Tensor>& in, std::vector<Tensor>* out,
                          NumpySaved* saved);
absl::Status NumpyBackward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                           const NumpySaved& saved, const std::vector<Tensor>& dout,
                           std::vector<Tensor>* din);
absl::Status EinsumForward(Ops& ops, const Node& node, const NodePlan& plan, const Tensor& a,
                           const Tensor& b, const Shape& out_shape, Tensor* y, NumpySaved* saved);
absl::Status EinsumBackward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                            const NumpySaved& saved, const Tensor& dy, std::vector<Tensor>* din);

// A param node's variable: "params/<node name>", its spec, and its initial
// value from the layer's seed (DeriveSeed(seed, node name)).
std::string ParamName(const Node& node);
VariableSpec ParamSpec(const Node& node);
absl::Status InitParam(Ops& ops, uint64_t seed, const Node& node, Variables* vars);

// ---- language-model nodes (graph_lm.cc) ----------------------------------------
// What a softmax_cross_entropy or attend node keeps for its backward.
struct LmSaved {
  Tensor logits;  // [N, V]
  Tensor labels;  // int32 [N]
  Tensor lse;     // f32 [N]
  Tensor x;       // attend: x and the embedding in the compute dtype
  Tensor embedding;
  DType x_dtype = DType::kF32;
  int64_t bytes() const;
};

// softmax_cross_entropy: *loss f32 [] from logits [..., V] and labels [...].
absl::Status LossForward(Ops& ops, const Tensor& logits, const Tensor& labels, Tensor* loss,
                         LmSaved* saved);
// dloss f32 []: din = {dlogits (logits' dtype), undefined (labels)}.
absl::Status LossBackward(Ops& ops, const LmSaved& saved, const Tensor& dloss,
                          std::vector<Tensor>* din);
// attend with `embedding` (the Embed node's variable).
absl::Status AttendNodeForward(Ops& ops, const Node& node, const Tensor& embedding,
                               const Tensor& x, Tensor* y, LmSaved* saved);
// din = {dx}; *dembedding in the embedding's dtype.
absl::Status AttendNodeBackward(Ops& ops, const Node& node, const LmSaved& saved,
                                const Tensor& dy, std::vector<Tensor>* din, Tensor* dembedding);

// A zero tensor of `shape` and `dtype`.
absl::StatusOr<Tensor> Zeros(Ops& ops, DType dtype, const Shape& shape);

// Parts of a concatenation along `axis` (the inverse of Concatenate): views
// of x when the axis is outermost, else copies.
absl::StatusOr<std::vector<Tensor>> SplitAlong(Ops& ops, const Tensor& x, int axis,
                                               const std::vector<int64_t>& sizes);
// Parts of one dtype and rank, equal but along `axis`, concatenated.
absl::StatusOr<Tensor> Concatenate(Ops& ops, const std::vector<Tensor>& parts, int axis);
// Ops::Permute of any rank: dims that stay neighbours and dims of size 1 are
// merged first; INVALID_ARGUMENT when more than Permute's 5 remain.
absl::Status PermuteAnyRank(Ops& ops, const Tensor& x, const std::vector<int>& perm, Tensor* y);
// The rank Ops::Permute is asked for after merging (for checks at init).
int MergedPermuteRank(const Shape& shape, const std::vector<int>& perm);

}  // namespace te::layers::graph

#endif  // TE_SERVER_LAYERS_GRAPH_INTERNAL_H_
