// The graph layer with TE modules: variables under node names, a graph of
// the quickstart's unfused attention block equal bit for bit to its modules
// run one by one, its gradients against finite differences, FP8 state per
// module node, masks, interruption, and one test per kind of bad graph. The
// glue ops alone are in graph_glue_test.cc.
#include <cmath>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/rng.h"
#include "server/layers/fp8_state.h"
#include "server/layers/graph.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::InitLayer;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::RandomizeParams;
using testing::Values;
using Spec = te::v1::GraphSpec;

constexpr int64_t kBatch = 2, kSeq = 4, kHidden = 8, kHeads = 2, kHeadDim = kHidden / kHeads;
const Shape kShape = {kBatch, kSeq, kHidden};

Spec::Node* Add(Spec* g, const std::string& name, std::vector<std::string> in,
                std::vector<std::string> out) {
  Spec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& s : in) node->add_inputs(s);
  for (const std::string& s : out) node->add_outputs(s);
  return node;
}

te::v1::LayerSpec Dense(int64_t features) {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(features);
  return spec;
}
te::v1::LayerSpec Norm() {
  te::v1::LayerSpec spec;
  spec.mutable_layer_norm();
  return spec;
}
te::v1::LayerSpec Attention(te::v1::AttnMaskType mask, float dropout = 0.0f) {
  te::v1::LayerSpec spec;
  auto* dpa = spec.mutable_dot_product_attention();
  dpa->set_head_dim(kHeadDim);
  dpa->set_num_attention_heads(kHeads);
  dpa->set_attn_mask_type(mask);
  dpa->set_attention_dropout(dropout);
  return spec;
}

// Through CreateLayer, as the server builds it.
absl::StatusOr<std::unique_ptr<Layer>> Build(const Spec& graph) {
  te::v1::LayerSpec spec;
  *spec.mutable_graph() = graph;
  return CreateLayer(spec);
}

std::unique_ptr<Layer> Make(const te::v1::LayerSpec& spec) {
  auto layer = CreateLayer(spec);
  EXPECT_TRUE(layer.ok()) << layer.status();
  return layer.ok() ? std::move(*layer) : nullptr;
}

// The quickstart's unfused attention block: LayerNorm, DenseGeneral(3H),
// reshape to heads, split into q, k, v, DotProductAttention under a causal
// mask, reshape back, DenseGeneral(H), and the residual add.
Spec AttentionBlock(float attention_dropout = 0.0f) {
  Spec g;
  Add(&g, "LayerNorm_0", {"x"}, {"ln"})->mutable_module()->CopyFrom(Norm());
  Add(&g, "DenseGeneral_0", {"ln"}, {"qkv"})->mutable_module()->CopyFrom(Dense(3 * kHidden));
  auto* reshape = Add(&g, "reshape_qkv", {"qkv"}, {"qkv4"})->mutable_reshape();
  for (int64_t d : {kBatch, kSeq, kHeads, 3 * kHeadDim}) reshape->add_shape(d);
  auto* split = Add(&g, "split_qkv", {"qkv4"}, {"q", "k", "v"})->mutable_split();
  split->set_axis(3);
  split->set_parts(3);
  Add(&g, "causal", {"x"}, {"mask"})->mutable_causal_mask();
  Spec::Node* attention = Add(&g, "DotProductAttention_0", {"q", "k", "v"}, {"attn"});
  *attention->mutable_module() = Attention(te::v1::CAUSAL, attention_dropout);
  attention->set_mask("mask");
  auto* back = Add(&g, "reshape_out", {"attn"}, {"attn3"})->mutable_reshape();
  for (int64_t d : {kBatch, kSeq, int64_t{-1}}) back->add_shape(d);
  Add(&g, "DenseGeneral_1", {"attn3"}, {"proj"})->mutable_module()->CopyFrom(Dense(kHidden));
  Add(&g, "residual", {"proj", "x"}, {"y"})->mutable_add();
  g.add_outputs("y");
  return g;
}

// A node's variables as its module names them.
Variables Unscoped(const Variables& vars, const std::string& node) {
  Variables own;
  for (const auto& [key, t] : vars) {
    const size_t slash = key.find('/');
    const std::string prefix = key.substr(0, slash + 1) + node + "/";
    if (absl::StartsWith(key, prefix)) own[key.substr(0, slash + 1) + key.substr(prefix.size())] = t;
  }
  return own;
}

Tensor FromValues(Ops& ops, const Shape& shape, const std::vector<float>& v) {
  Tensor t = RandomTensor(ops, shape, DType::kF32, 0);
  testing::SetValues(v, &t);
  return t;
}

