// BuildGraph's part for jax.numpy's nodes: each node's op fields from the
// spec (enums to ops.h's, constants checked finite, an einsum equation
// parsed), and the arity each op takes. What needs shapes (axes in range,
// broadcasting, slice bounds, einsum sizes) is Infer's (graph_numpy_infer.cc).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {
namespace {

using te::v1::GraphSpec;

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

absl::Status Arity(const std::string& where, const std::string& what, int got, int want) {
  if (got == want) return absl::OkStatus();
  return Invalid(where, absl::StrCat("takes ", want, " ", what, ", got ", got));
}

// A constant operand: finite, and within float32's range (it is computed in float32).
absl::Status CheckConstant(double v, const std::string& where) {
  if (std::isfinite(v) && std::abs(v) <= std::numeric_limits<float>::max()) {
    return absl::OkStatus();
  }
  return Invalid(where, absl::StrCat(v, "; want a finite float32"));
}

absl::StatusOr<BinaryOp> BinaryOpOf(GraphSpec::Binary::Op op, const std::string& where) {
  switch (op) {
    case GraphSpec::Binary::ADD: return BinaryOp::kAdd;
    case GraphSpec::Binary::SUBTRACT: return BinaryOp::kSubtract;
    case GraphSpec::Binary::MULTIPLY: return BinaryOp::kMultiply;
    case GraphSpec::Binary::DIVIDE: return BinaryOp::kDivide;
    case GraphSpec::Binary::MAXIMUM: return BinaryOp::kMaximum;
    case GraphSpec::Binary::MINIMUM: return BinaryOp::kMinimum;
    case GraphSpec::Binary::POWER: return BinaryOp::kPower;
    case GraphSpec::Binary::GREATER: return BinaryOp::kGreater;
    case GraphSpec::Binary::GREATER_EQUAL: return BinaryOp::kGreaterEqual;
    case GraphSpec::Binary::LESS: return BinaryOp::kLess;
    case GraphSpec::Binary::LESS_EQUAL: return BinaryOp::kLessEqual;
    case GraphSpec::Binary::EQUAL: return BinaryOp::kEqual;
    case GraphSpec::Binary::NOT_EQUAL: return BinaryOp::kNotEqual;
    default: break;  // OP_UNSPECIFIED, or a value this server does not know
  }
  return Invalid(where,
                 absl::StrCat(static_cast<int>(op), " is not a binary op (ADD to NOT_EQUAL)"));
}

absl::StatusOr<UnaryOp> UnaryOpOf(GraphSpec::Unary::Op op, const std::string& where) {
  switch (op) {
    case GraphSpec::Unary::NEGATIVE: return UnaryOp::kNegative;
    case GraphSpec::Unary::EXP: return UnaryOp::kExp;
    case GraphSpec::Unary::LOG: return UnaryOp::kLog;
    case GraphSpec::Unary::TANH: return UnaryOp::kTanh;
    case GraphSpec::Unary::SQRT: return UnaryOp::kSqrt;
    case GraphSpec::Unary::RSQRT: return UnaryOp::kRsqrt;
    case GraphSpec::Unary::ABS: return UnaryOp::kAbs;
    case GraphSpec::Unary::SQUARE: return UnaryOp::kSquare;
    case GraphSpec::Unary::SIGMOID: return UnaryOp::kSigmoid;
    case GraphSpec::Unary::RELU: return UnaryOp::kRelu;
    case GraphSpec::Unary::SILU: return UnaryOp::kSilu;
    case GraphSpec::Unary::GELU: return UnaryOp::kGelu;
    case GraphSpec::Unary::GELU_EXACT: return UnaryOp::kGeluExact;
    case GraphSpec::Unary::LOGICAL_NOT: return UnaryOp::kLogicalNot;
    default: break;
  }
  return Invalid(
      where, absl::StrCat(static_cast<int>(op), " is not a unary op (NEGATIVE to LOGICAL_NOT)"));
}

absl::StatusOr<ReduceOp> ReduceOpOf(GraphSpec::Reduce::Op op, const std::string& where) {
  switch (op) {
    case GraphSpec::Reduce::SUM: return ReduceOp::kSum;
    case GraphSpec::Reduce::MEAN: return ReduceOp::kMean;
    case GraphSpec::Reduce::MAX: return ReduceOp::kMax;
    case GraphSpec::Reduce::MIN: return ReduceOp::kMin;
    default: break;
  }
  return Invalid(where,
                 absl::StrCat(static_cast<int>(op), " is not a reduction (SUM, MEAN, MAX or MIN)"));
}

// One term of an equation: letters, and "..." at most once.
absl::Status ParseTerm(const std::string& term, const std::string& where, std::vector<int>* out) {
  bool ellipsis = false;
  std::set<int> seen;
  for (size_t i = 0; i < term.size(); ++i) {
    const char c = term[i];
    if (c == '.') {
      if (ellipsis || term.compare(i, 3, "...") != 0) {
        return Invalid(
            where, absl::StrCat("\"", term, "\": \"...\" at most once, and only as three dots"));
      }
      ellipsis = true;
      out->push_back(EinsumTerms::kEllipsis);
      i += 2;
      continue;
    }
    if (!std::isalpha(static_cast<unsigned char>(c))) {
      return Invalid(
          where, absl::StrCat("\"", term, "\": '", std::string(1, c), "' is not an index letter"));
    }
    if (!seen.insert(c).second) {
      return Invalid(where,
                     absl::StrCat("\"", term, "\" repeats '", std::string(1, c),
                                  "' (a trace or diagonal, which one GEMM does not compute)"));
    }
    out->push_back(c);
  }
  return absl::OkStatus();
}

bool Has(const std::vector<int>& labels, int l) {
  return std::find(labels.begin(), labels.end(), l) != labels.end();
}

}  // namespace

