// jax.numpy's graph nodes (binary, unary, where, reduce, einsum, slice,
// softmax, param) on the CPU backend: every forward against a float64
// numpy-like reference written here on random data, every backward against
// finite differences (testing.h's CheckGradients) at small sizes, JAX's
// gradient conventions where finite differences cannot see them (ties), the
// param node's initializers, and the INVALID_ARGUMENT of bad specs naming
// the node's field.
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "server/layers/graph.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::CheckGradients;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::RelativeError;
using testing::Values;
using Spec = te::v1::GraphSpec;

// Tolerances, stated once. Forward in float32 against float64: each output
// is a few float32 operations (or a sum of at most ~100 terms), relative L2
// error well under 1e-5. bfloat16 outputs: one rounding to 8 mantissa bits
// (relative 2^-9 each) plus bfloat16 inputs, within 1e-2.
constexpr double kF32Tolerance = 1e-5;
constexpr double kBf16Tolerance = 1e-2;

// ---- a float64 numpy-like reference -----------------------------------------------
struct Array {
  Shape shape;
  std::vector<double> v;
};

Array FromTensor(const Tensor& t) {
  Array a{t.shape(), {}};
  for (float f : Values(t)) a.v.push_back(f);
  return a;
}

int64_t Count(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<int64_t>());
}

Shape BroadcastShape(const std::vector<Shape>& shapes) {
  Shape out;
  for (const Shape& s : shapes) {
    if (s.size() > out.size()) out.insert(out.begin(), s.size() - out.size(), 1);
    for (size_t d = 0; d < s.size(); ++d) {
      int64_t& o = out[out.size() - s.size() + d];
      if (s[d] != 1) o = s[d];
    }
  }
  return out;
}

// a's element at output index i of `out` (a broadcast to it).
double At(const Array& a, const Shape& out, int64_t i) {
  int64_t offset = 0, stride = 1;
  for (int d = static_cast<int>(out.size()) - 1; d >= 0; --d) {
    const int64_t index = i % out[d];
    i /= out[d];
    const int ad = d - static_cast<int>(out.size() - a.shape.size());
    if (ad < 0) continue;
    if (a.shape[ad] != 1) offset += index * stride;
    stride *= a.shape[ad];
  }
  return a.v[offset];
}

Array Map(const std::vector<Array>& in,
          const std::function<double(const std::vector<double>&)>& f) {
  std::vector<Shape> shapes;
  for (const Array& a : in) shapes.push_back(a.shape);
  Array out{BroadcastShape(shapes), {}};
  for (int64_t i = 0; i < Count(out.shape); ++i) {
    std::vector<double> args;
    for (const Array& a : in) args.push_back(At(a, out.shape, i));
    out.v.push_back(f(args));
  }
  return out;
}

std::vector<int64_t> Unravel(int64_t i, const Shape& s) {
  std::vector<int64_t> idx(s.size());
  for (int d = static_cast<int>(s.size()) - 1; d >= 0; --d) {
    idx[d] = i % s[d];
    i /= s[d];
  }
  return idx;
}

int64_t Ravel(const std::vector<int64_t>& idx, const Shape& s) {
  int64_t i = 0;
  for (size_t d = 0; d < s.size(); ++d) i = i * s[d] + idx[d];
  return i;
}

// Reduction with `init` and `f` over `axes` (all when empty), keepdims.
Array ReduceRef(const Array& x, std::vector<int> axes, bool keepdims, double init,
                const std::function<double(double, double)>& f, bool mean = false) {
  const int rank = static_cast<int>(x.shape.size());
  std::vector<bool> red(rank, axes.empty());
  for (int a : axes) red[(a + rank) % rank] = true;
  Shape keep = x.shape;
  for (int d = 0; d < rank; ++d) {
    if (red[d]) keep[d] = 1;
  }
  std::vector<double> acc(Count(keep), init);
  std::vector<int64_t> n(Count(keep), 0);
  for (int64_t i = 0; i < Count(x.shape); ++i) {
    std::vector<int64_t> idx = Unravel(i, x.shape);
    for (int d = 0; d < rank; ++d) {
      if (red[d]) idx[d] = 0;
    }
    const int64_t j = Ravel(idx, keep);
    acc[j] = f(acc[j], x.v[i]);
    ++n[j];
  }
  if (mean) {
    for (size_t j = 0; j < acc.size(); ++j) acc[j] /= n[j];
  }
  Shape shape;
  for (int d = 0; d < rank; ++d) {
    if (!red[d] || keepdims) shape.push_back(keep[d]);
  }
  return {shape, acc};
}

// einsum over every assignment of the labels (explicit equations only).
Array EinsumRef(const std::string& eq, const Array& a, const Array& b) {
  const size_t comma = eq.find(','), arrow = eq.find("->");
  std::string ta = eq.substr(0, comma), tb = eq.substr(comma + 1, arrow - comma - 1),
              to = eq.substr(arrow + 2);
  // "..." becomes upper-case letters from the right.
  auto expand = [](std::string t, size_t rank) {
    const size_t e = t.find("...");
    if (e == std::string::npos) return t;
    const size_t width = rank - (t.size() - 3);
    std::string dots;
    for (size_t i = 0; i < width; ++i) dots += static_cast<char>('Z' - (width - 1 - i));
    return t.substr(0, e) + dots + t.substr(e + 3);
  };
  const size_t width =
      std::max(a.shape.size() - (ta.size() - (ta.find("...") != std::string::npos ? 3 : 0)),
               b.shape.size() - (tb.size() - (tb.find("...") != std::string::npos ? 3 : 0)));
  ta = expand(ta, a.shape.size());
  tb = expand(tb, b.shape.size());
  if (to.find("...") != std::string::npos) to = expand(to, to.size() - 3 + width);
  std::map<char, int64_t> size;
  for (size_t d = 0; d < ta.size(); ++d) size[ta[d]] = a.shape[d];
  for (size_t d = 0; d < tb.size(); ++d) size[tb[d]] = b.shape[d];
  std::string labels;
  Shape dims;
  for (const auto& [l, s] : size) labels += l, dims.push_back(s);
  Array out;
  for (char l : to) out.shape.push_back(size[l]);
  out.v.assign(Count(out.shape), 0.0);
  for (int64_t i = 0; i < Count(dims); ++i) {
    const std::vector<int64_t> idx = Unravel(i, dims);
    auto index = [&](const std::string& t, const Shape& s) {
      std::vector<int64_t> at;
      for (char l : t) at.push_back(idx[labels.find(l)]);
      return Ravel(at, s);
    };
    out.v[index(to, out.shape)] += a.v[index(ta, a.shape)] * b.v[index(tb, b.shape)];
  }
  return out;
}

