// Graph: a composite module (a Flax module whose __call__ composes modules
// with glue) built as one te.v1.GraphSpec, node for node as the Flax code
// writes it and with the Python tracer's names (client/python/te_client/
// graph.py), so both clients send the same spec for the same module. A Graph
// is a Module: Init / Apply / ValueAndGrad run it on the server as one layer,
// a step is one call and no activation leaves the device (DESIGN.md 11).
//
//   Graph g("Block", {4, 2048, 4096}, DType::kBF16);   // the input x
//   Graph::Edge h = g.Call(FlaxDense(4096), {g.x()});   // "Dense_0"
//   g.SetOutput(g.Add(g.x(), h));                        // cast_0 (x to float32), add_0
//
// Names:
//  * a module node is its Flax scope path: the name given, or Flax's
//    automatic "<type_name>_<n>", n counting that type in the scope
//    ("Dense_1", "FlaxMLP_0/Dense_0"). Dropout is a Flax module too.
//  * a glue node is "<scope>/<op>_<n>", n counting that op in the scope in
//    call order, passing over names modules hold; <op> is the GraphSpec.Node
//    field ("reshape", "causal_mask"), "activation" for TE's activation
//    function and "gelu" for nn.gelu.
//  * a node's one output is the edge named as the node; several are
//    "<node>:<i>". The graph's inputs are "x", "attention_mask" and
//    "extra_inputs[i]".
// Glue the output does not depend on is left out, and not counted (module
// nodes stay: Flax creates their variables either way).
//
// Dtypes promote as JAX's do: an add or concatenate of bfloat16 and float32
// tensors casts the bfloat16 one to float32 first (a cast node). A TE module
// returns its input's dtype; a Flax module its dtype, else the promotion of
// the input's and param_dtype.
//
// Errors, as XLA's builder keeps them: the first bad use (a shape that does
// not fit, a mask read as data, a module name used twice) is remembered,
// names the node, and is what Spec() returns, INVALID_ARGUMENT; calls after
// it record nothing and return an invalid Edge. Thread-compatible.
#ifndef TE_CLIENT_GRAPH_H_
#define TE_CLIENT_GRAPH_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/modules.h"

namespace te::client {

// nn.Embed's dtypes (Graph::Embed).
struct EmbedOptions {
  std::optional<DType> dtype;  // None: param_dtype
  DType param_dtype = DType::kF32;
};

class Graph : public Module {
 public:
  // A tensor of this graph (a handle; its name is given at Spec()).
  struct Edge {
    Edge() : id(-1) {}  // invalid: no mask, or a failed call's result
    explicit Edge(int id) : id(id) {}
    int id;
  };

  // The composite's class name (type_name()) and the x it is built for: a
  // different x shape at Init is the server's INVALID_ARGUMENT.
  Graph(std::string type_name, Shape x_shape, DType x_dtype);

  Edge x() const { return Edge{0}; }
  // The request's attention mask, bool [batch, 1, q_len, kv_len]: only a
  // module's mask may read it.
  Edge AttentionMask(Shape shape);
  // ForwardRequest.extra_inputs[i], of any dtype: Init and AddGraph declare
  // each one's dtype and shape (ExtraInputs), and a call's must match them,
  // leading dims that are x's following x's (labels [batch] beside x
  // [batch, features] at any batch).
  Edge ExtraInput(int i, Shape shape, DType dtype);

  const Shape& shape(Edge e) const;  // an invalid edge's is empty
  DType dtype(Edge e) const;

  // Enters a submodule's scope for the Scope's lifetime: Flax's automatic
  // "<type_name>_<n>" in the current scope, or `name`.
  class [[nodiscard]] Scope {
   public:
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    friend class Graph;
    explicit Scope(Graph* graph) : graph_(graph) {}
    Graph* graph_;
  };
  Scope Submodule(const std::string& type_name, const std::string& name = "");

  // A module node reading `inputs` (x, then its extra inputs such as k, v)
  // and, for attention, `mask` (AttentionMask() or a CausalMask() output).
  // Returns y; CallAll also the layernorm output of a module that returns it.
  Edge Call(const Module& module, const std::vector<Edge>& inputs, Edge mask = {}, const std::string& name = "");
  std::vector<Edge> CallAll(const Module& module, const std::vector<Edge>& inputs, Edge mask = {},
                            const std::string& name = "");

