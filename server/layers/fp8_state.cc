#include "server/layers/fp8_state.h"

#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"
#include "kernels/status_macros.h"
#include "server/layers/variables.h"

namespace te::layers {
namespace {

constexpr char kHistorySuffix[] = "_amax_history";
constexpr char kScaleSuffix[] = "_scale";
constexpr int kMaxAmaxHistoryLen = 65536;

Fp8Recipe::Format FormatOf(te::v1::Fp8Format format, Fp8Recipe::Format default_format) {
  switch (format) {
    case te::v1::E4M3: return Fp8Recipe::Format::kE4M3;
    case te::v1::E5M2: return Fp8Recipe::Format::kE5M2;
    case te::v1::HYBRID: return Fp8Recipe::Format::kHybrid;
    default: return default_format;
  }
}

absl::Status CheckFormatKnown(te::v1::Fp8Format format, absl::string_view field) {
  if (te::v1::Fp8Format_IsValid(format)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": unknown FP8 format ", static_cast<int>(format)));
}

// The block scalings' block length along the contraction axis.
int64_t BlockLength(Fp8Recipe::Kind kind) { return kind == Fp8Recipe::Kind::kNVFP4 ? 16 : 32; }

// With `both_layouts`, out->data_t gets x^T quantized in the same pass.
absl::Status QuantizePerTensor(Ops& ops, const Fp8Recipe& fp8, const QuantizerSet& set,
                               QuantizerRole role, const Tensor& x, Variables* vars,
                               bool both_layouts, GemmOperand* out, Tensor* dbias = nullptr) {
  const DType dtype = QuantizerDType(fp8, role);
  ASSIGN_OR_RETURN(out->data, ops.Allocate(dtype, x.shape()));
  if (both_layouts) {
    ASSIGN_OR_RETURN(out->data_t, ops.Allocate(dtype, {x.dim(1), x.dim(0)}));
  }
  ASSIGN_OR_RETURN(out->scale_inv, ops.Allocate(DType::kF32, {1}));
  Fp8Output side;
  side.scale_inv = out->scale_inv;
  if (fp8.kind == Fp8Recipe::Kind::kDelayedScaling) {
    if (vars == nullptr) {
      return absl::InternalError("QuantizeGemmOperand: DelayedScaling needs the variables");
    }
    RETURN_IF_ERROR(CheckQuantizerSet(*vars, set, &fp8));
    side.scale = vars->at(set.ScaleName(role));
    if (!fp8.inference) side.amax = vars->at(set.HistoryName(role)).Slice0(0, 1);  // history[0]
  } else {  // current scaling: the scale comes from this tensor's amax
    ASSIGN_OR_RETURN(side.amax, ops.Allocate(DType::kF32, {1}));
    ASSIGN_OR_RETURN(side.scale, ops.Allocate(DType::kF32, {1}));
    RETURN_IF_ERROR(ops.Amax(x, &side.amax));
    RETURN_IF_ERROR(ops.ScaleFromAmax(side.amax, Fp8Max(dtype), fp8.margin, fp8.amax_epsilon,
                                      &side.scale, &out->scale_inv));
  }
  if (both_layouts && dbias != nullptr) {
    return ops.QuantizeTransposeDbias(x, side, &out->data, &out->data_t, dbias);
  }
  if (both_layouts) return ops.QuantizeTranspose(x, side, &out->data, &out->data_t);
  return ops.Quantize(x, side, &out->data);
}

}  // namespace