double ErrorOf(const std::vector<float>& got, const Array& want) {
  std::vector<float> w(want.v.begin(), want.v.end());
  return RelativeError(got, w);
}

// ---- graphs -------------------------------------------------------------------------
Spec::Node* Add(Spec* g, const std::string& name, std::vector<std::string> in,
                std::vector<std::string> out = {}) {
  Spec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& s : in) node->add_inputs(s);
  node->add_outputs(out.empty() ? name : out[0]);
  return node;
}

absl::StatusOr<std::unique_ptr<Layer>> Build(const Spec& graph) {
  te::v1::LayerSpec spec;
  *spec.mutable_graph() = graph;
  return CreateLayer(spec);
}

class NumpyNodeTest : public ::testing::Test {
 protected:
  // Inputs as CheckGradients would draw them: x seed 1, extra_inputs[i] seed 2 + i.
  LayerInputs Inputs(const Shape& x, const std::vector<Shape>& extra, DType dtype = DType::kF32) {
    LayerInputs in;
    in.x = RandomTensor(*ops_, x, dtype, 1);
    for (size_t i = 0; i < extra.size(); ++i) {
      in.extra.push_back(RandomTensor(*ops_, extra[i], dtype, 2 + i));
    }
    return in;
  }

  // y of the graph (output "y") on `in`, with its variables initialised.
  Tensor Forward(const Spec& g, const LayerInputs& in) {
    absl::StatusOr<std::unique_ptr<Layer>> layer = Build(g);
    EXPECT_TRUE(layer.ok()) << layer.status();
    if (!layer.ok()) return Tensor();
    absl::StatusOr<Variables> vars = testing::InitLayer(*ops_, **layer, in.x.shape(), nullptr);
    EXPECT_TRUE(vars.ok()) << vars.status();
    LayerOutputs out;
    const absl::Status s = (*layer)->Forward(*ops_, &*vars, in, {}, &out, nullptr);
    EXPECT_TRUE(s.ok()) << s;
    return out.y;
  }

  ::testing::AssertionResult Gradients(const Spec& g, const LayerInputs& in) {
    absl::StatusOr<std::unique_ptr<Layer>> layer = Build(g);
    if (!layer.ok()) return ::testing::AssertionFailure() << layer.status();
    absl::StatusOr<Variables> vars = testing::InitLayer(*ops_, **layer, in.x.shape(), nullptr);
    if (!vars.ok()) return ::testing::AssertionFailure() << vars.status();
    return CheckGradients(*ops_, **layer, &*vars, in, {});
  }

  // The InitLayer-time error of a graph: VariableSpecs (structure and shapes).
  absl::Status InitError(const Spec& g, const Shape& x) {
    absl::StatusOr<std::unique_ptr<Layer>> layer = Build(g);
    if (!layer.ok()) return layer.status();
    return (*layer)->VariableSpecs(x, nullptr).status();
  }

  std::unique_ptr<Ops> ops_ = NewCpuOps();
};

#define EXPECT_INVALID(status, text)                                    \
  do {                                                                  \
    const absl::Status s_ = (status);                                   \
    EXPECT_EQ(s_.code(), absl::StatusCode::kInvalidArgument) << s_;     \
    EXPECT_TRUE(absl::StrContains(s_.message(), text)) << s_.message(); \
  } while (0)

// x (positive where the op needs it: |x| + 0.5) as the tensor "p".
void PositiveInput(Spec* g, const std::string& from, const std::string& name) {
  Add(g, name + "_abs", {from})->mutable_unary()->set_op(Spec::Unary::ABS);
  auto* b = Add(g, name, {name + "_abs"})->mutable_binary();
  b->set_op(Spec::Binary::ADD);
  b->set_scalar(0.5);
}

double Positive(double v) { return std::abs(v) + 0.5; }

// ---- binary -------------------------------------------------------------------------
struct BinaryCase {
  Spec::Binary::Op op;
  std::function<double(double, double)> f;
  bool positive;  // operands |v| + 0.5 (divide, power)
};

const std::vector<BinaryCase>& BinaryCases() {
  static const auto* cases = new std::vector<BinaryCase>{
      {Spec::Binary::ADD, [](double a, double b) { return a + b; }, false},
      {Spec::Binary::SUBTRACT, [](double a, double b) { return a - b; }, false},
      {Spec::Binary::MULTIPLY, [](double a, double b) { return a * b; }, false},
      {Spec::Binary::DIVIDE, [](double a, double b) { return a / b; }, true},
      {Spec::Binary::MAXIMUM, [](double a, double b) { return std::max(a, b); }, false},
      {Spec::Binary::MINIMUM, [](double a, double b) { return std::min(a, b); }, false},
      {Spec::Binary::POWER, [](double a, double b) { return std::pow(a, b); }, true},
  };
  return *cases;
}