  // ---- glue (the tensor itself where the op is the identity, as JAX's) ----------
  Edge Reshape(Edge t, Shape shape);  // the whole new shape; one -1 at most
  std::vector<Edge> Split(Edge t, int parts, int axis);  // jnp.split: equal parts
  Edge Concatenate(const std::vector<Edge>& ts, int axis);
  Edge Add(Edge a, Edge b);  // equal shapes
  Edge Scale(Edge t, double factor);
  Edge Cast(Edge t, DType dtype);  // astype
  Edge Transpose(Edge t, const std::vector<int>& axes);
  // nn.Dropout(rate)(t): a Flax module ("Dropout_<n>"), off when the request
  // is deterministic; rate 0 is the identity.
  Edge Dropout(Edge t, float rate, const std::vector<int>& broadcast_dims = {}, const std::string& name = "");
  // nn.make_causal_mask(x[..., 0]) for x [batch, seq, ...]: a mask edge.
  Edge CausalMask(Edge x);
  // te.activation.activation(t, activations): [..., n, I] -> [..., I] (a
  // single activation's [..., 1, I] reshaped to [..., I] first).
  Edge Activation(Edge t, const std::vector<std::string>& activations);
  // nn.gelu(t) (approximate, Flax's default): TE's tanh gelu.
  Edge Gelu(Edge t);

  // ---- language-model nodes (a byte-level LM, as client/python/examples/train_lm.py) ----
  // nn.Embed(num_embeddings, features)(ids): a module node (Flax's
  // "Embed_<n>", or `name`) reading int32 ids [...] and returning
  // [..., features] in `dtype`, else param_dtype (its variable
  // "embedding" [num_embeddings, features], default_embed_init).
  Edge Embed(Edge ids, int64_t num_embeddings, int64_t features, const EmbedOptions& options = {},
             const std::string& name = "");
  // embed.attend(query): query [..., features] -> [..., num_embeddings] =
  // query @ embedding.T, the output projection tied to the Embed that
  // returned `embedded` (its table; the gradients of both uses are summed).
  // A glue node "attend_<n>"; its dtype is the Embed's dtype, else the
  // promotion of query's and the table's.
  Edge Attend(Edge embedded, Edge query);
  // optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean():
  // logits [..., V] float, labels int32 of logits' leading shape (usually
  // ExtraInput(0, ...)); a float32 scalar []. A graph whose output it is is a
  // loss: ForwardBackward seeds its backward (no dy). A glue node
  // "softmax_cross_entropy_<n>".
  Edge SoftmaxCrossEntropyWithIntegerLabels(Edge logits, Edge labels);

  // ---- jax.numpy on traced tensors ---------------------------------------------------
  // Glue nodes "<op>_<n>" (the GraphSpec.Node field: binary, unary, where,
  // reduce, einsum, slice, softmax). Float operands of two dtypes promote as
  // JAX's do (a cast node first); constants take the tensor's dtype (JAX's
  // weak typing).
  using BinaryOp = te::v1::GraphSpec::Binary::Op;
  using UnaryOp = te::v1::GraphSpec::Unary::Op;
  using ReduceOp = te::v1::GraphSpec::Reduce::Op;
  // a op b with numpy broadcasting; the comparisons give bool.
  Edge Binary(BinaryOp op, Edge a, Edge b);
  // x op scalar, or scalar op x when scalar_first (1.0 - x, 2 / x).
  Edge Binary(BinaryOp op, Edge x, double scalar, bool scalar_first = false);
  Edge Unary(UnaryOp op, Edge x);  // logical_not takes bool, the rest float
  // jnp.where(cond, x, y), broadcast together; either side may be a constant.
  Edge Where(Edge cond, Edge x, Edge y);
  Edge Where(Edge cond, double x, Edge y);
  Edge Where(Edge cond, Edge x, double y);
  // jnp.sum / mean / max / min over `axes` (empty: all; negative from the end).
  Edge Reduce(ReduceOp op, Edge x, const std::vector<int>& axes = {}, bool keepdims = false);
  // jnp.einsum of two operands for what a (batched) GEMM covers.
  Edge Einsum(const std::string& equation, Edge a, Edge b,
              te::v1::Precision precision = te::v1::PRECISION_DEFAULT);
  // x[start:limit:stride] per axis (bounds resolved: 0 <= start <= limit <=
  // dim; stride empty: 1s). An integer index is a slice of one, then Reshape.
  Edge Slice(Edge x, const std::vector<int64_t>& start, const std::vector<int64_t>& limit,
             const std::vector<int64_t>& stride = {});
  // jax.nn.softmax / log_softmax along `axis`.
  Edge Softmax(Edge x, int axis = -1, bool log = false);
  // self.param(name, init, shape, dtype) in the current scope: a node named
  // "<scope>/<name>" whose variable is "params/<scope>/<name>", drawn from
  // `init` (an unset Initializer is lecun_normal, Flax's default kernel
  // init) with the node's seed. Kept when the output does not read it.
  Edge Param(const std::string& name, Shape shape, const te::v1::Initializer& init = {},
             DType dtype = DType::kF32);