uint64_t Seed(uint64_t seed, const std::string& name) {
  return DeriveSeed(seed, name);
}

void ExpectInvalid(const absl::Status& status, const std::string& names) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find(names), std::string::npos)
      << "want \"" << names << "\" in: " << status.message();
}

TEST(GraphTest, VariablesAreTheModulesUnderNodeNames) {
  Spec g;
  Add(&g, "TEUnfusedMLP_0/DenseGeneral_0", {"x"}, {"h"})->mutable_module()->CopyFrom(Dense(12));
  Add(&g, "TEUnfusedMLP_0/DenseGeneral_1", {"h"}, {"y"})->mutable_module()->CopyFrom(Dense(kHidden));
  g.add_outputs("y");
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  EXPECT_EQ((*layer)->type_name(), "Graph");
  const Fp8Recipe fp8 = testing::DelayedRecipe();
  auto specs = (*layer)->VariableSpecs(kShape, &fp8);
  ASSERT_TRUE(specs.ok()) << specs.status();
  std::map<std::string, Shape> shapes;
  for (const VariableSpec& v : *specs) shapes[v.name] = v.shape;
  EXPECT_EQ(shapes["params/TEUnfusedMLP_0/DenseGeneral_0/kernel"], (Shape{kHidden, 12}));
  EXPECT_EQ(shapes["params/TEUnfusedMLP_0/DenseGeneral_1/bias"], (Shape{kHidden}));
  EXPECT_EQ(shapes["fp8_metas/TEUnfusedMLP_0/DenseGeneral_1/kernel_amax_history"], (Shape{16}));
  EXPECT_EQ(shapes.size(), 2u * (2 + 6));  // per Dense: kernel, bias, 3 quantizers x 2
  auto y = (*layer)->OutputShape(kShape);
  ASSERT_TRUE(y.ok());
  EXPECT_EQ(*y, kShape);
}