// x [2, 3, 4] op extra [3, 1] (both broadcast), against float64 and finite differences.
TEST_F(NumpyNodeTest, BinaryBroadcasting) {
  for (const BinaryCase& c : BinaryCases()) {
    SCOPED_TRACE(Spec::Binary::Op_Name(c.op));
    Spec g;
    std::string a = "x", b = "extra_inputs[0]";
    if (c.positive) {
      PositiveInput(&g, a, "pa");
      PositiveInput(&g, b, "pb");
      a = "pa", b = "pb";
    }
    Add(&g, "y", {a, b})->mutable_binary()->set_op(c.op);
    g.add_outputs("y");
    const LayerInputs in = Inputs({2, 3, 4}, {{3, 1}});
    Array xa = FromTensor(in.x), xb = FromTensor(in.extra[0]);
    if (c.positive) {
      for (double& v : xa.v) v = Positive(v);
      for (double& v : xb.v) v = Positive(v);
    }
    const Array want = Map({xa, xb}, [&](const std::vector<double>& v) { return c.f(v[0], v[1]); });
    const Tensor y = Forward(g, in);
    EXPECT_EQ(y.shape(), (Shape{2, 3, 4}));
    EXPECT_LT(ErrorOf(Values(y), want), kF32Tolerance);
    EXPECT_TRUE(Gradients(g, in));
  }
}

// `x op 0.75` and `0.75 op x`; the larger operand first broadcasts too ([4] op [2, 4]).
TEST_F(NumpyNodeTest, BinaryScalarsAndLeadingBroadcast) {
  for (const BinaryCase& c : BinaryCases()) {
    for (bool first : {false, true}) {
      SCOPED_TRACE(absl::StrCat(Spec::Binary::Op_Name(c.op), first ? " scalar first" : ""));
      Spec g;
      std::string a = "x";
      if (c.positive) PositiveInput(&g, a, "pa"), a = "pa";
      auto* b = Add(&g, "y", {a})->mutable_binary();
      b->set_op(c.op);
      b->set_scalar(0.75);
      b->set_scalar_first(first);
      g.add_outputs("y");
      const LayerInputs in = Inputs({3, 5}, {});
      Array xa = FromTensor(in.x);
      if (c.positive) {
        for (double& v : xa.v) v = Positive(v);
      }
      const Array want = Map({xa}, [&](const std::vector<double>& v) {
        return first ? c.f(0.75, v[0]) : c.f(v[0], 0.75);
      });
      EXPECT_LT(ErrorOf(Values(Forward(g, in)), want), kF32Tolerance);
      EXPECT_TRUE(Gradients(g, in));
    }
  }
  Spec g;
  Add(&g, "y", {"extra_inputs[0]", "x"})->mutable_binary()->set_op(Spec::Binary::MULTIPLY);
  g.add_outputs("y");
  const LayerInputs in = Inputs({2, 4}, {{4}});
  const Array want = Map({FromTensor(in.extra[0]), FromTensor(in.x)},
                         [](const std::vector<double>& v) { return v[0] * v[1]; });
  EXPECT_LT(ErrorOf(Values(Forward(g, in)), want), kF32Tolerance);
  EXPECT_TRUE(Gradients(g, in));
}

TEST_F(NumpyNodeTest, ComparisonsGiveBoolAndWhereRoutesTheGradient) {
  const std::vector<std::pair<Spec::Binary::Op, std::function<bool(double, double)>>> cmps = {
      {Spec::Binary::GREATER, [](double a, double b) { return a > b; }},
      {Spec::Binary::GREATER_EQUAL, [](double a, double b) { return a >= b; }},
      {Spec::Binary::LESS, [](double a, double b) { return a < b; }},
      {Spec::Binary::LESS_EQUAL, [](double a, double b) { return a <= b; }},
      {Spec::Binary::EQUAL, [](double a, double b) { return a == b; }},
      {Spec::Binary::NOT_EQUAL, [](double a, double b) { return a != b; }},
  };
  for (const auto& [op, compare] : cmps) {
    const std::function<bool(double, double)>& f = compare;  // a lambda cannot capture a binding in C++17
    SCOPED_TRACE(Spec::Binary::Op_Name(op));
    // where(x op extra, x, extra * 2): the comparison itself gets no gradient.
    Spec g;
    Add(&g, "c", {"x", "extra_inputs[0]"})->mutable_binary()->set_op(op);
    auto* twice = Add(&g, "t", {"extra_inputs[0]"})->mutable_binary();
    twice->set_op(Spec::Binary::MULTIPLY);
    twice->set_scalar(2.0);
    Add(&g, "y", {"c", "x", "t"})->mutable_where();
    g.add_outputs("y");
    LayerInputs in = Inputs({3, 4}, {{4}});
    // Some ties, so EQUAL and the _EQUAL ops see both outcomes.
    std::vector<float> xs = Values(in.x), es = Values(in.extra[0]);
    xs[1] = es[1];
    xs[6] = es[2];
    testing::SetValues(xs, &in.x);
    const Array want =
        Map({FromTensor(in.x), FromTensor(in.extra[0])},
            [&](const std::vector<double>& v) { return f(v[0], v[1]) ? v[0] : 2 * v[1]; });
    EXPECT_LT(ErrorOf(Values(Forward(g, in)), want), kF32Tolerance);
    // Finite differences across a tie would step over the branch: random data.
    EXPECT_TRUE(Gradients(g, Inputs({3, 4}, {{4}})));
  }
  // A comparison's output is bool.
  Spec g;
  Add(&g, "y", {"x"})->mutable_binary()->set_op(Spec::Binary::GREATER);
  g.mutable_nodes(0)->mutable_binary()->set_scalar(0.0);
  g.add_outputs("y");
  const Tensor y = Forward(g, Inputs({5}, {}));
  EXPECT_EQ(y.dtype(), DType::kBool);
  const std::vector<float> x = Values(Inputs({5}, {}).x);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(Values(y)[i], x[i] > 0 ? 1.0f : 0.0f);
}