  // The result: y. SetOutputs: y, then aux outputs (a loss function's, as
  // jax.value_and_grad's has_aux returns them), which get no gradient.
  void SetOutput(Edge y);
  void SetOutputs(const std::vector<Edge>& outputs);

  // The layer itself, in a graph added over a layer that is this one module
  // (AddGraph, modules.h): a module node named "" (the root scope), which
  // reads the layer's variables under their own names. Once per graph, at
  // the top scope.
  Edge CallLayer(const Module& module, const std::vector<Edge>& inputs, Edge mask = {});

  std::string type_name() const override { return type_name_; }
  // LayerSpec{graph}: the first bad use's error, or INVALID_ARGUMENT when no
  // output was set.
  absl::StatusOr<te::v1::LayerSpec> Spec() const override;
  // The Dropout nodes and the module nodes whose modules draw dropout.
  std::vector<std::string> DropoutUsers() const override { return dropout_users_; }
  // One header per extra input the spec reads (extra_inputs[0] up to the
  // highest read), its ExtraInput dtype and shape beside `x`: the shape's
  // leading dims that equal this graph's x's are `x`'s. Empty when the graph
  // reads none, or one of them was never made with ExtraInput.
  std::vector<te::v1::TensorHeader> ExtraInputs(const Shape& x) const override;

 private:
  struct EdgeInfo {
    Shape shape;
    DType dtype;
    int node = -1;           // the node writing it; -1 for a graph input
    std::string input_name;  // a graph input's name
    bool is_mask = false;
  };
  struct NodeInfo {
    te::v1::GraphSpec::Node op;  // the op's oneof field only
    std::string scope;           // "" or "FlaxMLP_0"
    std::string label;           // a glue node's name stem
    std::string name;            // a module's (Dropout's) name; glue is named at Spec()
    std::vector<int> inputs;
    int mask = -1;
    std::vector<int> outputs;
    bool keep = false;  // a module with variables: stays when the output does not read it
    bool root = false;  // CallLayer's node, named ""
  };
  static constexpr char kLayerEdge[] = "layer";  // the edge of CallLayer's node

  std::vector<Edge> CallModule(const Module& module, const std::vector<Edge>& inputs, Edge mask,
                               const std::string& node_name, bool root);
  // Records a node in the current scope; its outputs' shapes and dtype.
  std::vector<Edge> Record(NodeInfo node, const std::vector<Shape>& shapes, DType dtype, bool makes_mask = false);
  Edge RecordOne(NodeInfo node, Shape shape, DType dtype);
  NodeInfo Glue(const std::string& label, const std::vector<Edge>& inputs) const;
  // The name a glue node would have now (for errors before Spec() names it).
  std::string GlueNameNow(const std::string& label) const;
  // Checks that each edge is this graph's and none is a mask; sets the error.
  bool Readable(const std::vector<Edge>& edges, const std::string& where);
  bool Claimable(const std::string& name, const std::string& where);
  Edge Fail(const std::string& where, const std::string& message);  // sets the error once; an invalid Edge
  std::string ScopePath() const;
  std::string AutoName(const std::string& type_name);  // Flax's "<type>_<n>", counted
  std::vector<Edge> Promoted(const std::vector<Edge>& ts, const std::string& op);
  // numpy's broadcast of the edges' shapes; nullopt (and the error set) when they do not.
  std::optional<Shape> Broadcast(const std::vector<Edge>& ts, const std::string& where);
  Edge WhereOf(Edge cond, std::optional<double> x_scalar, Edge x, std::optional<double> y_scalar,
               Edge y);

  std::string type_name_;
  std::vector<EdgeInfo> edges_;
  std::vector<NodeInfo> nodes_;
  std::vector<std::string> scope_;
  std::map<std::string, std::map<std::string, int>> auto_names_;  // scope -> type -> next n
  std::map<std::string, int> module_names_;                        // name -> node
  std::map<int, EmbedOptions> embed_options_;                      // Embed node -> its dtypes
  std::vector<std::string> dropout_users_;                          // node names, in call order
  std::vector<int> outputs_;  // y first
  absl::Status error_;
};

}  // namespace te::client

#endif  // TE_CLIENT_GRAPH_H_
