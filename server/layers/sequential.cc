#include "server/layers/sequential.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"
#include "server/layers/attention_core.h"

namespace te::layers {
namespace {

struct Stage {
  enum class Kind { kModule, kReshape, kSplit, kFork, kJoin };
  Kind kind = Kind::kModule;
  std::string name;
  std::unique_ptr<Layer> module;
  bool pass_attention_mask = false;
  Shape from, to;  // kReshape
  int parts = 0;   // kSplit
};

// "params/kernel" of stage "qkv" -> "params/qkv/kernel" (the clients' naming).
std::string Scoped(const std::string& stage, const std::string& key) {
  const size_t slash = key.find('/');
  if (slash == std::string::npos) return absl::StrCat(stage, "/", key);
  return absl::StrCat(key.substr(0, slash), "/", stage, "/", key.substr(slash + 1));
}

// The stage's variables as its module names them ("params/kernel"): handles
// to the same device memory, so what the module writes in place (amax
// histories) lands in the layer's variables; WriteBack stores replacements.
Variables StageView(const Variables& vars, const std::string& stage) {
  Variables view;
  for (const auto& [key, tensor] : vars) {
    const size_t slash = key.find('/');
    if (slash == std::string::npos) continue;
    const std::string prefix = absl::StrCat(stage, "/");
    if (key.compare(slash + 1, prefix.size(), prefix) != 0) continue;
    view[key.substr(0, slash + 1) + key.substr(slash + 1 + prefix.size())] = tensor;
  }
  return view;
}

void WriteBack(const Variables& view, const std::string& stage, Variables* vars) {
  for (const auto& [key, tensor] : view) (*vars)[Scoped(stage, key)] = tensor;
}

// `shape` with its trailing `from` dims replaced by `to`.
absl::StatusOr<Shape> ReplaceTrailing(const Shape& shape, const Shape& from, const Shape& to,
                                      const std::string& where) {
  if (shape.size() < from.size() || !std::equal(from.begin(), from.end(), shape.end() - from.size())) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": the tensor ", ShapeString(shape),
                                                   " does not end in ", ShapeString(from)));
  }
  Shape out(shape.begin(), shape.end() - from.size());
  out.insert(out.end(), to.begin(), to.end());
  return out;
}

absl::Status ExpectOne(size_t count, const std::string& where) {
  if (count == 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(where, ": takes one tensor, and the chain has ", count, " here"));
}

struct SequentialSaved : SavedForward {
  std::vector<std::unique_ptr<SavedForward>> modules;  // per stage; null for glue
  std::vector<Shape> split_inputs;                     // per stage: a split's input shape
  int64_t bytes() const override {
    int64_t total = 0;
    for (const auto& m : modules) total += m != nullptr ? m->bytes() : 0;
    return total;
  }
};

class SequentialLayer : public Layer {
 public:
  explicit SequentialLayer(std::vector<Stage> stages) : stages_(std::move(stages)) {}