// jnp.maximum and jnp.minimum split a tie's gradient in halves (jax.lax.max's
// rule), which finite differences cannot see; the chosen operand gets it all.
TEST_F(NumpyNodeTest, MaximumAndMinimumSplitTiesInHalves) {
  for (const auto op : {Spec::Binary::MAXIMUM, Spec::Binary::MINIMUM}) {
    Spec g;
    Add(&g, "y", {"x", "extra_inputs[0]"})->mutable_binary()->set_op(op);
    g.add_outputs("y");
    auto layer = *Build(g);
    LayerInputs in = Inputs({4}, {{4}});
    testing::SetValues({1, 2, 3, 4}, &in.x);
    testing::SetValues({1, 5, 3, 0}, &in.extra[0]);
    Variables vars;
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    ForwardOptions opts;
    opts.keep_for_backward = true;
    ASSERT_TRUE(layer->Forward(*ops_, &vars, in, opts, &out, &saved).ok());
    Tensor dy = *ops_->Allocate(DType::kF32, {4});
    testing::SetValues({2, 2, 2, 2}, &dy);
    LayerGrads grads;
    ASSERT_TRUE(layer->Backward(*ops_, &vars, *saved, dy, &grads).ok());
    const bool max = op == Spec::Binary::MAXIMUM;
    EXPECT_EQ(Values(grads.dx), (std::vector<float>{1, max ? 0.0f : 2.0f, 1, max ? 2.0f : 0.0f}))
        << Spec::Binary::Op_Name(op);
    EXPECT_EQ(Values(grads.dextra[0]),
              (std::vector<float>{1, max ? 2.0f : 0.0f, 1, max ? 0.0f : 2.0f}))
        << Spec::Binary::Op_Name(op);

    // Against a constant: the tie's other half goes to the constant.
    Spec s;
    Spec::Node* n = Add(&s, "y", {"x"});
    n->mutable_binary()->set_op(op);
    n->mutable_binary()->set_scalar(3.0);
    s.add_outputs("y");
    auto scalar_layer = *Build(s);
    LayerInputs sin = Inputs({4}, {});
    testing::SetValues({1, 2, 3, 4}, &sin.x);
    std::unique_ptr<SavedForward> scalar_saved;
    ASSERT_TRUE(scalar_layer->Forward(*ops_, &vars, sin, opts, &out, &scalar_saved).ok());
    LayerGrads scalar_grads;
    ASSERT_TRUE(scalar_layer->Backward(*ops_, &vars, *scalar_saved, dy, &scalar_grads).ok());
    EXPECT_EQ(Values(scalar_grads.dx),
              (std::vector<float>{max ? 0.0f : 2.0f, max ? 0.0f : 2.0f, 1, max ? 2.0f : 0.0f}))
        << Spec::Binary::Op_Name(op);
  }
}

// ---- unary --------------------------------------------------------------------------
TEST_F(NumpyNodeTest, Unary) {
  const std::vector<std::tuple<Spec::Unary::Op, std::function<double(double)>, bool>> cases = {
      {Spec::Unary::NEGATIVE, [](double v) { return -v; }, false},
      {Spec::Unary::EXP, [](double v) { return std::exp(v); }, false},
      {Spec::Unary::LOG, [](double v) { return std::log(v); }, true},
      {Spec::Unary::TANH, [](double v) { return std::tanh(v); }, false},
      {Spec::Unary::SQRT, [](double v) { return std::sqrt(v); }, true},
      {Spec::Unary::RSQRT, [](double v) { return 1 / std::sqrt(v); }, true},
      {Spec::Unary::ABS, [](double v) { return std::abs(v); }, false},
      {Spec::Unary::SQUARE, [](double v) { return v * v; }, false},
      {Spec::Unary::SIGMOID, [](double v) { return 1 / (1 + std::exp(-v)); }, false},
      {Spec::Unary::RELU, [](double v) { return std::max(v, 0.0); }, false},
      {Spec::Unary::SILU, [](double v) { return v / (1 + std::exp(-v)); }, false},
      {Spec::Unary::GELU,
       [](double v) {
         return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
       },
       false},
      {Spec::Unary::GELU_EXACT,
       [](double v) { return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0))); }, false},
  };
  for (const auto& [op, function, positive] : cases) {
    const std::function<double(double)>& f = function;  // a lambda cannot capture a binding in C++17
    SCOPED_TRACE(Spec::Unary::Op_Name(op));
    Spec g;
    std::string a = "x";
    if (positive) PositiveInput(&g, a, "pa"), a = "pa";
    Add(&g, "y", {a})->mutable_unary()->set_op(op);
    g.add_outputs("y");
    // Scaled by 2 so the kinks (relu, abs at 0) lie far from most probes.
    LayerInputs in = Inputs({4, 6}, {});
    Array x = FromTensor(in.x);
    if (positive) {
      for (double& v : x.v) v = Positive(v);
    }
    EXPECT_LT(ErrorOf(Values(Forward(g, in)), Map({x}, [&](const auto& v) { return f(v[0]); })),
              kF32Tolerance);
    EXPECT_TRUE(Gradients(g, in));
  }
}

TEST_F(NumpyNodeTest, LogicalNotOfAComparison) {
  Spec g;
  auto* c = Add(&g, "c", {"x"})->mutable_binary();
  c->set_op(Spec::Binary::LESS);
  c->set_scalar(0.0);
  Add(&g, "n", {"c"})->mutable_unary()->set_op(Spec::Unary::LOGICAL_NOT);
  auto* w = Add(&g, "y", {"n", "x"})->mutable_where();
  w->set_y_scalar(-3.0);
  g.add_outputs("y");
  const LayerInputs in = Inputs({7}, {});
  const Array want =
      Map({FromTensor(in.x)}, [](const auto& v) { return !(v[0] < 0) ? v[0] : -3.0; });
  EXPECT_LT(ErrorOf(Values(Forward(g, in)), want), kF32Tolerance);
  EXPECT_TRUE(Gradients(g, in));
}

