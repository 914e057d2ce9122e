#include "client/reference_chain.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "client/recipe.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te::client {
namespace {

absl::Status ExpectOne(const Tensors& tensors, const std::string& where) {
  if (tensors.size() != 1) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": expects one tensor, has ", tensors.size()));
  }
  return absl::OkStatus();
}

// "params/kernel" of stage "qkv" -> "params/qkv/kernel".
std::string Scoped(const std::string& name, const std::string& key) {
  const size_t slash = key.find('/');
  if (slash == std::string::npos) return absl::StrCat(name, "/", key);
  return absl::StrCat(key.substr(0, slash), "/", name, "/", key.substr(slash + 1));
}

}  // namespace

HostStep ReshapeTrailing(Shape from, Shape to) {
  // Replaces `from` trailing dims by `to`; shared by forward and backward.
  auto reshape = [](const Tensors& in, const Shape& old_tail, const Shape& new_tail) -> absl::StatusOr<Tensors> {
    RETURN_IF_ERROR(ExpectOne(in, "ReshapeTrailing"));
    const Shape& shape = in[0].shape();
    if (shape.size() < old_tail.size() || !std::equal(old_tail.begin(), old_tail.end(), shape.end() - old_tail.size())) {
      return absl::InvalidArgumentError(absl::StrCat("ReshapeTrailing: ", in[0].DebugString(), " does not end in ",
                                                     ShapeString(old_tail)));
    }
    Shape out(shape.begin(), shape.end() - old_tail.size());
    out.insert(out.end(), new_tail.begin(), new_tail.end());
    ASSIGN_OR_RETURN(HostTensor t, in[0].Reshaped(out));
    return Tensors{std::move(t)};
  };
  return HostStep{
      [=](const Tensors& in) { return reshape(in, from, to); },
      [=](const Tensors& grads) { return reshape(grads, to, from); },
  };
}

HostStep SplitLastAxisStep(int parts) {
  return HostStep{
      [parts](const Tensors& in) -> absl::StatusOr<Tensors> {
        RETURN_IF_ERROR(ExpectOne(in, "SplitLastAxisStep"));
        return SplitLastAxis(in[0], parts);
      },
      [parts](const Tensors& grads) -> absl::StatusOr<Tensors> {
        if (static_cast<int>(grads.size()) != parts) {
          return absl::InvalidArgumentError(
              absl::StrCat("SplitLastAxisStep backward: ", grads.size(), " gradients for ", parts, " parts"));
        }
        ASSIGN_OR_RETURN(HostTensor joined, ConcatLastAxis(grads));
        return Tensors{std::move(joined)};
      },
  };
}

ReferenceChain& ReferenceChain::Add(std::string name, std::shared_ptr<const Module> module, bool pass_attention_mask) {
  stages_.push_back(Stage{Kind::kModule, std::move(name), std::move(module), pass_attention_mask, {}});
  return *this;
}

ReferenceChain& ReferenceChain::AddHost(std::string name, HostStep step) {
  stages_.push_back(Stage{Kind::kHost, std::move(name), nullptr, false, std::move(step)});
  return *this;
}

ReferenceChain& ReferenceChain::Fork() {
  stages_.push_back(Stage{Kind::kFork, "fork", nullptr, false, {}});
  return *this;
}

ReferenceChain& ReferenceChain::Join() {
  stages_.push_back(Stage{Kind::kJoin, "join", nullptr, false, {}});
  return *this;
}

