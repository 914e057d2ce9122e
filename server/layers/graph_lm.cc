// The graph's language-model nodes: optax's softmax cross entropy with
// integer labels (the loss a graph may end in) and nn.Embed.attend (the
// output projection tied to an Embed node's embedding). Both keep what
// their backward needs in an LmSaved; ops.h has the math.
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/flax_embed.h"
#include "server/layers/graph_internal.h"

namespace te::layers::graph {

int64_t LmSaved::bytes() const {
  int64_t total = 0;
  for (const Tensor* t : {&logits, &labels, &lse, &x, &embedding}) {
    if (t->defined()) total += static_cast<int64_t>(t->nbytes());
  }
  return total;
}

absl::Status LossForward(Ops& ops, const Tensor& logits, const Tensor& labels, Tensor* loss,
                         LmSaved* saved) {
  const int64_t vocab = logits.dim(-1);
  const int64_t rows = logits.numel() / vocab;
  saved->logits = logits.Reshaped({rows, vocab});
  saved->labels = labels.Reshaped({rows});
  ASSIGN_OR_RETURN(saved->lse, ops.Allocate(DType::kF32, {rows}));
  ASSIGN_OR_RETURN(Tensor out, ops.Allocate(DType::kF32, {1}));
  RETURN_IF_ERROR(ops.SoftmaxCrossEntropyForward(saved->logits, saved->labels, &out, &saved->lse));
  *loss = out.Reshaped({});
  return absl::OkStatus();
}

absl::Status LossBackward(Ops& ops, const LmSaved& saved, const Tensor& dloss,
                          std::vector<Tensor>* din) {
  din->assign(2, Tensor());
  if (!dloss.defined()) return absl::OkStatus();
  ASSIGN_OR_RETURN(Tensor g, CastTo(ops, dloss, DType::kF32));
  ASSIGN_OR_RETURN(Tensor dlogits, ops.Allocate(saved.logits.dtype(), saved.logits.shape()));
  RETURN_IF_ERROR(ops.SoftmaxCrossEntropyBackward(saved.logits, saved.labels, saved.lse,
                                                  g.Reshaped({1}), &dlogits));
  (*din)[0] = std::move(dlogits);
  return absl::OkStatus();
}

absl::Status AttendNodeForward(Ops& ops, const Node& node, const Tensor& embedding,
                               const Tensor& x, Tensor* y, LmSaved* saved) {
  AttendSaved kept;
  RETURN_IF_ERROR(AttendForward(ops, embedding, node.attend_dtype, x, y, &kept));
  saved->x = kept.x;
  saved->embedding = kept.embedding;
  saved->x_dtype = kept.x_dtype;
  return absl::OkStatus();
}

absl::Status AttendNodeBackward(Ops& ops, const Node& node, const LmSaved& saved,
                                const Tensor& dy, std::vector<Tensor>* din, Tensor* dembedding) {
  din->assign(1, Tensor());
  AttendSaved kept;
  kept.x = saved.x;
  kept.embedding = saved.embedding;
  kept.x_dtype = saved.x_dtype;
  return AttendBackward(ops, kept, node.param_dtype, dy, &(*din)[0], dembedding);
}

}  // namespace te::layers::graph