// ---- where --------------------------------------------------------------------------
// cond [3, 1] broadcast against x [2, 3, 4] and y [4], and each side a constant.
TEST_F(NumpyNodeTest, WhereBroadcastingAndConstants) {
  for (int constants = 0; constants < 3; ++constants) {
    SCOPED_TRACE(constants);
    Spec g;
    auto* c = Add(&g, "c", {"extra_inputs[0]"})->mutable_binary();
    c->set_op(Spec::Binary::GREATER);
    c->set_scalar(0.0);
    std::vector<std::string> in_names = {"c"};
    if (constants != 1) in_names.push_back("x");
    if (constants != 2) in_names.push_back("extra_inputs[1]");
    auto* w = Add(&g, "y", in_names)->mutable_where();
    if (constants == 1) w->set_x_scalar(0.25);
    if (constants == 2) w->set_y_scalar(-0.5);
    g.add_outputs("y");
    // extra_inputs[1] is read unless y is the constant.
    std::vector<Shape> extra = {{3, 1}};
    if (constants != 2) extra.push_back({4});
    const LayerInputs in = Inputs({2, 3, 4}, extra);
    std::vector<Array> operands = {FromTensor(in.extra[0])};
    if (constants != 1) operands.push_back(FromTensor(in.x));
    if (constants != 2) operands.push_back(FromTensor(in.extra[1]));
    const Array want = Map(operands, [&](const std::vector<double>& v) {
      const double x = constants == 1 ? 0.25 : v[1];
      const double y = constants == 2 ? -0.5 : v[constants == 1 ? 1 : 2];
      return v[0] > 0 ? x : y;
    });
    const Tensor y = Forward(g, in);
    EXPECT_EQ(y.shape(), constants == 1 ? (Shape{3, 4}) : (Shape{2, 3, 4}));
    EXPECT_LT(ErrorOf(Values(y), want), kF32Tolerance);
    EXPECT_TRUE(Gradients(g, in));
  }
}

// ---- reduce -------------------------------------------------------------------------
TEST_F(NumpyNodeTest, Reductions) {
  struct Case {
    Spec::Reduce::Op op;
    std::vector<int> axes;
    bool keepdims;
  };
  const std::vector<Case> cases = {
      {Spec::Reduce::SUM, {}, false},     {Spec::Reduce::SUM, {1}, false},
      {Spec::Reduce::MEAN, {-1}, true},   {Spec::Reduce::MEAN, {0, 2}, false},
      {Spec::Reduce::MAX, {1}, false},    {Spec::Reduce::MAX, {}, true},
      {Spec::Reduce::MIN, {0, -1}, true}, {Spec::Reduce::SUM, {0, 1, 2}, true},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(Spec::Reduce::Op_Name(c.op), " axes ", c.axes.size(), " keepdims ",
                              c.keepdims));
    Spec g;
    auto* r = Add(&g, "y", {"x"})->mutable_reduce();
    r->set_op(c.op);
    for (int a : c.axes) r->add_axes(a);
    r->set_keepdims(c.keepdims);
    g.add_outputs("y");
    const LayerInputs in = Inputs({3, 4, 5}, {});
    const Array x = FromTensor(in.x);
    Array want;
    switch (c.op) {
      case Spec::Reduce::SUM:
        want = ReduceRef(x, c.axes, c.keepdims, 0, std::plus<double>());
        break;
      case Spec::Reduce::MEAN:
        want = ReduceRef(x, c.axes, c.keepdims, 0, std::plus<double>(), true);
        break;
      case Spec::Reduce::MAX:
        want = ReduceRef(x, c.axes, c.keepdims, -1e300,
                         [](double a, double b) { return std::max(a, b); });
        break;
      default:
        want = ReduceRef(x, c.axes, c.keepdims, 1e300,
                         [](double a, double b) { return std::min(a, b); });
        break;
    }
    const Tensor y = Forward(g, in);
    EXPECT_EQ(y.shape(), want.shape);
    EXPECT_LT(ErrorOf(Values(y), want), kF32Tolerance);
    // Distinct values 0.05 apart (shuffled), so no step of the finite
    // differences moves an extremum to another element.
    LayerInputs spaced = in;
    std::vector<float> v(60);
    for (int i = 0; i < 60; ++i) v[i] = -1.5f + 0.05f * static_cast<float>((i * 37) % 60);
    testing::SetValues(v, &spaced.x);
    EXPECT_TRUE(Gradients(g, spaced));
  }
}

// jnp.max's gradient is shared equally among tied maxima.
TEST_F(NumpyNodeTest, MaxSharesTheGradientAmongTies) {
  Spec g;
  auto* r = Add(&g, "y", {"x"})->mutable_reduce();
  r->set_op(Spec::Reduce::MAX);
  r->add_axes(1);
  g.add_outputs("y");
  auto layer = *Build(g);
  LayerInputs in = Inputs({2, 4}, {});
  testing::SetValues({3, 1, 3, 3, -1, 2, 0, 1}, &in.x);
  Variables vars;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  ForwardOptions opts;
  opts.keep_for_backward = true;
  ASSERT_TRUE(layer->Forward(*ops_, &vars, in, opts, &out, &saved).ok());
  EXPECT_EQ(Values(out.y), (std::vector<float>{3, 2}));
  Tensor dy = *ops_->Allocate(DType::kF32, {2});
  testing::SetValues({1.5f, 2.0f}, &dy);
  LayerGrads grads;
  ASSERT_TRUE(layer->Backward(*ops_, &vars, *saved, dy, &grads).ok());
  EXPECT_EQ(Values(grads.dx), (std::vector<float>{0.5f, 0, 0.5f, 0.5f, 0, 2, 0, 0}));
}