absl::StatusOr<HostTensor> ReferenceChain::Run(Session* session, uint64_t key, const ReferenceChainVariables* vars,
                                           const HostTensor& x, const ApplyOptions& options,
                                           ReferenceChainVariables* inited,
                                           std::vector<std::string>* forward_ids) const {
  Tensors current = {x};
  std::vector<HostTensor> residuals;
  for (size_t i = 0; i < stages_.size(); ++i) {
    const Stage& stage = stages_[i];
    switch (stage.kind) {
      case Kind::kModule: {
        if (current.empty()) return absl::InvalidArgumentError(absl::StrCat(stage.name, ": no input"));
        ApplyOptions stage_options;
        stage_options.deterministic = options.deterministic;
        if (options.dropout_seed.has_value()) stage_options.dropout_seed = DeriveSeed(*options.dropout_seed, stage.name);
        stage_options.extra_inputs.assign(current.begin() + 1, current.end());
        if (stage.pass_attention_mask) stage_options.attention_mask = options.attention_mask;
        stage_options.keep_outputs = options.keep_outputs;
        stage_options.update_fp8_metas = options.update_fp8_metas;
        const Variables* stage_vars;
        if (vars == nullptr) {
          absl::StatusOr<Variables> created = stage.module->Init(*session, DeriveSeed(key, stage.name), current[0]);
          if (!created.ok()) {
            return absl::Status(created.status().code(),
                                absl::StrCat(stage.name, " (", stage.module->type_name(), "): ",
                                             created.status().message()));
          }
          for (const VariableInfo& v : created->variables) {
            inited->variables.push_back(VariableInfo{v.collection, absl::StrCat(stage.name, "/", v.path), v.shape, v.dtype});
          }
          inited->stages[i] = *std::move(created);
          stage_vars = &inited->stages[i];
        } else {
          stage_vars = &vars->stages[i];
        }
        absl::StatusOr<ForwardResult> forwarded;
        if (vars == nullptr) {
          // Init runs the chain only to learn each stage's input shape, which
          // FP8 does not change: without autocast, so that init leaves the
          // FP8 state as a single module's init does (no step recorded).
          Autocast shapes_only(false);
          forwarded = stage.module->Forward(*stage_vars, current[0], stage_options, false);
        } else {
          forwarded = stage.module->Forward(*stage_vars, current[0], stage_options, forward_ids != nullptr);
        }
        ASSIGN_OR_RETURN(ForwardResult result, std::move(forwarded));
        if (forward_ids != nullptr) (*forward_ids)[i] = result.forward_id;
        current = {std::move(result.y)};
        break;
      }
      case Kind::kHost: {
        ASSIGN_OR_RETURN(current, stage.step.forward(current));
        break;
      }
      case Kind::kFork: {
        RETURN_IF_ERROR(ExpectOne(current, "Fork"));
        residuals.push_back(current[0]);
        break;
      }
      case Kind::kJoin: {
        RETURN_IF_ERROR(ExpectOne(current, "Join"));
        if (residuals.empty()) return absl::FailedPreconditionError("Join without a Fork");
        ASSIGN_OR_RETURN(current[0], client::Add(current[0], residuals.back()));
        residuals.pop_back();
        break;
      }
    }
  }
  RETURN_IF_ERROR(ExpectOne(current, "ReferenceChain output"));
  return std::move(current[0]);
}

absl::StatusOr<ReferenceChainVariables> ReferenceChain::Init(Session& session, uint64_t key, const HostTensor& x) const {
  ReferenceChainVariables vars;
  vars.stages.resize(stages_.size());
  ApplyOptions options;  // deterministic, as flax's init is called in the quickstart's apply
  RETURN_IF_ERROR(Run(&session, key, nullptr, x, options, &vars, nullptr).status());
  return vars;
}

absl::StatusOr<HostTensor> ReferenceChain::Apply(const ReferenceChainVariables& vars, const HostTensor& x,
                                             const ApplyOptions& options) const {
  if (vars.stages.size() != stages_.size()) {
    return absl::InvalidArgumentError("vars: initialised by another ReferenceChain (stage count differs)");
  }
  return Run(nullptr, 0, &vars, x, options, nullptr, nullptr);
}