absl::StatusOr<Fp8Recipe> ResolveRecipe(const te::v1::Recipe& recipe) {
  Fp8Recipe r;
  switch (recipe.kind_case()) {
    case te::v1::Recipe::kDelayedScaling: {
      const te::v1::DelayedScaling& d = recipe.delayed_scaling();
      RETURN_IF_ERROR(CheckFormatKnown(d.fp8_format(), "recipe.delayed_scaling.fp8_format"));
      r.kind = Fp8Recipe::Kind::kDelayedScaling;
      r.format = FormatOf(d.fp8_format(), Fp8Recipe::Format::kHybrid);
      r.margin = d.has_margin() ? d.margin() : 0.0f;
      if (!std::isfinite(r.margin) || r.margin < 0.0f) {
        return absl::InvalidArgumentError(absl::StrCat(
            "recipe.delayed_scaling.margin must be finite and >= 0, got ", r.margin));
      }
      r.amax_history_len = d.has_amax_history_len() ? d.amax_history_len() : 1024;
      if (r.amax_history_len < 1 || r.amax_history_len > kMaxAmaxHistoryLen) {
        return absl::InvalidArgumentError(
            absl::StrCat("recipe.delayed_scaling.amax_history_len must be in 1..",
                         kMaxAmaxHistoryLen, ", got ", r.amax_history_len));
      }
      const std::string algo = d.has_amax_compute_algo() ? d.amax_compute_algo() : "max";
      if (algo != "max" && algo != "most_recent") {
        return absl::InvalidArgumentError(absl::StrCat(
            "recipe.delayed_scaling.amax_compute_algo must be \"max\" or \"most_recent\", got \"",
            algo, "\""));
      }
      r.most_recent = algo == "most_recent";
      return r;
    }
    case te::v1::Recipe::kFloat8CurrentScaling: {
      const te::v1::Float8CurrentScaling& c = recipe.float8_current_scaling();
      RETURN_IF_ERROR(CheckFormatKnown(c.fp8_format(), "recipe.float8_current_scaling.fp8_format"));
      r.kind = Fp8Recipe::Kind::kCurrentScaling;
      r.format = FormatOf(c.fp8_format(), Fp8Recipe::Format::kHybrid);
      r.amax_epsilon = c.has_amax_epsilon() ? c.amax_epsilon() : 0.0f;
      if (!std::isfinite(r.amax_epsilon) || r.amax_epsilon < 0.0f) {
        return absl::InvalidArgumentError(absl::StrCat(
            "recipe.float8_current_scaling.amax_epsilon must be finite and >= 0, got ",
            r.amax_epsilon));
      }
      return r;
    }
    case te::v1::Recipe::kMxfp8BlockScaling: {
      const te::v1::MXFP8BlockScaling& m = recipe.mxfp8_block_scaling();
      RETURN_IF_ERROR(CheckFormatKnown(m.fp8_format(), "recipe.mxfp8_block_scaling.fp8_format"));
      r.kind = Fp8Recipe::Kind::kMXFP8;
      r.format = FormatOf(m.fp8_format(), Fp8Recipe::Format::kE4M3);
      if (r.format != Fp8Recipe::Format::kE4M3) {
        // Ops::FakeQuantizeBlockScaled emulates MXFP8 with E4M3 elements only.
        return absl::InvalidArgumentError(
            "recipe.mxfp8_block_scaling.fp8_format: only E4M3 is supported");
      }
      return r;
    }
    case te::v1::Recipe::kNvfp4BlockScaling:
      r.kind = Fp8Recipe::Kind::kNVFP4;
      r.format = Fp8Recipe::Format::kE4M3;
      return r;
    case te::v1::Recipe::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      "recipe: no recipe set (one of delayed_scaling, float8_current_scaling, "
      "mxfp8_block_scaling, nvfp4_block_scaling)");
}

bool HasFp8Metas(const Fp8Recipe* fp8) {
  return fp8 != nullptr && fp8->kind == Fp8Recipe::Kind::kDelayedScaling;
}

bool IsPerTensorScaling(const Fp8Recipe& fp8) {
  return fp8.kind == Fp8Recipe::Kind::kDelayedScaling ||
         fp8.kind == Fp8Recipe::Kind::kCurrentScaling;
}

const char* QuantizerName(QuantizerRole role) {
  switch (role) {
    case QuantizerRole::kX: return "x";
    case QuantizerRole::kKernel: return "kernel";
    case QuantizerRole::kGrad: return "grad";
  }
  return "";
}

DType QuantizerDType(const Fp8Recipe& fp8, QuantizerRole role) {
  return role == QuantizerRole::kGrad ? fp8.backward_dtype() : fp8.forward_dtype();
}