// ---- einsum -------------------------------------------------------------------------
TEST_F(NumpyNodeTest, Einsum) {
  struct Case {
    std::string equation;
    Shape a, b;
  };
  const std::vector<Case> cases = {
      {"ij,jk->ik", {3, 4}, {4, 5}},
      {"ij,kj->ik", {3, 4}, {5, 4}},           // b transposed in place
      {"ji,jk->ik", {4, 3}, {4, 5}},           // a transposed in place
      {"ji,kj->ki", {4, 3}, {5, 4}},           // both, and the output permuted
      {"bij,bjk->bik", {2, 3, 4}, {2, 4, 5}},  // batched
      {"bqhd,bkhd->bhqk", {2, 3, 2, 4}, {2, 5, 2, 4}},
      {"bhqk,bkhd->bqhd", {2, 2, 3, 5}, {2, 5, 2, 4}},
      {"...d,df->...f", {2, 3, 4}, {4, 6}},
      {"...ij,...jk->...ik", {2, 3, 4}, {2, 4, 2}},
      {"i,i->", {6}, {6}},    // a dot product
      {"i,j->ij", {3}, {4}},  // an outer product
      {"bd,d->b", {3, 4}, {4}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.equation);
    Spec g;
    Add(&g, "y", {"x", "extra_inputs[0]"})->mutable_einsum()->set_equation(c.equation);
    g.add_outputs("y");
    const LayerInputs in = Inputs(c.a, {c.b});
    const Array want = EinsumRef(c.equation, FromTensor(in.x), FromTensor(in.extra[0]));
    const Tensor y = Forward(g, in);
    EXPECT_EQ(y.shape(), want.shape);
    EXPECT_LT(ErrorOf(Values(y), want), kF32Tolerance);
    EXPECT_TRUE(Gradients(g, in));
  }
}

TEST_F(NumpyNodeTest, EinsumImplicitOutput) {
  Spec g;
  Add(&g, "y", {"x", "extra_inputs[0]"})->mutable_einsum()->set_equation("ij,jk");
  g.add_outputs("y");
  const LayerInputs in = Inputs({3, 4}, {{4, 2}});
  const Array want = EinsumRef("ij,jk->ik", FromTensor(in.x), FromTensor(in.extra[0]));
  EXPECT_LT(ErrorOf(Values(Forward(g, in)), want), kF32Tolerance);
}

// ---- slice, softmax -------------------------------------------------------------------
TEST_F(NumpyNodeTest, SliceWithStrides) {
  Spec g;
  auto* s = Add(&g, "y", {"x"})->mutable_slice();
  for (int64_t v : {1, 0, 0}) s->add_start(v);
  for (int64_t v : {3, 5, 6}) s->add_limit(v);
  for (int64_t v : {1, 2, 4}) s->add_stride(v);
  g.add_outputs("y");
  const LayerInputs in = Inputs({3, 5, 6}, {});
  const Array x = FromTensor(in.x);
  Array want{{2, 3, 2}, {}};
  for (int i = 1; i < 3; ++i) {
    for (int j = 0; j < 5; j += 2) {
      for (int k = 0; k < 6; k += 4) want.v.push_back(x.v[(i * 5 + j) * 6 + k]);
    }
  }
  const Tensor y = Forward(g, in);
  EXPECT_EQ(y.shape(), want.shape);
  EXPECT_EQ(ErrorOf(Values(y), want), 0.0);
  EXPECT_TRUE(Gradients(g, in));
}

TEST_F(NumpyNodeTest, SoftmaxAndLogSoftmax) {
  for (bool log : {false, true}) {
    for (int axis : {-1, 1, 0}) {
      SCOPED_TRACE(absl::StrCat(log ? "log_softmax" : "softmax", " axis ", axis));
      Spec g;
      auto* s = Add(&g, "y", {"x"})->mutable_softmax();
      s->set_axis(axis);
      s->set_log(log);
      g.add_outputs("y");
      // Large logits: the max subtracted keeps exp finite.
      LayerInputs in = Inputs({2, 5, 3}, {});
      std::vector<float> xs = Values(in.x);
      xs[0] += 200.0f;
      testing::SetValues(xs, &in.x);
      const Array x = FromTensor(in.x);
      const int a = (axis + 3) % 3;
      const Array m =
          ReduceRef(x, {a}, true, -1e300, [](double p, double q) { return std::max(p, q); });
      const Array e = Map({x, m}, [](const auto& v) { return std::exp(v[0] - v[1]); });
      const Array s_ = ReduceRef(e, {a}, true, 0, std::plus<double>());
      const Array want = Map({x, m, s_}, [&](const auto& v) {
        return log ? v[0] - v[1] - std::log(v[2]) : std::exp(v[0] - v[1]) / v[2];
      });
      EXPECT_LT(ErrorOf(Values(Forward(g, in)), want), kF32Tolerance);
      EXPECT_TRUE(Gradients(g, Inputs({2, 5, 3}, {})));
    }
  }
}

// bfloat16 operands compute in float32 and round once.
TEST_F(NumpyNodeTest, Bfloat16) {
  Spec g;
  Add(&g, "m", {"x", "extra_inputs[0]"})->mutable_binary()->set_op(Spec::Binary::MULTIPLY);
  Add(&g, "y", {"m"})->mutable_softmax()->set_axis(-1);
  g.add_outputs("y");
  const LayerInputs in = Inputs({4, 8}, {{8}}, DType::kBF16);
  const Array prod =
      Map({FromTensor(in.x), FromTensor(in.extra[0])}, [](const auto& v) { return v[0] * v[1]; });
  const Array m =
      ReduceRef(prod, {1}, true, -1e300, [](double p, double q) { return std::max(p, q); });
  const Array e = Map({prod, m}, [](const auto& v) { return std::exp(v[0] - v[1]); });
  const Array s = ReduceRef(e, {1}, true, 0, std::plus<double>());
  const Tensor y = Forward(g, in);
  EXPECT_EQ(y.dtype(), DType::kBF16);
  EXPECT_LT(ErrorOf(Values(y), Map({e, s}, [](const auto& v) { return v[0] / v[1]; })),
            kBf16Tolerance);
}

// ---- param --------------------------------------------------------------------------
Spec ParamGraph(const te::v1::Initializer& init, Shape shape = {4, 3},
                te::v1::DType dtype = te::v1::FLOAT32) {
  Spec g;
  Spec::Node* p = g.add_nodes();
  p->set_name("scale");
  p->add_outputs("scale");
  for (int64_t d : shape) p->mutable_param()->add_shape(d);
  p->mutable_param()->set_dtype(dtype);
  *p->mutable_param()->mutable_initializer() = init;
  Add(&g, "y", {"x", "scale"})->mutable_binary()->set_op(Spec::Binary::MULTIPLY);
  g.add_outputs("y");
  return g;
}