// Init gives each module node what its own Init gives with DeriveSeed(seed,
// name); forward and backward equal the modules run one by one with the
// glue done by hand, bit for bit, attention dropout included (each module
// node's dropout seed is DeriveSeed(dropout_seed, name)).
TEST(GraphTest, TeModulesEqualTheModulesRunOneByOne) {
  auto ops = NewCpuOps();
  auto layer = Build(AttentionBlock(/*attention_dropout=*/0.25f));
  ASSERT_TRUE(layer.ok()) << layer.status();
  constexpr uint64_t kSeed = 7, kDropoutSeed = 11;
  auto vars = InitLayer(*ops, **layer, kShape, nullptr, kSeed);
  ASSERT_TRUE(vars.ok()) << vars.status();

  struct Module {
    std::string name;
    std::unique_ptr<Layer> layer;
    Shape x;
    Variables vars;
  };
  std::vector<Module> m;
  m.push_back({"LayerNorm_0", Make(Norm()), kShape, {}});
  m.push_back({"DenseGeneral_0", Make(Dense(3 * kHidden)), kShape, {}});
  m.push_back({"DotProductAttention_0", Make(Attention(te::v1::CAUSAL, 0.25f)),
               {kBatch, kSeq, kHeads, kHeadDim}, {}});
  m.push_back({"DenseGeneral_1", Make(Dense(kHidden)), kShape, {}});
  for (Module& mod : m) {
    auto own = InitLayer(*ops, *mod.layer, mod.x, nullptr, Seed(kSeed, mod.name));
    ASSERT_TRUE(own.ok()) << own.status();
    const Variables from_graph = Unscoped(*vars, mod.name);
    ASSERT_EQ(own->size(), from_graph.size()) << mod.name;
    for (const auto& [key, t] : *own) EXPECT_EQ(Values(t), Values(from_graph.at(key))) << key;
  }
  RandomizeParams(*ops, &*vars, 3);
  for (Module& mod : m) mod.vars = Unscoped(*vars, mod.name);

  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = kDropoutSeed;
  opts.keep_for_backward = true;
  LayerInputs in;
  in.x = RandomTensor(*ops, kShape, DType::kF32, 5);
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
  ASSERT_NE(saved, nullptr);
  EXPECT_GT(saved->bytes(), 0);
  const Tensor dy = RandomTensor(*ops, kShape, DType::kF32, 9);
  LayerGrads grads;
  ASSERT_TRUE((*layer)->Backward(*ops, &*vars, *saved, dy, &grads).ok());

  // By hand.
  std::vector<std::unique_ptr<SavedForward>> kept(m.size());
  auto forward = [&](size_t i, LayerInputs mi) {
    ForwardOptions o = opts;
    o.dropout_seed = Seed(kDropoutSeed, m[i].name);
    LayerOutputs mo;
    EXPECT_TRUE(m[i].layer->Forward(*ops, &m[i].vars, mi, o, &mo, &kept[i]).ok()) << m[i].name;
    return mo.y;
  };
  const Tensor ln = forward(0, {in.x});
  const std::vector<float> qkv = Values(forward(1, {ln}));
  // [B, S, heads, 3 d] split along the last axis.
  const int64_t rows = kBatch * kSeq * kHeads;
  std::vector<std::vector<float>> parts(3);
  for (int64_t r = 0; r < rows; ++r) {
    for (int p = 0; p < 3; ++p) {
      for (int64_t c = 0; c < kHeadDim; ++c) {
        parts[p].push_back(qkv[(r * 3 + p) * kHeadDim + c]);
      }
    }
  }
  const Shape head_shape = {kBatch, kSeq, kHeads, kHeadDim};
  LayerInputs attention_in;
  attention_in.x = FromValues(*ops, head_shape, parts[0]);
  attention_in.extra = {FromValues(*ops, head_shape, parts[1]),
                        FromValues(*ops, head_shape, parts[2])};
  const Tensor attn = forward(2, attention_in);
  const std::vector<float> proj = Values(forward(3, {attn.Reshaped(kShape)}));
  const std::vector<float> x = Values(in.x);
  std::vector<float> y(x.size());
  for (size_t i = 0; i < y.size(); ++i) y[i] = proj[i] + x[i];
  EXPECT_EQ(Values(out.y), y);

  std::map<std::string, Tensor> want_params;
  auto backward = [&](size_t i, const Tensor& d) {
    LayerGrads g;
    EXPECT_TRUE(m[i].layer->Backward(*ops, &m[i].vars, *kept[i], d, &g).ok()) << m[i].name;
    for (const auto& [key, t] : g.params) {
      want_params["params/" + m[i].name + key.substr(key.find('/'))] = t;
    }
    return g;
  };
  const LayerGrads d3 = backward(3, dy);
  const LayerGrads d2 = backward(2, d3.dx.Reshaped(head_shape));
  const std::vector<float> dq = Values(d2.dx), dk = Values(d2.dextra[0]), dv = Values(d2.dextra[1]);
  std::vector<float> dqkv;
  for (int64_t r = 0; r < rows; ++r) {
    for (const std::vector<float>* part : {&dq, &dk, &dv}) {
      dqkv.insert(dqkv.end(), part->begin() + r * kHeadDim, part->begin() + (r + 1) * kHeadDim);
    }
  }
  const LayerGrads d1 = backward(1, FromValues(*ops, {kBatch, kSeq, 3 * kHidden}, dqkv));
  const LayerGrads d0 = backward(0, d1.dx);
  const std::vector<float> dln = Values(d0.dx), dyv = Values(dy);
  std::vector<float> dx(dln.size());
  for (size_t i = 0; i < dx.size(); ++i) dx[i] = dyv[i] + dln[i];
  EXPECT_EQ(Values(grads.dx), dx);
  ASSERT_EQ(grads.params.size(), want_params.size());
  for (const auto& [key, t] : want_params) {
    ASSERT_TRUE(grads.params.count(key)) << key;
    EXPECT_EQ(Values(grads.params.at(key)), Values(t)) << key;
  }
}

TEST(GraphTest, AttentionBlockGradientsMatchFiniteDifferences) {
  auto ops = NewCpuOps();
  auto layer = Build(AttentionBlock());
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto vars = InitLayer(*ops, **layer, kShape, nullptr);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 5);
  LayerInputs in;
  in.x = RandomTensor(*ops, kShape, DType::kF32, 13);
  EXPECT_TRUE(CheckGradients(*ops, **layer, &*vars, in, {}));
}

// x read by three nodes (two modules and the add): its gradient is the sum.
TEST(GraphTest, FanOutGradientsMatchFiniteDifferences) {
  Spec g;
  Add(&g, "a", {"x"}, {"ya"})->mutable_module()->CopyFrom(Dense(kHidden));
  Add(&g, "b", {"x"}, {"yb"})->mutable_module()->CopyFrom(Norm());
  Add(&g, "sum", {"ya", "yb", "x"}, {"y"})->mutable_add();
  g.add_outputs("y");
  auto ops = NewCpuOps();
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto vars = InitLayer(*ops, **layer, kShape, nullptr);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 8);
  LayerInputs in;
  in.x = RandomTensor(*ops, kShape, DType::kF32, 14);
  EXPECT_TRUE(CheckGradients(*ops, **layer, &*vars, in, {}));
}

