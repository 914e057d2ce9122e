// Graph's jax.numpy nodes (client/graph.h): binary, unary, where, reduce,
// einsum, slice, softmax and param, each with numpy's shape rules and JAX's
// dtype promotion, recorded as the GraphSpec.Node the server runs
// (proto/te/v1/layers.proto states each node's contract).
#include <algorithm>
#include <cctype>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/graph.h"
#include "client/module_outputs.h"

namespace te::client {
namespace {

bool IsFloat(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16; }

int NormalizedAxis(int axis, size_t rank) {
  const int r = static_cast<int>(rank);
  return axis >= -r && axis < r ? (axis + r) % r : -1;
}

bool IsComparison(Graph::BinaryOp op) { return op >= te::v1::GraphSpec::Binary::GREATER; }

// An einsum's terms with "..." expanded to upper-case labels from the right
// ('Z' last), so both operands' "..." dims align as numpy's do. Empty error
// on success.
struct EinsumShapes {
  std::string error;
  Shape out;
};

EinsumShapes EinsumOutput(const std::string& equation, const Shape& a, const Shape& b) {
  EinsumShapes r;
  std::string eq;
  for (char c : equation) {
    if (c != ' ') eq += c;
  }
  const size_t arrow = eq.find("->");
  const std::string lhs = eq.substr(0, arrow);
  const size_t comma = lhs.find(',');
  if (comma == std::string::npos || lhs.find(',', comma + 1) != std::string::npos) {
    r.error = "want two operands (\"ab,bc->ac\")";
    return r;
  }
  std::string terms[2] = {lhs.substr(0, comma), lhs.substr(comma + 1)};
  const Shape* shapes[2] = {&a, &b};
  size_t width = 0;
  for (int o = 0; o < 2; ++o) {
    const size_t dots = terms[o].find("...");
    const size_t letters = terms[o].size() - (dots == std::string::npos ? 0 : 3);
    if (shapes[o]->size() < letters || (dots == std::string::npos && shapes[o]->size() != letters)) {
      r.error = absl::StrCat("operand ", o, " ", ShapeString(*shapes[o]), " does not fit \"", terms[o], "\"");
      return r;
    }
    width = std::max(width, shapes[o]->size() - letters);
  }
  auto expand = [&](const std::string& t, size_t w) {
    const size_t dots = t.find("...");
    if (dots == std::string::npos) return t;
    std::string labels;
    for (size_t i = width - w; i < width; ++i) labels += static_cast<char>('Z' - (width - 1 - i));
    return t.substr(0, dots) + labels + t.substr(dots + 3);
  };
  std::map<char, int64_t> size;
  std::map<char, int> count;
  for (int o = 0; o < 2; ++o) {
    const size_t dots = terms[o].find("...");
    const size_t w = dots == std::string::npos ? 0 : shapes[o]->size() - (terms[o].size() - 3);
    terms[o] = expand(terms[o], w);
    for (size_t d = 0; d < terms[o].size(); ++d) {
      const char l = terms[o][d];
      if (!std::isalpha(static_cast<unsigned char>(l))) {
        r.error = absl::StrCat("'", std::string(1, l), "' is not an index letter");
        return r;
      }
      auto [it, inserted] = size.emplace(l, (*shapes[o])[d]);
      if (!inserted && it->second != (*shapes[o])[d]) {
        r.error = absl::StrCat("index '", std::string(1, l), "' is ", it->second, " and ", (*shapes[o])[d]);
        return r;
      }
      ++count[l];
    }
  }
  std::string out;
  if (arrow != std::string::npos) {
    out = eq.substr(arrow + 2);
    const size_t dots = out.find("...");
    if (dots != std::string::npos) out = out.substr(0, dots) + expand("...", width) + out.substr(dots + 3);
  } else {
    out = expand(width > 0 ? "..." : "", width);
    for (const auto& [l, n] : count) {
      if (n == 1 && !(l >= 'A' && l <= 'Z' && out.find(l) != std::string::npos)) out += l;
    }
  }
  for (char l : out) {
    auto it = size.find(l);
    if (it == size.end()) {
      r.error = absl::StrCat("output index '", std::string(1, l), "' is in neither operand");
      return r;
    }
    r.out.push_back(it->second);
  }
  return r;
}

}  // namespace

std::optional<Shape> Graph::Broadcast(const std::vector<Edge>& ts, const std::string& where) {
  Shape out;
  for (Edge e : ts) {
    const Shape& s = edges_[e.id].shape;
    if (s.size() > out.size()) out.insert(out.begin(), s.size() - out.size(), 1);
    for (size_t d = 0; d < s.size(); ++d) {
      int64_t& o = out[out.size() - s.size() + d];
      if (s[d] == o || s[d] == 1) continue;
      if (o != 1) {
        std::vector<std::string> shapes;
        for (Edge t : ts) shapes.push_back(ShapeString(edges_[t.id].shape));
        Fail(where, absl::StrCat("shapes ", absl::StrJoin(shapes, ", "), " do not broadcast together"));
        return std::nullopt;
      }
      o = s[d];
    }
  }
  return out;
}

Graph::Edge Graph::Binary(BinaryOp op, Edge a, Edge b) {
  const std::string where = GlueNameNow("binary");
  if (!Readable({a, b}, where)) return Edge{};
  const std::optional<Shape> shape = Broadcast({a, b}, where);
  if (!shape) return Edge{};
  const std::vector<Edge> inputs = Promoted({a, b}, "binary");
  if (inputs.empty()) return Edge{};
  NodeInfo node = Glue("binary", inputs);
  node.op.mutable_binary()->set_op(op);
  return RecordOne(std::move(node), *shape, IsComparison(op) ? DType::kBool : edges_[inputs[0].id].dtype);
}

Graph::Edge Graph::Binary(BinaryOp op, Edge x, double scalar, bool scalar_first) {
  const std::string where = GlueNameNow("binary");
  if (!Readable({x}, where)) return Edge{};
  if (!IsFloat(edges_[x.id].dtype)) {
    return Fail(where, absl::StrCat("binary takes float tensors, not ", DTypeName(edges_[x.id].dtype)));
  }
  NodeInfo node = Glue("binary", {x});
  node.op.mutable_binary()->set_op(op);
  node.op.mutable_binary()->set_scalar(scalar);
  node.op.mutable_binary()->set_scalar_first(scalar_first);
  return RecordOne(std::move(node), edges_[x.id].shape, IsComparison(op) ? DType::kBool : edges_[x.id].dtype);
}

Graph::Edge Graph::Unary(UnaryOp op, Edge x) {
  const std::string where = GlueNameNow("unary");
  if (!Readable({x}, where)) return Edge{};
  const bool logical = op == te::v1::GraphSpec::Unary::LOGICAL_NOT;
  const DType dtype = edges_[x.id].dtype;
  if (logical ? dtype != DType::kBool : !IsFloat(dtype)) {
    return Fail(where, absl::StrCat(logical ? "logical_not takes bool" : "unary takes float tensors", ", not ",
                                    DTypeName(dtype)));
  }
  NodeInfo node = Glue("unary", {x});
  node.op.mutable_unary()->set_op(op);
  return RecordOne(std::move(node), edges_[x.id].shape, dtype);
}

Graph::Edge Graph::WhereOf(Edge cond, std::optional<double> x_scalar, Edge x, std::optional<double> y_scalar, Edge y) {
  const std::string where = GlueNameNow("where");
  std::vector<Edge> values;
  if (!x_scalar) values.push_back(x);
  if (!y_scalar) values.push_back(y);
  std::vector<Edge> all = {cond};
  all.insert(all.end(), values.begin(), values.end());
  if (!Readable(all, where)) return Edge{};
  if (edges_[cond.id].dtype != DType::kBool) {
    return Fail(where, absl::StrCat("the condition is ", DTypeName(edges_[cond.id].dtype), "; want bool"));
  }
  const std::optional<Shape> shape = Broadcast(all, where);
  if (!shape) return Edge{};
  std::vector<Edge> inputs = {cond};
  DType dtype = DType::kF32;  // two constants: JAX's float32
  if (!values.empty()) {
    const std::vector<Edge> promoted = Promoted(values, "where");
    if (promoted.empty()) return Edge{};
    inputs.insert(inputs.end(), promoted.begin(), promoted.end());
    dtype = edges_[promoted[0].id].dtype;
  }
  NodeInfo node = Glue("where", inputs);
  te::v1::GraphSpec::Where* w = node.op.mutable_where();
  if (x_scalar) w->set_x_scalar(*x_scalar);
  if (y_scalar) w->set_y_scalar(*y_scalar);
  return RecordOne(std::move(node), *shape, dtype);
}

Graph::Edge Graph::Where(Edge cond, Edge x, Edge y) { return WhereOf(cond, std::nullopt, x, std::nullopt, y); }
Graph::Edge Graph::Where(Edge cond, double x, Edge y) { return WhereOf(cond, x, Edge{}, std::nullopt, y); }
Graph::Edge Graph::Where(Edge cond, Edge x, double y) { return WhereOf(cond, std::nullopt, x, y, Edge{}); }

Graph::Edge Graph::Reduce(ReduceOp op, Edge x, const std::vector<int>& axes, bool keepdims) {
  const std::string where = GlueNameNow("reduce");
  if (!Readable({x}, where)) return Edge{};
  if (!IsFloat(edges_[x.id].dtype)) {
    return Fail(where, absl::StrCat("reduce takes float tensors, not ", DTypeName(edges_[x.id].dtype)));
  }
  const Shape& from = edges_[x.id].shape;
  std::set<int> reduced;
  for (int a : axes) {
    const int n = NormalizedAxis(a, from.size());
    if (n < 0) return Fail(where, absl::StrCat("axis ", a, " is out of range for ", ShapeString(from)));
    if (!reduced.insert(n).second) return Fail(where, absl::StrCat("axis ", a, " is named twice"));
  }
  Shape shape;
  NodeInfo node = Glue("reduce", {x});
  te::v1::GraphSpec::Reduce* r = node.op.mutable_reduce();
  r->set_op(op);
  r->set_keepdims(keepdims);
  for (int a : reduced) r->add_axes(a);
  for (size_t d = 0; d < from.size(); ++d) {
    const bool gone = axes.empty() || reduced.count(static_cast<int>(d)) > 0;
    if (!gone) shape.push_back(from[d]);
    if (gone && keepdims) shape.push_back(1);
  }
  return RecordOne(std::move(node), shape, edges_[x.id].dtype);
}

Graph::Edge Graph::Einsum(const std::string& equation, Edge a, Edge b, te::v1::Precision precision) {
  const std::string where = GlueNameNow("einsum");
  if (!Readable({a, b}, where)) return Edge{};
  const EinsumShapes shapes = EinsumOutput(equation, edges_[a.id].shape, edges_[b.id].shape);
  if (!shapes.error.empty()) return Fail(where, absl::StrCat("\"", equation, "\": ", shapes.error));
  const std::vector<Edge> inputs = Promoted({a, b}, "einsum");
  if (inputs.empty()) return Edge{};
  NodeInfo node = Glue("einsum", inputs);
  node.op.mutable_einsum()->set_equation(equation);
  node.op.mutable_einsum()->set_precision(precision);
  return RecordOne(std::move(node), shapes.out, edges_[inputs[0].id].dtype);
}

Graph::Edge Graph::Slice(Edge x, const std::vector<int64_t>& start, const std::vector<int64_t>& limit,
                         const std::vector<int64_t>& stride) {
  const std::string where = GlueNameNow("slice");
  if (!Readable({x}, where)) return Edge{};
  const Shape& from = edges_[x.id].shape;
  if (start.size() != from.size() || limit.size() != from.size() || (!stride.empty() && stride.size() != from.size())) {
    return Fail(where, absl::StrCat("start, limit and stride want one entry per axis of ", ShapeString(from)));
  }
  Shape shape;
  for (size_t d = 0; d < from.size(); ++d) {
    const int64_t step = stride.empty() ? 1 : stride[d];
    if (step < 1 || start[d] < 0 || start[d] > limit[d] || limit[d] > from[d]) {
      return Fail(where, absl::StrCat("axis ", d, ": ", start[d], ":", limit[d], ":", step,
                                      " is not within 0:", from[d], " with a positive step"));
    }
    shape.push_back((limit[d] - start[d] + step - 1) / step);
  }
  if (shape == from) return x;  // the whole tensor
  NodeInfo node = Glue("slice", {x});
  for (int64_t v : start) node.op.mutable_slice()->add_start(v);
  for (int64_t v : limit) node.op.mutable_slice()->add_limit(v);
  for (int64_t v : stride) node.op.mutable_slice()->add_stride(v);
  return RecordOne(std::move(node), shape, edges_[x.id].dtype);
}

Graph::Edge Graph::Softmax(Edge x, int axis, bool log) {
  const std::string where = GlueNameNow("softmax");
  if (!Readable({x}, where)) return Edge{};
  if (!IsFloat(edges_[x.id].dtype)) {
    return Fail(where, absl::StrCat("softmax takes float tensors, not ", DTypeName(edges_[x.id].dtype)));
  }
  if (NormalizedAxis(axis, edges_[x.id].shape.size()) < 0) {
    return Fail(where, absl::StrCat("axis ", axis, " is out of range for ", ShapeString(edges_[x.id].shape)));
  }
  NodeInfo node = Glue("softmax", {x});
  node.op.mutable_softmax()->set_axis(axis);
  node.op.mutable_softmax()->set_log(log);
  return RecordOne(std::move(node), edges_[x.id].shape, edges_[x.id].dtype);
}

Graph::Edge Graph::Param(const std::string& name, Shape shape, const te::v1::Initializer& init, DType dtype) {
  const std::string node_name = ScopePath().empty() ? name : absl::StrCat(ScopePath(), "/", name);
  const std::string where = absl::StrCat(node_name, " (param)");
  if (!error_.ok()) return Edge{};
  if (name.empty()) return Fail(where, "a param needs a name");
  if (!IsFloat(dtype))
    return Fail(where, absl::StrCat("dtype ", DTypeName(dtype), ": want float32, bfloat16 or float16"));
  for (int64_t d : shape) {
    if (d < 1) return Fail(where, absl::StrCat("shape ", ShapeString(shape), ": want positive dims"));
  }
  if (!Claimable(node_name, where)) return Edge{};
  NodeInfo node;
  node.scope = ScopePath();
  node.name = node_name;
  node.keep = true;  // Flax creates the variable whether or not it is read
  te::v1::GraphSpec::Param* p = node.op.mutable_param();
  for (int64_t d : shape) p->add_shape(d);
  p->set_dtype(DTypeToProto(dtype));
  *p->mutable_initializer() = init;
  return RecordOne(std::move(node), std::move(shape), dtype);
}

}  // namespace te::client