  std::string type_name() const override { return "Sequential"; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe* fp8) const override {
    std::vector<VariableSpec> specs;
    RETURN_IF_ERROR(WalkShapes(input_shape, [&](size_t i, const Shape& x) -> absl::Status {
                      ASSIGN_OR_RETURN(std::vector<VariableSpec> own,
                                       stages_[i].module->VariableSpecs(x, fp8));
                      for (VariableSpec& v : own) {
                        v.name = Scoped(stages_[i].name, v.name);
                        specs.push_back(std::move(v));
                      }
                      return absl::OkStatus();
                    }).status());
    return specs;
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    return WalkShapes(input_shape, nullptr);
  }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    return WalkShapes(input_shape, [&](size_t i, const Shape& x) -> absl::Status {
             Variables own;
             RETURN_IF_ERROR(stages_[i].module->Init(ops, StageSeed(seed, i), x, fp8, &own));
             WriteBack(own, stages_[i].name, vars);
             return absl::OkStatus();
           })
        .status();
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    auto kept = std::make_unique<SequentialSaved>();
    kept->modules.resize(stages_.size());
    kept->split_inputs.resize(stages_.size());
    std::vector<Tensor> current = {in.x};
    current.insert(current.end(), in.extra.begin(), in.extra.end());
    std::vector<Tensor> residuals;
    for (size_t i = 0; i < stages_.size(); ++i) {
      RETURN_IF_ERROR(ops.CheckInterrupt());
      const Stage& stage = stages_[i];
      const std::string where = absl::StrCat("stage ", i, " (", stage.name, ")");
      switch (stage.kind) {
        case Stage::Kind::kModule: {
          LayerInputs stage_in;
          stage_in.x = current[0];
          stage_in.extra.assign(current.begin() + 1, current.end());
          if (stage.pass_attention_mask) {
            stage_in.q_seqlens = in.q_seqlens;
            stage_in.kv_seqlens = in.kv_seqlens;
          }
          ForwardOptions stage_opts = opts;
          stage_opts.dropout_seed = StageSeed(opts.dropout_seed, i);
          Variables view = StageView(*vars, stage.name);
          LayerOutputs stage_out;
          const absl::Status status = stage.module->Forward(
              ops, &view, stage_in, stage_opts, &stage_out, &kept->modules[i]);
          if (!status.ok()) {
            return absl::Status(status.code(), absl::StrCat(where, ": ", status.message()));
          }
          WriteBack(view, stage.name, vars);
          current = {stage_out.y};
          break;
        }
        case Stage::Kind::kReshape: {
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          ASSIGN_OR_RETURN(const Shape shape,
                           ReplaceTrailing(current[0].shape(), stage.from, stage.to, where));
          current[0] = current[0].Reshaped(shape);
          break;
        }
        case Stage::Kind::kSplit: {
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          const Shape& shape = current[0].shape();
          if (shape.empty() || shape.back() % stage.parts != 0) {
            return absl::InvalidArgumentError(absl::StrCat(
                where, ": the last axis of ", ShapeString(shape), " does not split in ", stage.parts));
          }
          kept->split_inputs[i] = shape;
          ASSIGN_OR_RETURN(const Shape parted, ReplaceTrailing(shape, {shape.back()},
                                                               {stage.parts, shape.back() / stage.parts},
                                                               where));
          ASSIGN_OR_RETURN(current, SplitAxis(ops, current[0].Reshaped(parted),
                                              static_cast<int>(parted.size()) - 2));
          break;
        }
        case Stage::Kind::kFork:
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          residuals.push_back(current[0]);
          break;
        case Stage::Kind::kJoin: {
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          ASSIGN_OR_RETURN(Tensor sum, Add(ops, current[0], residuals.back(), where));
          residuals.pop_back();
          current[0] = sum;
          break;
        }
      }
    }
    RETURN_IF_ERROR(ExpectOne(current.size(), "the chain's output"));
    out->y = current[0];
    if (opts.keep_for_backward) *saved = std::move(kept);
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    const auto* kept = dynamic_cast<const SequentialSaved*>(&saved);
    if (kept == nullptr || kept->modules.size() != stages_.size()) {
      return absl::InternalError("Sequential: the saved forward is not this layer's");
    }
    std::vector<Tensor> current = {dy};
    std::vector<Tensor> residual_grads;
    for (size_t i = stages_.size(); i-- > 0;) {
      RETURN_IF_ERROR(ops.CheckInterrupt());
      const Stage& stage = stages_[i];
      const std::string where = absl::StrCat("stage ", i, " (", stage.name, ") backward");
      switch (stage.kind) {
        case Stage::Kind::kModule: {
          Variables view = StageView(*vars, stage.name);
          LayerGrads own;
          const absl::Status status =
              stage.module->Backward(ops, &view, *kept->modules[i], current[0], &own);
          if (!status.ok()) {
            return absl::Status(status.code(), absl::StrCat(where, ": ", status.message()));
          }
          WriteBack(view, stage.name, vars);
          current = {own.dx};
          current.insert(current.end(), own.dextra.begin(), own.dextra.end());
          for (const auto& [key, g] : own.params) grads->params[Scoped(stage.name, key)] = g;
          break;
        }
        case Stage::Kind::kReshape: {
          ASSIGN_OR_RETURN(const Shape shape,
                           ReplaceTrailing(current[0].shape(), stage.to, stage.from, where));
          current[0] = current[0].Reshaped(shape);
          break;
        }
        case Stage::Kind::kSplit: {
          if (static_cast<int>(current.size()) != stage.parts) {
            return absl::InternalError(
                absl::StrCat(where, ": ", current.size(), " gradients for ", stage.parts, " parts"));
          }
          const Shape& input = kept->split_inputs[i];
          ASSIGN_OR_RETURN(Tensor stacked,
                           StackAxis(ops, current, static_cast<int>(input.size()) - 1));
          current = {stacked.Reshaped(input)};
          break;
        }
        case Stage::Kind::kJoin:  // y = f + res: the residual's gradient is dy itself
          residual_grads.push_back(current[0]);
          break;
        case Stage::Kind::kFork: {  // x fed both paths: its gradient is the sum
          ASSIGN_OR_RETURN(Tensor sum, Add(ops, current[0], residual_grads.back(), where));
          residual_grads.pop_back();
          current[0] = sum;
          break;
        }
      }
    }
    grads->dx = current[0];
    grads->dextra.assign(current.begin() + 1, current.end());
    return absl::OkStatus();
  }

 private:
  // a + b in a's dtype (b cast first if it differs).
  static absl::StatusOr<Tensor> Add(Ops& ops, const Tensor& a, const Tensor& b,
                                    const std::string& where) {
    if (a.shape() != b.shape()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": adds ", ShapeString(a.shape()),
                                                     " and ", ShapeString(b.shape())));
    }
    Tensor other = b;
    if (b.dtype() != a.dtype()) {
      ASSIGN_OR_RETURN(other, ops.Allocate(a.dtype(), b.shape()));
      RETURN_IF_ERROR(ops.Cast(b, &other));
    }
    ASSIGN_OR_RETURN(Tensor sum, ops.Allocate(a.dtype(), a.shape()));
    RETURN_IF_ERROR(ops.Axpby(1.0f, a, 1.0f, other, &sum));
    return sum;
  }

  // The chain on shapes alone: each module stage's input shape goes to
  // `on_module` (may be null); returns the output shape. A module's extra
  // inputs keep the shapes the chain gives them; its output is OutputShape(x).
  absl::StatusOr<Shape> WalkShapes(
      const Shape& input, const std::function<absl::Status(size_t, const Shape&)>& on_module) const {
    std::vector<Shape> current = {input};
    std::vector<Shape> residuals;
    for (size_t i = 0; i < stages_.size(); ++i) {
      const Stage& stage = stages_[i];
      const std::string where = absl::StrCat("input_shape: stage ", i, " (", stage.name, ")");
      switch (stage.kind) {
        case Stage::Kind::kModule: {
          if (on_module != nullptr) RETURN_IF_ERROR(on_module(i, current[0]));
          absl::StatusOr<Shape> y = stage.module->OutputShape(current[0]);
          if (!y.ok()) return absl::Status(y.status().code(), absl::StrCat(where, ": ", y.status().message()));
          current = {*y};
          break;
        }
        case Stage::Kind::kReshape: {
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          ASSIGN_OR_RETURN(current[0], ReplaceTrailing(current[0], stage.from, stage.to, where));
          break;
        }
        case Stage::Kind::kSplit: {
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          Shape part = current[0];
          if (part.empty() || part.back() % stage.parts != 0) {
            return absl::InvalidArgumentError(absl::StrCat(
                where, ": the last axis of ", ShapeString(part), " does not split in ", stage.parts));
          }
          part.back() /= stage.parts;
          current.assign(stage.parts, part);
          break;
        }
        case Stage::Kind::kFork:
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          residuals.push_back(current[0]);
          break;
        case Stage::Kind::kJoin:
          RETURN_IF_ERROR(ExpectOne(current.size(), where));
          if (current[0] != residuals.back()) {
            return absl::InvalidArgumentError(absl::StrCat(where, ": adds ", ShapeString(current[0]),
                                                           " and the residual ",
                                                           ShapeString(residuals.back())));
          }
          residuals.pop_back();
          break;
      }
    }
    RETURN_IF_ERROR(ExpectOne(current.size(), "input_shape: the chain's output"));
    return current[0];
  }

  std::vector<Stage> stages_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeSequential(const te::v1::SequentialSpec& spec) {
  if (spec.stages().empty()) {
    return absl::InvalidArgumentError("spec.sequential.stages: empty");
  }
  std::vector<Stage> stages;
  std::set<std::string> names;
  int open_forks = 0;
  for (int i = 0; i < spec.stages_size(); ++i) {
    const te::v1::SequentialSpec::Stage& s = spec.stages(i);
    const std::string field = absl::StrCat("spec.sequential.stages[", i, "]");
    Stage stage;
    stage.name = s.name();
    stage.pass_attention_mask = s.pass_attention_mask();
    switch (s.kind_case()) {
      case te::v1::SequentialSpec::Stage::kModule: {
        stage.kind = Stage::Kind::kModule;
        if (s.name().empty() || !names.insert(s.name()).second) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ".name: a module stage needs a name unique among the stages; got \"", s.name(),
              "\""));
        }
        if (s.module().module_case() == te::v1::LayerSpec::kSequential) {
          return absl::InvalidArgumentError(absl::StrCat(field, ".module: a Sequential inside a Sequential"));
        }
        absl::StatusOr<std::unique_ptr<Layer>> module = CreateLayer(s.module());
        if (!module.ok()) {
          return absl::Status(module.status().code(),
                              absl::StrCat(field, ".module: ", module.status().message()));
        }
        stage.module = *std::move(module);
        break;
      }
      case te::v1::SequentialSpec::Stage::kReshape: {
        stage.kind = Stage::Kind::kReshape;
        stage.from.assign(s.reshape().from().begin(), s.reshape().from().end());
        stage.to.assign(s.reshape().to().begin(), s.reshape().to().end());
        const bool positive =
            std::all_of(stage.from.begin(), stage.from.end(), [](int64_t d) { return d > 0; }) &&
            std::all_of(stage.to.begin(), stage.to.end(), [](int64_t d) { return d > 0; });
        // Overflow-checked: two products that wrap alike would pass as equal.
        const std::optional<int64_t> from_n = CheckedNumElements(stage.from);
        const std::optional<int64_t> to_n = CheckedNumElements(stage.to);
        if (stage.from.empty() || stage.to.empty() || !positive || !from_n || !to_n ||
            *from_n != *to_n) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ".reshape: from ", ShapeString(stage.from), " and to ", ShapeString(stage.to),
              " must be non-empty, positive and of one element count (under 2^63)"));
        }
        break;
      }
      case te::v1::SequentialSpec::Stage::kSplitLastAxis:
        stage.kind = Stage::Kind::kSplit;
        stage.parts = s.split_last_axis();
        if (stage.parts < 2) {
          return absl::InvalidArgumentError(
              absl::StrCat(field, ".split_last_axis: ", stage.parts, " parts; want 2 or more"));
        }
        break;
      case te::v1::SequentialSpec::Stage::kResidual:
        if (s.residual() == te::v1::SequentialSpec::FORK) {
          stage.kind = Stage::Kind::kFork;
          ++open_forks;
        } else if (s.residual() == te::v1::SequentialSpec::JOIN) {
          stage.kind = Stage::Kind::kJoin;
          if (open_forks == 0) {
            return absl::InvalidArgumentError(absl::StrCat(field, ".residual: JOIN without a FORK"));
          }
          --open_forks;
        } else {
          return absl::InvalidArgumentError(absl::StrCat(field, ".residual: FORK or JOIN"));
        }
        break;
      case te::v1::SequentialSpec::Stage::KIND_NOT_SET:
        return absl::InvalidArgumentError(
            absl::StrCat(field, ": no kind set (module, reshape, split_last_axis or residual)"));
    }
    stages.push_back(std::move(stage));
  }
  if (open_forks != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.sequential.stages: ", open_forks, " FORK(s) without a JOIN"));
  }
  return std::make_unique<SequentialLayer>(std::move(stages));
}

}  // namespace te::layers