// Listed out of dependency order, the nodes still run in it.
TEST(GraphTest, NodesRunInDependencyOrderWhateverTheListing) {
  Spec g;
  Add(&g, "second", {"h"}, {"y"})->mutable_scale()->set_factor(2.0);
  Add(&g, "first", {"x"}, {"h"})->mutable_scale()->set_factor(3.0);
  g.add_outputs("y");
  auto ops = NewCpuOps();
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  Variables vars;
  LayerInputs in;
  in.x = RandomTensor(*ops, {3, 4}, DType::kF32, 1);
  LayerOutputs out;
  ASSERT_TRUE((*layer)->Forward(*ops, &vars, in, {}, &out, nullptr).ok());
  const std::vector<float> x = Values(in.x), y = Values(out.y);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_EQ(y[i], 2.0f * (3.0f * x[i]));
}

// A module whose output nothing reads still runs; its parameter gradients
// are zeros.
TEST(GraphTest, UnreadModuleGetsZeroGradients) {
  Spec g;
  Add(&g, "used", {"x"}, {"y"})->mutable_module()->CopyFrom(Dense(kHidden));
  Add(&g, "unused", {"x"}, {"z"})->mutable_module()->CopyFrom(Dense(kHidden));
  g.add_outputs("y");
  auto ops = NewCpuOps();
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok());
  auto vars = InitLayer(*ops, **layer, kShape, nullptr);
  ASSERT_TRUE(vars.ok());
  RandomizeParams(*ops, &*vars, 2);
  LayerInputs in;
  in.x = RandomTensor(*ops, kShape, DType::kF32, 3);
  EXPECT_TRUE(CheckGradients(*ops, **layer, &*vars, in, {}));
}

// Each module node has its own quantizers, moved by the session's
// UpdateFp8Metas exactly as for the modules alone.
TEST(GraphTest, ModuleNodesOwnTheirFp8State) {
  Spec g;
  Add(&g, "DenseGeneral_0", {"x"}, {"h"})->mutable_module()->CopyFrom(Dense(kHidden));
  Add(&g, "mlp/DenseGeneral_1", {"h"}, {"y"})->mutable_module()->CopyFrom(Dense(kHidden));
  g.add_outputs("y");
  auto ops = NewCpuOps();
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  const Fp8Recipe fp8 = testing::DelayedRecipe(4);
  auto vars = InitLayer(*ops, **layer, kShape, &fp8, 1);
  ASSERT_TRUE(vars.ok()) << vars.status();
  RandomizeParams(*ops, &*vars, 4);
  const std::vector<std::string> names = {"DenseGeneral_0", "mlp/DenseGeneral_1"};
  std::vector<std::unique_ptr<Layer>> alone;
  std::vector<Variables> alone_vars;
  for (const std::string& name : names) {
    alone.push_back(Make(Dense(kHidden)));
    alone_vars.push_back(Unscoped(*vars, name));
  }
  // Separate copies of the FP8 state for the modules alone.
  for (Variables& v : alone_vars) {
    for (auto& [key, t] : v) {
      if (absl::StartsWith(key, "fp8_metas/")) t = FromValues(*ops, t.shape(), Values(t));
    }
  }
  ForwardOptions opts;
  opts.fp8 = &fp8;
  opts.keep_for_backward = true;
  for (int step = 0; step < 3; ++step) {
    LayerInputs in;
    in.x = RandomTensor(*ops, kShape, DType::kF32, 20 + step, 1.0f + step);
    const Tensor dy = RandomTensor(*ops, kShape, DType::kF32, 30 + step);
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, opts, &out, &saved).ok());
    LayerGrads grads;
    ASSERT_TRUE((*layer)->Backward(*ops, &*vars, *saved, dy, &grads).ok());
    ASSERT_TRUE(UpdateFp8Metas(*ops, fp8, &*vars).ok());

    std::vector<std::unique_ptr<SavedForward>> kept(2);
    LayerOutputs h, y;
    ASSERT_TRUE(alone[0]->Forward(*ops, &alone_vars[0], in, opts, &h, &kept[0]).ok());
    ASSERT_TRUE(alone[1]->Forward(*ops, &alone_vars[1], {h.y}, opts, &y, &kept[1]).ok());
    LayerGrads g1, g0;
    ASSERT_TRUE(alone[1]->Backward(*ops, &alone_vars[1], *kept[1], dy, &g1).ok());
    ASSERT_TRUE(alone[0]->Backward(*ops, &alone_vars[0], *kept[0], g1.dx, &g0).ok());
    for (Variables& v : alone_vars) ASSERT_TRUE(UpdateFp8Metas(*ops, fp8, &v).ok());
    EXPECT_EQ(Values(out.y), Values(y.y)) << "step " << step;
    EXPECT_EQ(Values(grads.dx), Values(g0.dx)) << "step " << step;
  }
  for (size_t i = 0; i < names.size(); ++i) {
    const Variables own = Unscoped(*vars, names[i]);
    for (const auto& [key, t] : alone_vars[i]) {
      if (!absl::StartsWith(key, "fp8_metas/")) continue;
      EXPECT_EQ(Values(own.at(key)), Values(t)) << names[i] << " " << key;
    }
  }
  // Their own: the two x quantizers saw different tensors.
  EXPECT_NE(Values(vars->at("fp8_metas/DenseGeneral_0/x_amax_history")),
            Values(vars->at("fp8_metas/mlp/DenseGeneral_1/x_amax_history")));
  EXPECT_NE(Values(vars->at("fp8_metas/DenseGeneral_0/x_scale"))[0], 1.0f);
}

