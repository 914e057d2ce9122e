// nn.Embed and its attend (flax_embed.h).
#include "server/layers/flax_embed.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/blocks.h"
#include "server/layers/flax_modules.h"
#include "server/layers/flax_modules_internal.h"
#include "server/layers/init.h"
#include "server/layers/module_util.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

constexpr char kEmbedding[] = "params/embedding";

struct EmbedSaved : SavedForward {
  Tensor ids;  // int32, x's shape
  int64_t bytes() const override { return static_cast<int64_t>(ids.nbytes()); }
};

class FlaxEmbed : public Layer {
 public:
  FlaxEmbed(int64_t num_embeddings, int64_t features, std::optional<DType> dtype, DType param_dtype)
      : vocab_(num_embeddings), features_(features), dtype_(dtype), param_dtype_(param_dtype) {}

  std::string type_name() const override { return "Embed"; }
  bool TakesTokenIds() const override { return true; }

  absl::StatusOr<std::vector<VariableSpec>> VariableSpecs(const Shape& input_shape,
                                                          const Fp8Recipe*) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return std::vector<VariableSpec>{{kEmbedding, {vocab_, features_}, param_dtype_}};
  }

  absl::StatusOr<Shape> OutputShape(const Shape& input_shape) const override {
    RETURN_IF_ERROR(CheckInputShape(input_shape, 1));
    return Concat(input_shape, {features_});
  }

  // Flax promotes the embedding alone (inexact=False): the ids' dtype plays no part.
  DType OutputDType(DType) const override { return dtype_.value_or(param_dtype_); }

  absl::Status Init(Ops& ops, uint64_t seed, const Shape& input_shape, const Fp8Recipe* fp8,
                    Variables* vars) const override {
    ASSIGN_OR_RETURN(std::vector<VariableSpec> specs, VariableSpecs(input_shape, fp8));
    // default_embed_init: variance_scaling(1.0, "fan_in", "normal", out_axis=0)
    // on [V, F] has fan_in = F.
    return InitVariables(ops, seed, {{specs[0], Initializer::NormalFanIn(features_)}}, vars);
  }

  absl::Status Forward(Ops& ops, Variables* vars, const LayerInputs& in, const ForwardOptions& opts,
                       LayerOutputs* out, std::unique_ptr<SavedForward>* saved) const override {
    if (!in.x.defined() || in.x.dtype() != DType::kI32) {
      return absl::InvalidArgumentError(absl::StrCat(
          "x: Embed takes int32 token ids, got ", in.x.defined() ? DTypeName(in.x.dtype()) : "none"));
    }
    RETURN_IF_ERROR(CheckInputShape(in.x.shape(), 1));
    if (!in.extra.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("extra_inputs: Embed takes none, got ", in.extra.size()));
    }
    ASSIGN_OR_RETURN(const Tensor table, GetVariable(*vars, kEmbedding));
    const int64_t n = in.x.numel();
    ASSIGN_OR_RETURN(Tensor y, ops.Allocate(OutputDType(DType::kI32), {n, features_}));
    RETURN_IF_ERROR(ops.EmbedForward(table, in.x.Reshaped({n}), &y));
    out->y = y.Reshaped(Concat(in.x.shape(), {features_}));
    if (opts.keep_for_backward && saved != nullptr) {
      auto kept = std::make_unique<EmbedSaved>();
      kept->ids = in.x;
      *saved = std::move(kept);
    }
    return absl::OkStatus();
  }

  absl::Status Backward(Ops& ops, Variables* vars, const SavedForward& saved, const Tensor& dy,
                        LayerGrads* grads) const override {
    ASSIGN_OR_RETURN(const EmbedSaved* kept, SavedAs<EmbedSaved>(saved, "Embed"));
    const int64_t n = kept->ids.numel();
    const Shape y_shape = Concat(kept->ids.shape(), {features_});
    if (!dy.defined() || dy.shape() != y_shape || !IsFloating(dy.dtype()) || IsFloat8(dy.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat("dy must be a float tensor ",
                                                     ShapeString(y_shape), ", got ",
                                                     ShapeString(dy.shape())));
    }
    ASSIGN_OR_RETURN(Tensor dtable, ops.Allocate(param_dtype_, {vocab_, features_}));
    RETURN_IF_ERROR(ops.EmbedBackward(dy.Reshaped({n, features_}), kept->ids.Reshaped({n}), &dtable));
    grads->params[kEmbedding] = std::move(dtable);
    ASSIGN_OR_RETURN(grads->dx, IdGradient(ops, kept->ids.shape()));
    grads->dextra.clear();
    return absl::OkStatus();
  }

 private:
  int64_t vocab_;
  int64_t features_;
  std::optional<DType> dtype_;
  DType param_dtype_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxEmbed(const te::v1::FlaxEmbed& spec) {
  if (spec.num_embeddings() < 1) {
    return absl::InvalidArgumentError(absl::StrCat("spec.flax_embed.num_embeddings: ",
                                                   spec.num_embeddings(), "; want >= 1"));
  }
  if (spec.features() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.flax_embed.features: ", spec.features(), "; want >= 1"));
  }
  if (!CheckedNumElements({spec.num_embeddings(), spec.features()})) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.flax_embed: an embedding [", spec.num_embeddings(), ", ",
                     spec.features(), "] has more elements than fit in int64"));
  }
  ASSIGN_OR_RETURN(const std::optional<DType> dtype,
                   flax::ComputeDTypeOf(spec.dtype(), "spec.flax_embed.dtype"));
  ASSIGN_OR_RETURN(const DType param_dtype,
                   flax::ParamDTypeOf(spec.param_dtype(), "spec.flax_embed.param_dtype"));
  return std::unique_ptr<Layer>(
      new FlaxEmbed(spec.num_embeddings(), spec.features(), dtype, param_dtype));
}