bool IsNumpyKind(NodeKind kind) {
  switch (kind) {
    case NodeKind::kBinary:
    case NodeKind::kUnary:
    case NodeKind::kWhere:
    case NodeKind::kReduce:
    case NodeKind::kEinsum:
    case NodeKind::kSlice:
    case NodeKind::kSoftmax: return true;
    case NodeKind::kModule:
    case NodeKind::kReshape:
    case NodeKind::kSplit:
    case NodeKind::kConcatenate:
    case NodeKind::kAdd:
    case NodeKind::kScale:
    case NodeKind::kCast:
    case NodeKind::kTranspose:
    case NodeKind::kDropout:
    case NodeKind::kCausalMask:
    case NodeKind::kSoftmaxCrossEntropy:
    case NodeKind::kAttend:
    case NodeKind::kParam: return false;
  }
  return false;
}

absl::Status ParseEinsum(const std::string& equation, const std::string& where,
                         EinsumTerms* terms) {
  std::string eq;
  for (char c : equation) {
    if (c != ' ') eq += c;
  }
  const size_t arrow = eq.find("->");
  const std::string lhs = eq.substr(0, arrow);
  const size_t comma = lhs.find(',');
  if (comma == std::string::npos || lhs.find(',', comma + 1) != std::string::npos) {
    return Invalid(where, absl::StrCat("\"", equation, "\": want two operands (\"ab,bc->ac\")"));
  }
  RETURN_IF_ERROR(ParseTerm(lhs.substr(0, comma), where, &terms->a));
  RETURN_IF_ERROR(ParseTerm(lhs.substr(comma + 1), where, &terms->b));
  if (arrow != std::string::npos) {
    RETURN_IF_ERROR(ParseTerm(eq.substr(arrow + 2), where, &terms->out));
  } else {
    // numpy's implicit output: "..." first, then the letters that appear once, sorted.
    if (Has(terms->a, EinsumTerms::kEllipsis) || Has(terms->b, EinsumTerms::kEllipsis)) {
      terms->out.push_back(EinsumTerms::kEllipsis);
    }
    std::set<int> once;
    for (const std::vector<int>* t : {&terms->a, &terms->b}) {
      for (int l : *t) {
        if (l == EinsumTerms::kEllipsis) continue;
        if (Has(terms->a, l) != Has(terms->b, l)) once.insert(l);
      }
    }
    terms->out.insert(terms->out.end(), once.begin(), once.end());
  }
  const bool in_ellipsis =
      Has(terms->a, EinsumTerms::kEllipsis) || Has(terms->b, EinsumTerms::kEllipsis);
  if (Has(terms->out, EinsumTerms::kEllipsis) != in_ellipsis) {
    return Invalid(where, absl::StrCat("\"", equation, "\": \"...\" in ",
                                       in_ellipsis ? "an operand must" : "the output must not",
                                       " appear in the output too (",
                                       in_ellipsis ? "summing over it" : "it stands for nothing",
                                       " is not supported)"));
  }
  for (int l : terms->out) {
    if (l != EinsumTerms::kEllipsis && !Has(terms->a, l) && !Has(terms->b, l)) {
      return Invalid(where,
                     absl::StrCat("\"", equation, "\": output index '",
                                  std::string(1, static_cast<char>(l)), "' is in neither operand"));
    }
  }
  for (const std::vector<int>* t : {&terms->a, &terms->b}) {
    const std::vector<int>& other = t == &terms->a ? terms->b : terms->a;
    for (int l : *t) {
      if (l == EinsumTerms::kEllipsis || Has(other, l) || Has(terms->out, l)) continue;
      return Invalid(
          where, absl::StrCat("\"", equation, "\": index '", std::string(1, static_cast<char>(l)),
                              "' of operand ", t == &terms->a ? 0 : 1,
                              " is neither contracted with the other operand nor in "
                              "the output (sum it with a reduce node first)"));
    }
  }
  return absl::OkStatus();
}