Tensor Lengths(Ops& ops, const std::vector<int32_t>& lengths) {
  auto t = ops.Allocate(DType::kI32, {static_cast<int64_t>(lengths.size())});
  EXPECT_TRUE(t.ok());
  for (size_t i = 0; i < lengths.size(); ++i) t->data_as<int32_t>()[i] = lengths[i];
  return *t;
}

// y of one DotProductAttention node reading q = x, k, v from extra inputs.
std::vector<float> AttentionThroughGraph(Ops& ops, te::v1::AttnMaskType type, bool causal_node,
                                         const LayerInputs& in) {
  Spec g;
  std::string mask = "attention_mask";
  if (causal_node) {
    Add(&g, "causal", {"x"}, {"causal_mask"})->mutable_causal_mask();
    mask = "causal_mask";
  }
  Spec::Node* node = Add(&g, "attention", {"x", "extra_inputs[0]", "extra_inputs[1]"}, {"y"});
  *node->mutable_module() = Attention(type);
  node->set_mask(mask);
  g.add_outputs("y");
  auto layer = Build(g);
  EXPECT_TRUE(layer.ok()) << layer.status();
  Variables vars;
  LayerOutputs out;
  const absl::Status s = (*layer)->Forward(ops, &vars, in, {}, &out, nullptr);
  EXPECT_TRUE(s.ok()) << s;
  return Values(out.y);
}

std::vector<float> AttentionAlone(Ops& ops, te::v1::AttnMaskType type, const LayerInputs& in) {
  auto layer = Make(Attention(type));
  Variables vars;
  LayerOutputs out;
  EXPECT_TRUE(layer->Forward(ops, &vars, in, {}, &out, nullptr).ok());
  return Values(out.y);
}

LayerInputs AttentionInputs(Ops& ops, bool padded) {
  const Shape shape = {kBatch, kSeq, kHeads, kHeadDim};
  LayerInputs in;
  in.x = RandomTensor(ops, shape, DType::kF32, 1);
  in.extra = {RandomTensor(ops, shape, DType::kF32, 2), RandomTensor(ops, shape, DType::kF32, 3)};
  if (padded) {
    in.q_seqlens = Lengths(ops, {4, 2});
    in.kv_seqlens = Lengths(ops, {4, 2});
  }
  return in;
}

TEST(GraphTest, AttentionMaskGivesTheModuleThePaddingLengths) {
  auto ops = NewCpuOps();
  const LayerInputs padded = AttentionInputs(*ops, true);
  const std::vector<float> got = AttentionThroughGraph(*ops, te::v1::PADDING, false, padded);
  EXPECT_EQ(got, AttentionAlone(*ops, te::v1::PADDING, padded));
  EXPECT_NE(got, AttentionAlone(*ops, te::v1::PADDING, AttentionInputs(*ops, false)));
}

// TE's causal types ignore the mask: a causal_mask node's output gives the
// module no padding, whatever the request's mask.
TEST(GraphTest, CausalMaskGivesTheModuleNoPadding) {
  auto ops = NewCpuOps();
  const LayerInputs padded = AttentionInputs(*ops, true);
  const std::vector<float> got = AttentionThroughGraph(*ops, te::v1::PADDING_CAUSAL, true, padded);
  EXPECT_EQ(got, AttentionAlone(*ops, te::v1::PADDING_CAUSAL, AttentionInputs(*ops, false)));
  EXPECT_NE(got, AttentionAlone(*ops, te::v1::PADDING_CAUSAL, padded));
}