absl::StatusOr<Tensor> IdGradient(Ops& ops, const Shape& shape) {
  ASSIGN_OR_RETURN(Tensor zeros, ops.Allocate(DType::kI32, shape));
  if (zeros.numel() == 0) return zeros;
  const std::vector<int32_t> host(static_cast<size_t>(zeros.numel()), 0);
  RETURN_IF_ERROR(ops.Upload(host.data(), &zeros));
  return zeros;
}

DType AttendDType(const std::optional<DType>& dtype, DType x, DType embedding) {
  return dtype ? *dtype : PromoteFloat(x, embedding);
}

absl::Status AttendForward(Ops& ops, const Tensor& embedding, const std::optional<DType>& dtype,
                           const Tensor& x, Tensor* y, AttendSaved* saved, bool tf32) {
  const int64_t vocab = embedding.dim(0), features = embedding.dim(1);
  if (x.rank() < 1 || x.dim(-1) != features) {
    return absl::InvalidArgumentError(absl::StrCat("x ", ShapeString(x.shape()),
                                                   ": attend wants [..., ", features,
                                                   "] (the embedding's features)"));
  }
  const DType compute = AttendDType(dtype, x.dtype(), embedding.dtype());
  const int64_t rows = x.numel() / features;
  ASSIGN_OR_RETURN(Tensor xc, CastTo(ops, x, compute));
  ASSIGN_OR_RETURN(Tensor ec, ops.CastKept(embedding, compute));
  ASSIGN_OR_RETURN(Tensor out, ops.Allocate(compute, {rows, vocab}));
  Ops::GemmArgs gemm;
  gemm.a = xc.Reshaped({rows, features});
  gemm.b = ec;
  gemm.transpose_b = true;
  gemm.tf32 = tf32;
  RETURN_IF_ERROR(ops.Gemm(gemm, &out));
  Shape y_shape = x.shape();
  y_shape.back() = vocab;
  *y = out.Reshaped(y_shape);
  if (saved != nullptr) {
    saved->x = xc;
    saved->embedding = ec;
    saved->x_dtype = x.dtype();
    saved->tf32 = tf32;
  }
  return absl::OkStatus();
}

absl::Status AttendBackward(Ops& ops, const AttendSaved& saved, DType embedding_dtype,
                            const Tensor& dy, Tensor* dx, Tensor* dembedding) {
  const int64_t vocab = saved.embedding.dim(0), features = saved.embedding.dim(1);
  const int64_t rows = saved.x.numel() / features;
  const DType compute = saved.embedding.dtype();
  ASSIGN_OR_RETURN(Tensor g, CastTo(ops, dy, compute));
  g = g.Reshaped({rows, vocab});
  ASSIGN_OR_RETURN(Tensor dxc, ops.Allocate(saved.x_dtype, {rows, features}));
  Ops::GemmArgs dgrad;
  dgrad.a = g;
  dgrad.b = saved.embedding;
  dgrad.tf32 = saved.tf32;
  RETURN_IF_ERROR(ops.Gemm(dgrad, &dxc));
  *dx = dxc.Reshaped(saved.x.shape());
  ASSIGN_OR_RETURN(*dembedding, ops.Allocate(embedding_dtype, {vocab, features}));
  Ops::GemmArgs wgrad;
  wgrad.a = g;
  wgrad.transpose_a = true;
  wgrad.b = saved.x.Reshaped({rows, features});
  wgrad.tf32 = saved.tf32;
  return ops.Gemm(wgrad, dembedding);
}

}  // namespace te::layers