TEST_F(NumpyNodeTest, ParamIsAVariableTrainedLikeAParameter) {
  te::v1::Initializer init;
  init.set_kind(te::v1::Initializer::NORMAL);
  init.set_stddev(0.5);
  const Spec g = ParamGraph(init);
  auto layer = *Build(g);
  auto specs = layer->VariableSpecs({2, 4, 3}, nullptr);
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 1u);
  EXPECT_EQ((*specs)[0].name, "params/scale");
  EXPECT_EQ((*specs)[0].shape, (Shape{4, 3}));
  // Deterministic from the seed, different for another.
  auto a = testing::InitLayer(*ops_, *layer, {2, 4, 3}, nullptr, 7);
  auto b = testing::InitLayer(*ops_, *layer, {2, 4, 3}, nullptr, 7);
  auto c = testing::InitLayer(*ops_, *layer, {2, 4, 3}, nullptr, 8);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(Values(a->at("params/scale")), Values(b->at("params/scale")));
  EXPECT_NE(Values(a->at("params/scale")), Values(c->at("params/scale")));
  // y = x * scale; the gradient reaches params/scale (summed over the batch).
  const LayerInputs in = Inputs({2, 4, 3}, {});
  EXPECT_TRUE(Gradients(g, in));
}

TEST_F(NumpyNodeTest, ParamInitializers) {
  using I = te::v1::Initializer;
  auto stats = [&](const I& init, Shape shape) {
    auto layer = *Build(ParamGraph(init, shape));
    Variables vars = *testing::InitLayer(*ops_, *layer, shape, nullptr, 3);
    std::vector<float> v = Values(vars.at("params/scale"));
    double mean = 0, sq = 0, lo = 1e300, hi = -1e300;
    for (float f : v)
      mean += f, sq += double(f) * f, lo = std::min(lo, double(f)), hi = std::max(hi, double(f));
    mean /= v.size();
    return std::array<double, 4>{mean, std::sqrt(sq / v.size() - mean * mean), lo, hi};
  };
  I init;
  init.set_kind(I::CONSTANT);
  init.set_value(0.125);
  EXPECT_EQ(stats(init, {8, 8}), (std::array<double, 4>{0.125, 0, 0.125, 0.125}));
  init.set_kind(I::ONES);
  EXPECT_EQ(stats(init, {8, 8})[0], 1.0);
  init.set_kind(I::ZEROS);
  EXPECT_EQ(stats(init, {8, 8})[3], 0.0);
  // Distributions, on 64 x 256 values (standard errors ~1%).
  const Shape big = {64, 256};
  init = I();
  init.set_kind(I::UNIFORM);
  init.set_scale(2.0);
  auto s = stats(init, big);
  EXPECT_NEAR(s[0], 1.0, 0.03);
  EXPECT_GE(s[2], 0.0);
  EXPECT_LT(s[3], 2.0);
  init = I();
  init.set_kind(I::NORMAL);
  init.set_stddev(0.2);
  EXPECT_NEAR(stats(init, big)[1], 0.2, 0.005);
  init.set_kind(I::TRUNCATED_NORMAL);
  s = stats(init, big);
  EXPECT_GE(s[2], -0.4);
  EXPECT_LE(s[3], 0.4);
  // Variance scaling: lecun_normal's std sqrt(1 / fan_in), fan_in 64; he 2 / fan_in;
  // glorot_uniform on +-sqrt(6 / (fan_in + fan_out)); unset is lecun_normal.
  init = I();
  EXPECT_NEAR(stats(init, big)[1], std::sqrt(1.0 / 64), 0.004);
  init.set_kind(I::HE_NORMAL);
  EXPECT_NEAR(stats(init, big)[1], std::sqrt(2.0 / 64), 0.006);
  init.set_kind(I::GLOROT_UNIFORM);
  s = stats(init, big);
  EXPECT_NEAR(s[1], std::sqrt(2.0 / (64 + 256)), 0.002);
  EXPECT_LE(s[3], std::sqrt(6.0 / (64 + 256)));
  init = I();
  init.set_kind(I::VARIANCE_SCALING);
  init.set_scale(3.0);
  init.set_mode("fan_out");
  init.set_distribution("normal");
  EXPECT_NEAR(stats(init, big)[1], std::sqrt(3.0 / 256), 0.004);
}

TEST_F(NumpyNodeTest, Bfloat16ParamKeepsItsDType) {
  te::v1::Initializer init;
  init.set_kind(te::v1::Initializer::ONES);
  const Spec g = ParamGraph(init, {3}, te::v1::BFLOAT16);
  auto layer = *Build(g);
  Variables vars = *testing::InitLayer(*ops_, *layer, {2, 3}, nullptr);
  EXPECT_EQ(vars.at("params/scale").dtype(), DType::kBF16);
  EXPECT_EQ(layer->OutputDType(DType::kBF16), DType::kBF16);
}

