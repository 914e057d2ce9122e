// jnp.einsum(equation, a, b) for the contractions a batched GEMM covers.
// Each index is one of: batch (in a, b and the output), M (a and the
// output), N (b and the output), K (a and b, contracted). a is permuted to
// [batch, M, K] (or taken as it is when it already lies as [batch, K, M]:
// a transposed GEMM operand), b to [batch, K, N] (or [batch, N, K]), one
// Ops::Gemm per batch element computes [M, N], and the product [batch, M, N]
// is permuted to the output's order. A permutation that is the identity is
// a view. "..." stands for the same dims in both operands (aligned from the
// right; a dim only one operand has is that operand's own).
//
// Backward, from the saved GEMM operands: dA [batch, M, K] = dC B^T and
// dB [batch, K, N] = A^T dC, each permuted back to its operand's order.
// Ops::Gemm has no batch dimension: the batch runs as that many GEMMs.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {
namespace {

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

// Labels of the "..." dims: kEllipsisBase + position, counted so that the
// dims of both operands align from the right.
constexpr int kEllipsisBase = 1000;

std::string LabelName(int l) {
  return l >= kEllipsisBase ? absl::StrCat("...[", l - kEllipsisBase, "]")
                            : std::string(1, static_cast<char>(l));
}

int Find(const std::vector<int>& labels, int l) {
  auto it = std::find(labels.begin(), labels.end(), l);
  return it == labels.end() ? -1 : static_cast<int>(it - labels.begin());
}

// One term with its "..." expanded to `width` of the `total` ellipsis dims (right-aligned).
std::vector<int> Expand(const std::vector<int>& term, int width, int total) {
  std::vector<int> out;
  for (int l : term) {
    if (l != EinsumTerms::kEllipsis) {
      out.push_back(l);
      continue;
    }
    for (int i = total - width; i < total; ++i) out.push_back(kEllipsisBase + i);
  }
  return out;
}

bool IsIdentity(const std::vector<int>& perm) {
  for (size_t i = 0; i < perm.size(); ++i) {
    if (perm[i] != static_cast<int>(i)) return false;
  }
  return true;
}

// perm with y.dim(i) = x.dim(perm[i]) taking labels `from` to labels `to`.
std::vector<int> PermBetween(const std::vector<int>& from, const std::vector<int>& to) {
  std::vector<int> perm;
  for (int l : to) perm.push_back(Find(from, l));
  return perm;
}

Shape SizesOf(const std::vector<int>& labels, const std::vector<int>& all,
              const std::vector<int64_t>& sizes) {
  Shape s;
  for (int l : labels) s.push_back(sizes[Find(all, l)]);
  return s;
}

int64_t Product(const Shape& s, size_t begin, size_t end) {
  int64_t p = 1;
  for (size_t i = begin; i < end; ++i) p *= s[i];
  return p;
}

// x permuted by `perm` (empty or the identity: x itself, a view).
absl::StatusOr<Tensor> Permuted(Ops& ops, const Tensor& x, const std::vector<int>& perm) {
  if (perm.empty() || IsIdentity(perm)) return x;
  Shape shape;
  for (int p : perm) shape.push_back(x.dim(p));
  ASSIGN_OR_RETURN(Tensor y, ops.Allocate(x.dtype(), shape));
  RETURN_IF_ERROR(PermuteAnyRank(ops, x, perm, &y));
  return y;
}

std::vector<int> Inverse(const std::vector<int>& perm) {
  std::vector<int> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int>(i);
  return inv;
}

// c [batch, rows_c, cols_c] = op(a) op(b) for each batch element.
absl::Status BatchedGemm(Ops& ops, bool tf32, int64_t batch, const Tensor& a, bool transpose_a,
                         const Tensor& b, bool transpose_b, Tensor* c) {
  if (c->numel() == 0) return absl::OkStatus();
  if (a.numel() == 0) return ops.Fill(0.0f, c);  // K = 0: an empty sum
  const Shape sa = {a.dim(1), a.dim(2)}, sb = {b.dim(1), b.dim(2)}, sc = {c->dim(1), c->dim(2)};
  for (int64_t i = 0; i < batch; ++i) {
    Ops::GemmArgs args;
    args.a = a.Slice0(i, i + 1).Reshaped(sa);
    args.transpose_a = transpose_a;
    args.b = b.Slice0(i, i + 1).Reshaped(sb);
    args.transpose_b = transpose_b;
    args.tf32 = tf32;
    Tensor out = c->Slice0(i, i + 1).Reshaped(sc);
    RETURN_IF_ERROR(ops.Gemm(args, &out));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status InferEinsum(const Node& node, const TensorInfo& a, const TensorInfo& b,
                         TensorInfo* out, NodePlan* plan) {
  *out = TensorInfo{false, {}, a.dtype ? a.dtype : b.dtype};
  if (!a.known || !b.known) return absl::OkStatus();
  const std::string where = node.field + ".einsum.equation";
  const EinsumTerms& t = node.einsum;
  int width[2];
  const TensorInfo* operands[2] = {&a, &b};
  const std::vector<int>* terms[2] = {&t.a, &t.b};
  for (int o = 0; o < 2; ++o) {
    const int rank = static_cast<int>(operands[o]->shape.size());
    const bool ellipsis = Find(*terms[o], EinsumTerms::kEllipsis) >= 0;
    const int letters = static_cast<int>(terms[o]->size()) - (ellipsis ? 1 : 0);
    width[o] = rank - letters;
    if (width[o] < 0 || (!ellipsis && width[o] != 0)) {
      return Invalid(where, absl::StrCat("operand ", o, " ", ShapeString(operands[o]->shape),
                                         " has rank ", rank, "; its term names ", letters,
                                         ellipsis ? " axes and \"...\"" : " axes"));
    }
  }
  const int total = std::max(width[0], width[1]);
  const std::vector<int> la = Expand(t.a, width[0], total), lb = Expand(t.b, width[1], total);
  const std::vector<int> lo = Expand(t.out, total, total);
  // Each label's size, agreeing between the operands.
  std::vector<int> labels;
  std::vector<int64_t> sizes;
  for (int o = 0; o < 2; ++o) {
    const std::vector<int>& l = o == 0 ? la : lb;
    for (size_t d = 0; d < l.size(); ++d) {
      const int64_t size = operands[o]->shape[d];
      const int k = Find(labels, l[d]);
      if (k < 0) {
        labels.push_back(l[d]);
        sizes.push_back(size);
      } else if (sizes[k] != size) {
        return Invalid(
            where, absl::StrCat(
                       "index ", LabelName(l[d]), " is ", sizes[k], " in operand 0 ",
                       ShapeString(a.shape), " and ", size, " in operand 1 ", ShapeString(b.shape),
                       l[d] >= kEllipsisBase ? " (\"...\" dims do not broadcast here)" : ""));
      }
    }
  }
  std::vector<int> batch, m, n, k;
  for (int l : lo) {
    const bool in_a = Find(la, l) >= 0, in_b = Find(lb, l) >= 0;
    (in_a && in_b ? batch : in_a ? m : n).push_back(l);
  }
  for (int l : la) {
    if (Find(lb, l) >= 0 && Find(lo, l) < 0) k.push_back(l);
  }
  auto cat = [](std::initializer_list<const std::vector<int>*> parts) {
    std::vector<int> all;
    for (const std::vector<int>* p : parts) all.insert(all.end(), p->begin(), p->end());
    return all;
  };
  const std::vector<int> mk = cat({&batch, &m, &k}), km = cat({&batch, &k, &m});
  const std::vector<int> kn = cat({&batch, &k, &n}), nk = cat({&batch, &n, &k});
  const std::vector<int> mn = cat({&batch, &m, &n});
  NodePlan::Einsum& e = plan->einsum;
  e = NodePlan::Einsum{};
  if (IsIdentity(PermBetween(la, km)) && !IsIdentity(PermBetween(la, mk))) {
    e.transpose_a = true;
  } else {
    e.perm_a = PermBetween(la, mk);
  }
  if (IsIdentity(PermBetween(lb, nk)) && !IsIdentity(PermBetween(lb, kn))) {
    e.transpose_b = true;
  } else {
    e.perm_b = PermBetween(lb, kn);
  }
  e.mk_dims = SizesOf(mk, labels, sizes);
  e.kn_dims = SizesOf(kn, labels, sizes);
  e.mn_dims = SizesOf(mn, labels, sizes);
  e.back_a = PermBetween(mk, la);
  e.back_b = PermBetween(kn, lb);
  e.perm_out = PermBetween(mn, lo);
  const size_t nb = batch.size();
  e.batch = Product(e.mn_dims, 0, nb);
  e.m = Product(e.mn_dims, nb, nb + m.size());
  e.n = Product(e.mn_dims, nb + m.size(), mn.size());
  e.k = Product(e.mk_dims, nb + m.size(), mk.size());
  // Every permutation the forward and backward run must fit Ops::Permute.
  const Shape la_dims = SizesOf(la, labels, sizes), lb_dims = SizesOf(lb, labels, sizes);
  for (const auto& [shape, perm] :
       {std::pair<const Shape*, const std::vector<int>*>{&la_dims, &e.perm_a},
        {&lb_dims, &e.perm_b},
        {&e.mn_dims, &e.perm_out}}) {
    if (!perm->empty() && MergedPermuteRank(*shape, *perm) > kPermuteMaxRank) {
      return Invalid(where, absl::StrCat("moves more than ", kPermuteMaxRank,
                                         " separate blocks of axes of ", ShapeString(*shape)));
    }
  }
  *out = TensorInfo{true, SizesOf(lo, labels, sizes), out->dtype};
  return absl::OkStatus();
}

absl::Status EinsumForward(Ops& ops, const Node& node, const NodePlan& plan, const Tensor& a,
                           const Tensor& b, const Shape& out_shape, Tensor* y, NumpySaved* saved) {
  const NodePlan::Einsum& e = plan.einsum;
  ASSIGN_OR_RETURN(Tensor pa, Permuted(ops, a, e.perm_a));
  ASSIGN_OR_RETURN(Tensor pb, Permuted(ops, b, e.perm_b));
  const Tensor ga =
      pa.Reshaped(e.transpose_a ? Shape{e.batch, e.k, e.m} : Shape{e.batch, e.m, e.k});
  const Tensor gb =
      pb.Reshaped(e.transpose_b ? Shape{e.batch, e.n, e.k} : Shape{e.batch, e.k, e.n});
  ASSIGN_OR_RETURN(Tensor c, ops.Allocate(a.dtype(), {e.batch, e.m, e.n}));
  RETURN_IF_ERROR(BatchedGemm(ops, node.tf32, e.batch, ga, e.transpose_a, gb, e.transpose_b, &c));
  ASSIGN_OR_RETURN(Tensor permuted, Permuted(ops, c.Reshaped(e.mn_dims), e.perm_out));
  *y = permuted.Reshaped(out_shape);
  saved->kept = {ga, gb};
  return absl::OkStatus();
}

absl::Status EinsumBackward(Ops& ops, const Node& node, const NodePlan& plan, const Plan& shapes,
                            const NumpySaved& saved, const Tensor& dy, std::vector<Tensor>* din) {
  const NodePlan::Einsum& e = plan.einsum;
  const Tensor& ga = saved.kept[0];
  const Tensor& gb = saved.kept[1];
  // dC [batch, M, N]: dy in the product's order.
  Shape out_dims;
  for (int p : e.perm_out) out_dims.push_back(e.mn_dims[p]);
  ASSIGN_OR_RETURN(Tensor dc, Permuted(ops, dy.Reshaped(out_dims), Inverse(e.perm_out)));
  dc = dc.Reshaped({e.batch, e.m, e.n});
  // dA = dC B^T: B^T is gb transposed when gb is [K, N], gb itself when [N, K].
  ASSIGN_OR_RETURN(Tensor da, ops.Allocate(ga.dtype(), {e.batch, e.m, e.k}));
  RETURN_IF_ERROR(BatchedGemm(ops, node.tf32, e.batch, dc, false, gb, !e.transpose_b, &da));
  // dB = A^T dC: A^T is ga transposed when ga is [M, K], ga itself when [K, M].
  ASSIGN_OR_RETURN(Tensor db, ops.Allocate(gb.dtype(), {e.batch, e.k, e.n}));
  RETURN_IF_ERROR(BatchedGemm(ops, node.tf32, e.batch, ga, !e.transpose_a, dc, false, &db));
  din->assign(2, Tensor());
  ASSIGN_OR_RETURN((*din)[0], Permuted(ops, da.Reshaped(e.mk_dims), e.back_a));
  ASSIGN_OR_RETURN((*din)[1], Permuted(ops, db.Reshaped(e.kn_dims), e.back_b));
  (*din)[0] = (*din)[0].Reshaped(shapes.tensors[node.inputs[0]].shape);
  (*din)[1] = (*din)[1].Reshaped(shapes.tensors[node.inputs[1]].shape);
  return absl::OkStatus();
}

}  // namespace te::layers::graph