QuantizerSet::QuantizerSet(const std::string& scope, const std::string& postfix) {
  for (QuantizerRole role : {QuantizerRole::kX, QuantizerRole::kKernel, QuantizerRole::kGrad}) {
    const int i = static_cast<int>(role);
    scale_names_[i] =
        VariableName(kFp8Metas, scope, absl::StrCat(QuantizerName(role), postfix, kScaleSuffix));
    history_names_[i] =
        VariableName(kFp8Metas, scope, absl::StrCat(QuantizerName(role), postfix, kHistorySuffix));
  }
}

std::vector<VariableDef> QuantizerSetDefs(const QuantizerSet& set, const Fp8Recipe* fp8) {
  std::vector<VariableDef> defs;
  if (!HasFp8Metas(fp8)) return defs;
  for (QuantizerRole role : {QuantizerRole::kX, QuantizerRole::kKernel, QuantizerRole::kGrad}) {
    defs.push_back({{set.ScaleName(role), {1}, DType::kF32}, Initializer::Ones()});
    defs.push_back({{set.HistoryName(role), {fp8->amax_history_len}, DType::kF32},
                    Initializer::Zeros()});
  }
  return defs;
}

absl::Status CheckQuantizerSet(const Variables& vars, const QuantizerSet& set,
                               const Fp8Recipe* fp8) {
  if (!HasFp8Metas(fp8)) return absl::OkStatus();
  // Every quantization of a step asks: the variables are looked up in place,
  // and CheckVariables's message made only for a set that does not fit.
  auto fits = [&vars](const std::string& name, bool history) {
    auto it = vars.find(name);
    if (it == vars.end()) return false;
    const Tensor& t = it->second;
    return t.dtype() == DType::kF32 && t.rank() == 1 && (history ? t.dim(0) >= 1 : t.dim(0) == 1);
  };
  for (QuantizerRole role : {QuantizerRole::kX, QuantizerRole::kKernel, QuantizerRole::kGrad}) {
    if (!fits(set.ScaleName(role), false) || !fits(set.HistoryName(role), true)) {
      return CheckVariables(vars, SpecsOf(QuantizerSetDefs(set, fp8)));
    }
  }
  return absl::OkStatus();
}

GemmOperand ForGemm(const GemmOperand& op, GemmSide side) {
  if (!op.data_t.defined()) return op;
  // Ops::Gemm copies an FP8 a that is transposed and a b that is not.
  const bool flip = side == GemmSide::kA ? op.transpose : !op.transpose;
  if (!flip) return op;
  GemmOperand other = op;
  std::swap(other.data, other.data_t);
  other.transpose = !op.transpose;
  return other;
}

absl::StatusOr<GemmOperand> QuantizeGemmOperandBothLayouts(Ops& ops, const Fp8Recipe& fp8,
                                                           const QuantizerSet& set,
                                                           QuantizerRole role, const Tensor& x,
                                                           GemmSide side, bool transpose,
                                                           Variables* vars, Tensor* dbias) {
  if (x.rank() != 2 || !IsPerTensorScaling(fp8)) {
    ASSIGN_OR_RETURN(GemmOperand out,
                     QuantizeGemmOperand(ops, fp8, set, role, x, side, transpose, vars));
    if (dbias != nullptr) RETURN_IF_ERROR(ops.SumRows(x, dbias));
    return out;
  }
  GemmOperand out;
  out.transpose = transpose;
  RETURN_IF_ERROR(
      QuantizePerTensor(ops, fp8, set, role, x, vars, /*both_layouts=*/true, &out, dbias));
  return out;
}