// A causal_mask node (flax.linen.make_causal_mask: 1 where key <= query) to
// the other TE types means what TE makes of it: no_mask ignores it; padding
// applies it elementwise, ones masked out (transformer.py,
// _UnfusedDotProductAttention.convert_to_softmax_type), so query i sees the
// keys j > i only and the last query none.
TEST(GraphTest, CausalMaskNodeToNoMaskIsIgnoredAndToPaddingIsElementwise) {
  auto ops = NewCpuOps();
  const LayerInputs plain = AttentionInputs(*ops, false);
  EXPECT_EQ(AttentionThroughGraph(*ops, te::v1::NO_MASK, true, plain),
            AttentionAlone(*ops, te::v1::NO_MASK, plain));
  LayerInputs upper = plain;  // the node's ones as an elementwise mask
  upper.elementwise_mask = ops->Allocate(DType::kBool, {kBatch, kSeq, kSeq}).value();
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t i = 0; i < kSeq; ++i) {
      for (int64_t j = 0; j < kSeq; ++j) {
        upper.elementwise_mask.data_as<bool>()[(b * kSeq + i) * kSeq + j] = j <= i;
      }
    }
  }
  const std::vector<float> got = AttentionThroughGraph(*ops, te::v1::PADDING, true, plain);
  EXPECT_EQ(got, AttentionAlone(*ops, te::v1::PADDING, upper));
  EXPECT_NE(got, AttentionAlone(*ops, te::v1::CAUSAL, plain));
  // The last query sees no key: zeros.
  const int64_t row = kHeads * kHeadDim;
  for (int64_t n = (kSeq - 1) * row; n < kSeq * row; ++n) EXPECT_EQ(got[n], 0.0f);
}

TEST(GraphTest, ForwardStopsBetweenNodesWhenInterrupted) {
  auto ops = NewCpuOps();
  auto layer = Build(AttentionBlock());
  ASSERT_TRUE(layer.ok());
  auto vars = InitLayer(*ops, **layer, kShape, nullptr);
  ASSERT_TRUE(vars.ok());
  int checks = 0;
  ops->set_interrupt_check([&checks] {
    return ++checks >= 3 ? absl::CancelledError("client gone") : absl::OkStatus();
  });
  LayerInputs in;
  in.x = RandomTensor(*ops, kShape, DType::kF32, 1);
  LayerOutputs out;
  EXPECT_EQ((*layer)->Forward(*ops, &*vars, in, {}, &out, nullptr).code(),
            absl::StatusCode::kCancelled);
  EXPECT_EQ(checks, 3);  // stopped at the third node
  ops->set_interrupt_check(nullptr);
}

// ---- bad graphs: the code, and the node the message names ---------------------

Spec Chain(const std::string& a_in, const std::string& b_in) {
  Spec g;
  Add(&g, "a", {a_in}, {"h"})->mutable_scale()->set_factor(2.0);
  Add(&g, "b", {b_in}, {"y"})->mutable_scale()->set_factor(2.0);
  g.add_outputs("y");
  return g;
}

TEST(GraphBadSpecTest, DuplicateNodeNames) {
  Spec g = Chain("x", "h");
  g.mutable_nodes(1)->set_name("a");
  ExpectInvalid(Build(g).status(), "spec.graph.nodes[1] (a).name");
}

TEST(GraphBadSpecTest, TensorWrittenTwice) {
  Spec g = Chain("x", "h");
  g.mutable_nodes(1)->set_outputs(0, "h");
  g.set_outputs(0, "h");
  ExpectInvalid(Build(g).status(), "spec.graph.nodes[1] (b).outputs[0]");
  Spec input = Chain("x", "h");
  input.mutable_nodes(0)->set_outputs(0, "x");
  ExpectInvalid(Build(input).status(), "spec.graph.nodes[0] (a).outputs[0]");
}

TEST(GraphBadSpecTest, TensorReadButNeverWritten) {
  ExpectInvalid(Build(Chain("x", "nowhere")).status(), "spec.graph.nodes[1] (b).inputs[0]");
}

TEST(GraphBadSpecTest, Cycle) {
  const absl::Status s = Build(Chain("y", "h")).status();
  ExpectInvalid(s, "spec.graph.nodes[");
  EXPECT_NE(s.message().find("cycle: a -> b -> a"), std::string::npos) << s;
}

TEST(GraphBadSpecTest, OutputsEmptyOrDangling) {
  Spec empty = Chain("x", "h");
  empty.clear_outputs();
  ExpectInvalid(Build(empty).status(), "spec.graph.outputs");
  Spec dangling = Chain("x", "h");
  dangling.set_outputs(0, "z");
  ExpectInvalid(Build(dangling).status(), "spec.graph.outputs[0]");
}