absl::StatusOr<ValueAndGradResult> ReferenceChain::ValueAndGrad(const ReferenceChainVariables& vars, const HostTensor& x,
                                                            const HostTensor& dy, const ApplyOptions& options,
                                                            bool return_grads) const {
  if (vars.stages.size() != stages_.size()) {
    return absl::InvalidArgumentError("vars: initialised by another ReferenceChain (stage count differs)");
  }
  std::vector<std::string> forward_ids(stages_.size());
  ASSIGN_OR_RETURN(HostTensor y, Run(nullptr, 0, &vars, x, options, nullptr, &forward_ids));
  ValueAndGradResult result;
  ASSIGN_OR_RETURN(result.value, Vdot(y, dy));

  Tensors grads = {dy};
  std::vector<HostTensor> residual_grads;
  for (size_t i = stages_.size(); i-- > 0;) {
    const Stage& stage = stages_[i];
    switch (stage.kind) {
      case Kind::kModule: {
        RETURN_IF_ERROR(ExpectOne(grads, stage.name));
        ASSIGN_OR_RETURN(BackwardResult back, Backward(*vars.stages[i].session, forward_ids[i], grads[0],
                                                            /*keep_grads=*/!return_grads, &vars.stages[i]));
        grads = {std::move(back.dx)};
        for (HostTensor& g : back.extra_input_grads) grads.push_back(std::move(g));
        for (auto& [name, g] : back.grads) result.grads[Scoped(stage.name, name)] = std::move(g);
        break;
      }
      case Kind::kHost: {
        ASSIGN_OR_RETURN(grads, stage.step.backward(grads));
        break;
      }
      case Kind::kJoin: {  // y = f + res: the residual's gradient is dy itself
        RETURN_IF_ERROR(ExpectOne(grads, "Join backward"));
        residual_grads.push_back(grads[0]);
        break;
      }
      case Kind::kFork: {  // x fed both paths: its gradient is the sum
        RETURN_IF_ERROR(ExpectOne(grads, "Fork backward"));
        if (residual_grads.empty()) return absl::FailedPreconditionError("Fork without a Join");
        ASSIGN_OR_RETURN(grads[0], client::Add(grads[0], residual_grads.back()));
        residual_grads.pop_back();
        break;
      }
    }
  }
  RETURN_IF_ERROR(ExpectOne(grads, "ReferenceChain input gradient"));
  result.dx = std::move(grads[0]);
  return result;
}

// ---- the quickstart's sections as chains ----------------------------------------------

namespace {

// The attention block after the qkv projection, as the quickstart's graphs
// build it (no dropout node: see the header).
void AddChainAttention(const LayerSize& c, const std::string& out_projection, ReferenceChain* layer) {
  const int64_t kv = c.hidden / c.heads;
  layer->AddHost("qkv_reshape", ReshapeTrailing({3 * c.hidden}, {c.heads, 3 * kv}));
  layer->AddHost("qkv_split", SplitLastAxisStep(3));
  layer->Add("DotProductAttention_0", std::make_shared<DotProductAttention>(TeAttention(c)));
  layer->AddHost("heads_merge", ReshapeTrailing({c.heads, kv}, {c.hidden}));
  layer->Add(out_projection, std::make_shared<DenseGeneral>(TeDense(c.hidden)));
}

}  // namespace

ReferenceChain UnfusedChain(const LayerSize& c) {
  ReferenceChain layer;
  layer.Fork();
  layer.Add("LayerNorm_0", std::make_shared<LayerNorm>(TeNorm()));
  layer.Add("DenseGeneral_0", std::make_shared<DenseGeneral>(TeDense(3 * c.hidden)));
  AddChainAttention(c, "DenseGeneral_1", &layer);
  layer.Join();
  layer.Fork();
  layer.Add("LayerNorm_1", std::make_shared<LayerNorm>(TeNorm()));
  layer.Add("TEUnfusedMLP_0/DenseGeneral_0", std::make_shared<DenseGeneral>(TeDense(c.ffn)));
  layer.Add("TEUnfusedMLP_0/activation_0", std::make_shared<Activation>());
  layer.Add("TEUnfusedMLP_0/DenseGeneral_1", std::make_shared<DenseGeneral>(TeDense(c.hidden)));
  layer.Join();
  return layer;
}

ReferenceChain FusedChain(const LayerSize& c) {
  ReferenceChain layer;
  layer.Fork();
  layer.Add("LayerNormDenseGeneral_0", std::make_shared<LayerNormDenseGeneral>(FusedQkv(c)));
  AddChainAttention(c, "DenseGeneral_0", &layer);
  layer.Join();
  layer.Fork();
  layer.Add("LayerNormMLP_0", std::make_shared<LayerNormMLP>(FusedMlp(c)));
  layer.Join();
  return layer;
}

}  // namespace te::client