absl::StatusOr<GemmOperand> QuantizeGemmOperand(Ops& ops, const Fp8Recipe& fp8,
                                                const QuantizerSet& set, QuantizerRole role,
                                                const Tensor& x, GemmSide side, bool transpose,
                                                Variables* vars) {
  if (x.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("GEMM operand must be 2-D, got ", ShapeString(x.shape())));
  }
  GemmOperand out;
  out.transpose = transpose;
  if (IsPerTensorScaling(fp8)) {
    RETURN_IF_ERROR(QuantizePerTensor(ops, fp8, set, role, x, vars, /*both_layouts=*/false, &out));
    return out;
  }
  // Block scaling: blocks run along the contraction axis, which must be last.
  const bool contraction_is_last = (side == GemmSide::kA) != transpose;
  Tensor rows = x;
  if (!contraction_is_last) {
    ASSIGN_OR_RETURN(rows, ops.Allocate(x.dtype(), {x.dim(1), x.dim(0)}));
    RETURN_IF_ERROR(ops.Permute(x, {1, 0}, &rows));
    out.transpose = !transpose;
  }
  const int64_t block = BlockLength(fp8.kind);
  if (rows.dim(1) % block != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        fp8.kind == Fp8Recipe::Kind::kNVFP4 ? "NVFP4" : "MXFP8",
        " block scaling needs every GEMM contraction length to be a multiple of ", block,
        "; the ", QuantizerName(role), " operand ", ShapeString(x.shape()), " contracts over ",
        rows.dim(1)));
  }
  ASSIGN_OR_RETURN(out.data, ops.Allocate(x.dtype(), rows.shape()));
  RETURN_IF_ERROR(ops.FakeQuantizeBlockScaled(
      fp8.kind == Fp8Recipe::Kind::kNVFP4 ? BlockFormat::kNVFP4 : BlockFormat::kMXFP8, rows,
      &out.data));
  return out;
}

bool CanFuseQuantize(const Fp8Recipe* fp8) {
  return fp8 != nullptr && fp8->kind == Fp8Recipe::Kind::kDelayedScaling;
}

absl::StatusOr<GemmOperand> AllocateFusedOperand(Ops& ops, const Fp8Recipe& fp8,
                                                 const QuantizerSet& set, QuantizerRole role,
                                                 const Shape& shape, Variables* vars,
                                                 Fp8Output* out) {
  if (!CanFuseQuantize(&fp8)) {
    return absl::InternalError("AllocateFusedOperand: only DelayedScaling fuses quantization");
  }
  RETURN_IF_ERROR(CheckQuantizerSet(*vars, set, &fp8));
  GemmOperand op;
  ASSIGN_OR_RETURN(op.data, ops.Allocate(QuantizerDType(fp8, role), shape));
  ASSIGN_OR_RETURN(op.scale_inv, ops.Allocate(DType::kF32, {1}));
  out->scale = vars->at(set.ScaleName(role));
  if (!fp8.inference) out->amax = vars->at(set.HistoryName(role)).Slice0(0, 1);
  out->scale_inv = op.scale_inv;
  return op;
}

absl::Status UpdateFp8Metas(Ops& ops, const Fp8Recipe& fp8, Variables* vars, Tensor* non_finite) {
  if (!HasFp8Metas(&fp8)) return absl::OkStatus();
  const std::string prefix = absl::StrCat(kFp8Metas, "/");
  std::vector<Ops::DelayedScalingItem> items;
  // The map is ordered: the collection's names are one run of it.
  for (auto it = vars->lower_bound(prefix);
       it != vars->end() && absl::StartsWith(it->first, prefix); ++it) {
    const std::string& name = it->first;
    const Tensor& history = it->second;
    if (!absl::EndsWith(name, kHistorySuffix)) continue;
    const std::string stem = name.substr(0, name.size() - sizeof(kHistorySuffix) + 1);
    auto scale = vars->find(stem + kScaleSuffix);
    if (scale == vars->end()) {
      return absl::FailedPreconditionError(
          absl::StrCat(name, " has no ", stem, kScaleSuffix, ": the fp8_metas are incomplete"));
    }
    // The quantizer is the last path component up to its postfix: "grad_1".
    const std::string quantizer = stem.substr(stem.rfind('/') + 1);
    const bool is_grad = absl::StartsWith(quantizer, QuantizerName(QuantizerRole::kGrad));
    Ops::DelayedScalingItem item;
    item.args.fp8_max = Fp8Max(is_grad ? fp8.backward_dtype() : fp8.forward_dtype());
    item.args.margin = fp8.margin;
    item.args.most_recent = fp8.most_recent;
    item.amax_history = history;
    item.scale = scale->second;
    items.push_back(std::move(item));
  }
  // One launch for the layer's quantizers, all checked before any moves.
  return ops.DelayedScalingUpdates(items, non_finite);
}

}  // namespace te::layers