TEST(GraphBadSpecTest, SplitPartsNotDividingTheAxis) {
  Spec g;
  auto* split = Add(&g, "s", {"x"}, {"p0", "p1", "p2"})->mutable_split();
  split->set_axis(-1);
  split->set_parts(3);
  g.add_outputs("p0");
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ExpectInvalid((*layer)->VariableSpecs(kShape, nullptr).status(), "spec.graph.nodes[0] (s).split");
  Spec few = g;
  few.mutable_nodes(0)->mutable_outputs()->RemoveLast();
  ExpectInvalid(Build(few).status(), "spec.graph.nodes[0] (s)");
}

TEST(GraphBadSpecTest, TransposeAxesThatAreNoPermutation) {
  for (const std::vector<int>& axes : {std::vector<int>{0, 1}, {0, 1, 1}, {0, 1, 3}, {0, -1, 2}}) {
    Spec g;
    auto* t = Add(&g, "t", {"x"}, {"y"})->mutable_transpose();
    for (int a : axes) t->add_axes(a);
    g.add_outputs("y");
    auto layer = Build(g);
    ASSERT_TRUE(layer.ok()) << layer.status();
    ExpectInvalid((*layer)->OutputShape(kShape).status(), "spec.graph.nodes[0] (t).transpose.axes");
  }
}

TEST(GraphBadSpecTest, ReshapeOfAnotherElementCount) {
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{kBatch, 3}, {5, -1}}) {
    Spec g;
    auto* r = Add(&g, "r", {"x"}, {"y"})->mutable_reshape();
    for (int64_t d : shape) r->add_shape(d);
    g.add_outputs("y");
    auto layer = Build(g);
    ASSERT_TRUE(layer.ok()) << layer.status();
    ExpectInvalid((*layer)->OutputShape(kShape).status(), "spec.graph.nodes[0] (r).reshape.shape");
  }
  // Products past 2^63, two -1, zeros: refused before any shape is known.
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{int64_t{1} << 62, 4}, {-1, -1}, {0, 4}}) {
    Spec g;
    auto* r = Add(&g, "r", {"x"}, {"y"})->mutable_reshape();
    for (int64_t d : shape) r->add_shape(d);
    g.add_outputs("y");
    ExpectInvalid(Build(g).status(), "spec.graph.nodes[0] (r).reshape.shape");
  }
}

TEST(GraphBadSpecTest, CastToANonFloatDType) {
  Spec g;
  Add(&g, "c", {"x"}, {"y"})->mutable_cast()->set_dtype(te::v1::INT32);
  g.add_outputs("y");
  ExpectInvalid(Build(g).status(), "spec.graph.nodes[0] (c).cast.dtype");
}

TEST(GraphBadSpecTest, DropoutRateOutsideZeroToOne) {
  for (float rate : {1.0f, -0.1f, std::nanf("")}) {
    Spec g;
    Add(&g, "d", {"x"}, {"y"})->mutable_dropout()->set_rate(rate);
    g.add_outputs("y");
    ExpectInvalid(Build(g).status(), "spec.graph.nodes[0] (d).dropout.rate");
  }
}

TEST(GraphBadSpecTest, ModuleInputShapeThatDoesNotFit) {
  Spec g;
  Spec::Node* node = Add(&g, "attention", {"x", "x", "x"}, {"y"});
  *node->mutable_module() = Attention(te::v1::CAUSAL);
  g.add_outputs("y");
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  // x is [B, S, hidden], not [B, S, heads, head_dim]: the module's own error.
  const absl::Status s = (*layer)->VariableSpecs(kShape, nullptr).status();
  ExpectInvalid(s, "spec.graph.nodes[0] (attention): input_shape");
  // A bad module spec is the module's error, prefixed by the node.
  Spec bad;
  Add(&bad, "dense", {"x"}, {"y"})->mutable_module()->mutable_dense_general();
  bad.add_outputs("y");
  ExpectInvalid(Build(bad).status(), "spec.graph.nodes[0] (dense).module: spec.dense_general");
  // Inputs that are not the module's: DotProductAttention takes q, k, v.
  Spec two;
  *Add(&two, "attention", {"x", "x"}, {"y"})->mutable_module() = Attention(te::v1::CAUSAL);
  two.add_outputs("y");
  ExpectInvalid(Build(two).status(), "spec.graph.nodes[0] (attention)");
}

TEST(GraphBadSpecTest, MaskOnAModuleThatTakesNone) {
  Spec g;
  Spec::Node* node = Add(&g, "dense", {"x"}, {"y"});
  *node->mutable_module() = Dense(kHidden);
  node->set_mask("attention_mask");
  g.add_outputs("y");
  ExpectInvalid(Build(g).status(), "spec.graph.nodes[0] (dense).mask");
}