absl::Status ParseNumpyNode(const GraphSpec::Node& s, Node* node) {
  const std::string& f = node->field;
  const int n_in = s.inputs_size(), n_out = s.outputs_size();
  RETURN_IF_ERROR(Arity(f, "output", n_out, 1));
  switch (s.op_case()) {
    case GraphSpec::Node::kBinary: {
      node->kind = NodeKind::kBinary;
      ASSIGN_OR_RETURN(node->binary_op, BinaryOpOf(s.binary().op(), f + ".binary.op"));
      if (s.binary().has_scalar()) {
        RETURN_IF_ERROR(CheckConstant(s.binary().scalar(), f + ".binary.scalar"));
        node->scalar = s.binary().scalar();
        node->scalar_first = s.binary().scalar_first();
        return Arity(f, "input (binary with a scalar)", n_in, 1);
      }
      if (s.binary().scalar_first()) {
        return Invalid(f + ".binary.scalar_first", "set without a scalar");
      }
      return Arity(f, "inputs (binary)", n_in, 2);
    }
    case GraphSpec::Node::kUnary: {
      node->kind = NodeKind::kUnary;
      ASSIGN_OR_RETURN(node->unary_op, UnaryOpOf(s.unary().op(), f + ".unary.op"));
      return Arity(f, "input", n_in, 1);
    }
    case GraphSpec::Node::kWhere: {
      node->kind = NodeKind::kWhere;
      const GraphSpec::Where& w = s.where();
      if (w.has_x_scalar()) {
        RETURN_IF_ERROR(CheckConstant(w.x_scalar(), f + ".where.x_scalar"));
        node->where_x = w.x_scalar();
      }
      if (w.has_y_scalar()) {
        RETURN_IF_ERROR(CheckConstant(w.y_scalar(), f + ".where.y_scalar"));
        node->where_y = w.y_scalar();
      }
      const int want = 3 - (w.has_x_scalar() ? 1 : 0) - (w.has_y_scalar() ? 1 : 0);
      return Arity(f, "inputs (where: condition, then x and y unless constants)", n_in, want);
    }
    case GraphSpec::Node::kReduce: {
      node->kind = NodeKind::kReduce;
      ASSIGN_OR_RETURN(node->reduce_op, ReduceOpOf(s.reduce().op(), f + ".reduce.op"));
      node->axes.assign(s.reduce().axes().begin(), s.reduce().axes().end());
      node->keepdims = s.reduce().keepdims();
      return Arity(f, "input", n_in, 1);
    }
    case GraphSpec::Node::kEinsum: {
      node->kind = NodeKind::kEinsum;
      RETURN_IF_ERROR(ParseEinsum(s.einsum().equation(), f + ".einsum.equation", &node->einsum));
      switch (s.einsum().precision()) {
        case te::v1::PRECISION_DEFAULT: node->tf32 = true; break;
        case te::v1::PRECISION_HIGHEST: node->tf32 = false; break;
        default:
          return Invalid(
              f + ".einsum.precision",
              absl::StrCat(static_cast<int>(s.einsum().precision()), " is not DEFAULT or HIGHEST"));
      }
      return Arity(f, "inputs (einsum)", n_in, 2);
    }
    case GraphSpec::Node::kSlice: {
      node->kind = NodeKind::kSlice;
      const GraphSpec::Slice& sl = s.slice();
      node->start.assign(sl.start().begin(), sl.start().end());
      node->limit.assign(sl.limit().begin(), sl.limit().end());
      node->stride.assign(sl.stride().begin(), sl.stride().end());
      for (size_t d = 0; d < node->stride.size(); ++d) {
        if (node->stride[d] < 1) {
          return Invalid(absl::StrCat(f, ".slice.stride[", d, "]"),
                         absl::StrCat(node->stride[d], "; want a positive step"));
        }
      }
      return Arity(f, "input", n_in, 1);
    }
    case GraphSpec::Node::kSoftmax:
      node->kind = NodeKind::kSoftmax;
      node->axis = s.softmax().axis();
      node->log = s.softmax().log();
      return Arity(f, "input", n_in, 1);
    case GraphSpec::Node::kParam:
      node->kind = NodeKind::kParam;
      RETURN_IF_ERROR(ParseParam(s.param(), f + ".param", node));
      return Arity(f, "inputs (param)", n_in, 0);
    case GraphSpec::Node::kModule:  // ParseGlue and InputsAndOp take these
    case GraphSpec::Node::kReshape:
    case GraphSpec::Node::kSplit:
    case GraphSpec::Node::kConcatenate:
    case GraphSpec::Node::kAdd:
    case GraphSpec::Node::kScale:
    case GraphSpec::Node::kCast:
    case GraphSpec::Node::kTranspose:
    case GraphSpec::Node::kDropout:
    case GraphSpec::Node::kCausalMask:
    case GraphSpec::Node::kSoftmaxCrossEntropy:
    case GraphSpec::Node::kAttend:
    case GraphSpec::Node::OP_NOT_SET:
      break;
  }
  return absl::InternalError(absl::StrCat(f, ": not a jax.numpy node"));
}

}  // namespace te::layers::graph