// ---- bad specs ------------------------------------------------------------------------
TEST_F(NumpyNodeTest, BadSpecsNameTheField) {
  {
    Spec g;
    auto* r = Add(&g, "mean_0", {"x"})->mutable_reduce();
    r->set_op(Spec::Reduce::MEAN);
    r->add_axes(3);
    g.add_outputs("mean_0");
    EXPECT_INVALID(InitError(g, {2, 3, 4}),
                   "spec.graph.nodes[0] (mean_0).reduce.axes[0]: 3 is out of range for rank 3");
  }
  {
    Spec g;
    auto* r = Add(&g, "r", {"x"})->mutable_reduce();
    r->set_op(Spec::Reduce::SUM);
    r->add_axes(0);
    r->add_axes(-3);
    g.add_outputs("r");
    EXPECT_INVALID(InitError(g, {2, 3, 4}), "spec.graph.nodes[0] (r).reduce.axes[1]");
  }
  for (const auto& [eq, text] : std::vector<std::pair<std::string, std::string>>{
           {"ii,ij->j", "repeats 'i'"},
           {"ij,jk->ikl", "'l' is in neither operand"},
           {"ij,kl->i", "index 'j' of operand 0"},
           {"ij->ij", "want two operands"},
           {"ij,jk,kl->il", "want two operands"},
           {"i1,jk->ik", "'1' is not an index letter"},
           {"...ij,jk->ik", "\"...\" in an operand"}}) {
    SCOPED_TRACE(eq);
    Spec g;
    Add(&g, "e", {"x", "x"})->mutable_einsum()->set_equation(eq);
    g.add_outputs("e");
    EXPECT_INVALID(InitError(g, {3, 3}), "spec.graph.nodes[0] (e).einsum.equation");
    EXPECT_INVALID(InitError(g, {3, 3}), text);
  }
  {
    Spec g;  // a rank that does not fit the term
    Add(&g, "e", {"x", "x"})->mutable_einsum()->set_equation("ijk,kl->ijl");
    g.add_outputs("e");
    EXPECT_INVALID(InitError(g, {3, 3}), "operand 0 [3, 3] has rank 2");
  }
  {
    Spec g;  // shapes that do not broadcast
    Add(&g, "s", {"x"}, {"s"})->mutable_reshape()->add_shape(-1);
    Add(&g, "m", {"x", "s"})->mutable_binary()->set_op(Spec::Binary::ADD);
    g.add_outputs("m");
    EXPECT_INVALID(InitError(g, {2, 3}),
                   "spec.graph.nodes[1] (m): inputs[0] [2, 3], inputs[1] [6] do not broadcast");
  }
  {
    Spec g;  // a slice out of bounds
    auto* s = Add(&g, "sl", {"x"})->mutable_slice();
    s->add_start(0);
    s->add_start(1);
    s->add_limit(2);
    s->add_limit(5);
    g.add_outputs("sl");
    EXPECT_INVALID(InitError(g, {2, 3}), "spec.graph.nodes[0] (sl).slice.limit[1]: 5 is outside");
  }
  {
    Spec g;  // a slice of the wrong rank
    auto* s = Add(&g, "sl", {"x"})->mutable_slice();
    s->add_start(0);
    s->add_limit(1);
    g.add_outputs("sl");
    EXPECT_INVALID(InitError(g, {2, 3}), "spec.graph.nodes[0] (sl).slice: start [0]");
  }
  {
    Spec g;  // softmax axis
    Add(&g, "sm", {"x"})->mutable_softmax()->set_axis(-3);
    g.add_outputs("sm");
    EXPECT_INVALID(InitError(g, {2, 3}),
                   "spec.graph.nodes[0] (sm).softmax.axis: -3 is out of range");
  }
  {
    Spec g;  // an unset op
    Add(&g, "b", {"x", "x"})->mutable_binary();
    g.add_outputs("b");
    EXPECT_INVALID(InitError(g, {2}), "spec.graph.nodes[0] (b).binary.op: 0 is not a binary op");
  }
  {
    Spec g;  // a non-finite scalar
    auto* b = Add(&g, "b", {"x"})->mutable_binary();
    b->set_op(Spec::Binary::ADD);
    b->set_scalar(INFINITY);
    g.add_outputs("b");
    EXPECT_INVALID(InitError(g, {2}), "spec.graph.nodes[0] (b).binary.scalar");
  }
  {
    Spec g;  // where's condition must be bool
    Add(&g, "w", {"x", "x", "x"})->mutable_where();
    g.add_outputs("w");
    // The input's dtype is known at the forward, not at init.
    auto layer = *Build(g);
    Variables vars;
    LayerOutputs out;
    EXPECT_INVALID(layer->Forward(*ops_, &vars, Inputs({2}, {}), {}, &out, nullptr),
                   "spec.graph.nodes[0] (w).inputs[0]: where's condition must be bool");
  }
  using I = te::v1::Initializer;
  {
    I init;  // lecun_normal of a vector: no fans
    EXPECT_INVALID(InitError(ParamGraph(init, {3}), {2, 3}),
                   "spec.graph.nodes[0] (scale).param.initializer: variance scaling");
    init.set_kind(I::VARIANCE_SCALING);
    init.set_mode("fan_sideways");
    EXPECT_INVALID(InitError(ParamGraph(init), {2, 4, 3}),
                   "spec.graph.nodes[0] (scale).param.initializer.mode: \"fan_sideways\"");
    init.set_mode("fan_in");
    init.set_distribution("cauchy");
    EXPECT_INVALID(InitError(ParamGraph(init), {2, 4, 3}), "param.initializer.distribution");
    init = I();
    init.set_in_axis(5);
    EXPECT_INVALID(InitError(ParamGraph(init), {2, 4, 3}),
                   "param.initializer.in_axis: 5 is out of range");
    init = I();
    init.set_kind(I::NORMAL);
    init.set_stddev(-1);
    EXPECT_INVALID(InitError(ParamGraph(init), {2, 4, 3}), "param.initializer.stddev");
  }
  {
    Spec g = ParamGraph(I(), {0, 3});
    EXPECT_INVALID(InitError(g, {2, 0, 3}), "spec.graph.nodes[0] (scale).param.shape[0]: 0");
  }
  {
    Spec g = ParamGraph(I());  // a param inside a module's scope
    g.mutable_nodes(0)->set_name("Dense_0/scale");
    g.mutable_nodes(0)->set_outputs(0, "scale");
    Spec::Node* d = g.add_nodes();
    d->set_name("Dense_0");
    d->add_inputs("y");
    d->add_outputs("z");
    d->mutable_module()->mutable_flax_dense()->set_features(2);
    g.set_outputs(0, "z");
    EXPECT_INVALID(InitError(g, {2, 4, 3}), "lies inside the scope of module");
  }
}

}  // namespace
}  // namespace te::layers