TEST(GraphBadSpecTest, MaskReadAsAnInput) {
  Spec g;
  Add(&g, "s", {"attention_mask"}, {"y"})->mutable_scale()->set_factor(1.0);
  g.add_outputs("y");
  ExpectInvalid(Build(g).status(), "spec.graph.nodes[0] (s).inputs[0]");
}

TEST(GraphBadSpecTest, LayerNormOutputReadByANode) {
  Spec g;
  te::v1::LayerSpec lndg;
  lndg.mutable_layer_norm_dense_general()->add_features(kHidden);
  lndg.mutable_layer_norm_dense_general()->set_return_layernorm_output(true);
  *Add(&g, "lndg", {"x"}, {"z", "ln_out"})->mutable_module() = lndg;
  Add(&g, "sum", {"z", "ln_out"}, {"y"})->mutable_add();
  g.add_outputs("y");
  ExpectInvalid(Build(g).status(), "spec.graph.nodes[1] (sum)");
  // As the graph's second output it is fine: LayerOutputs.ln_out.
  Spec ok;
  *Add(&ok, "lndg", {"x"}, {"z", "ln_out"})->mutable_module() = lndg;
  ok.add_outputs("z");
  ok.add_outputs("ln_out");
  auto layer = Build(ok);
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto ops = NewCpuOps();
  auto vars = InitLayer(*ops, **layer, kShape, nullptr);
  ASSERT_TRUE(vars.ok());
  LayerInputs in;
  in.x = RandomTensor(*ops, kShape, DType::kF32, 1);
  LayerOutputs out;
  ASSERT_TRUE((*layer)->Forward(*ops, &*vars, in, {}, &out, nullptr).ok());
  EXPECT_EQ(out.ln_out.shape(), kShape);
}

TEST(GraphBadSpecTest, ModuleScopesThatOverlap) {
  Spec g;
  Add(&g, "mlp", {"x"}, {"h"})->mutable_module()->CopyFrom(Dense(kHidden));
  Add(&g, "mlp/dense", {"h"}, {"y"})->mutable_module()->CopyFrom(Dense(kHidden));
  g.add_outputs("y");
  ExpectInvalid(Build(g).status(), "spec.graph.nodes[1] (mlp/dense).name");
}

// InitLayer carries x's shape alone: a module's variables cannot be sized
// from an extra input.
TEST(GraphBadSpecTest, ModuleXFromAnExtraInput) {
  Spec g;
  Add(&g, "dense", {"extra_inputs[0]"}, {"y"})->mutable_module()->CopyFrom(Dense(kHidden));
  g.add_outputs("y");
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ExpectInvalid((*layer)->VariableSpecs(kShape, nullptr).status(), "spec.graph.nodes[0] (dense)");
}

TEST(GraphBadSpecTest, AddOfShapesThatDiffer) {
  Spec g;
  Add(&g, "r", {"x"}, {"h"})->mutable_reshape()->add_shape(-1);
  Add(&g, "sum", {"h", "x"}, {"y"})->mutable_add();
  g.add_outputs("y");
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  ExpectInvalid((*layer)->OutputShape(kShape).status(), "spec.graph.nodes[1] (sum)");
}

TEST(GraphBadSpecTest, ExtraInputsTheGraphDoesNotRead) {
  Spec g;
  Add(&g, "sum", {"x", "extra_inputs[1]"}, {"y"})->mutable_add();
  g.add_outputs("y");
  auto layer = Build(g);
  ASSERT_TRUE(layer.ok()) << layer.status();
  auto ops = NewCpuOps();
  Variables vars;
  LayerInputs in;
  in.x = RandomTensor(*ops, kShape, DType::kF32, 1);
  in.extra = {RandomTensor(*ops, kShape, DType::kF32, 2)};
  LayerOutputs out;
  ExpectInvalid((*layer)->Forward(*ops, &vars, in, {}, &out, nullptr), "extra_inputs");
  // With both, extra_inputs[0] (unread) gets a zero gradient.
  in.extra.push_back(RandomTensor(*ops, kShape, DType::kF32, 3));
  EXPECT_TRUE(CheckGradients(*ops, **layer, &vars, in, {}));
  // A shape that does not fit, known only at the forward.
  in.extra[1] = RandomTensor(*ops, {kBatch, kHidden}, DType::kF32, 4);
  ExpectInvalid((*layer)->Forward(*ops, &vars, in, {}, &out, nullptr), "spec.graph.nodes[0] (sum)");
}

}  // namespace
}  // namespace te::layers
