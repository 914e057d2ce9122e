#include "tests/gpu/layer_compare.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/status_macros.h"
#include "server/layers/fp8_state.h"
#include "server/layers/testing.h"

namespace te::layers::compare {
namespace {

constexpr char kFp8MetasPrefix[] = "fp8_metas/";
constexpr char kParamsPrefix[] = "params/";

// A host tensor with its own storage.
Tensor NewHostTensor(DType dtype, const Shape& shape) {
  auto bytes = std::make_shared<std::vector<uint8_t>>(static_cast<size_t>(NumElements(shape)) *
                                                      DTypeSize(dtype));
  return Tensor(bytes, bytes->data(), dtype, shape);
}

// Uniform in [-scale, scale), reproducible from `seed`, rounded to `dtype`.
Tensor RandomHostTensor(DType dtype, const Shape& shape, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> values(static_cast<size_t>(NumElements(shape)));
  for (float& v : values) v = dist(gen);
  Tensor t = NewHostTensor(dtype, shape);
  FromFloatVector(values, &t);
  return t;
}

// Token ids uniform in [0, vocab), reproducible from `seed`.
Tensor RandomHostIds(const Shape& shape, int64_t vocab, uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(vocab - 1));
  Tensor t = NewHostTensor(DType::kI32, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.data_as<int32_t>()[i] = dist(gen);
  return t;
}

// An Embed case's spec with the run's dtype as its embedding's.
te::v1::LayerSpec SpecFor(const CaseRun& run) {
  te::v1::LayerSpec spec = run.layer_case.spec;
  if (run.layer_case.token_vocab > 0 && spec.has_flax_embed()) {
    spec.mutable_flax_embed()->set_param_dtype(run.dtype == DType::kBF16 ? te::v1::BFLOAT16
                                                                         : te::v1::FLOAT32);
  }
  return spec;
}

Tensor HostLengths(const std::vector<int32_t>& lengths) {
  Tensor t = NewHostTensor(DType::kI32, {static_cast<int64_t>(lengths.size())});
  std::copy(lengths.begin(), lengths.end(), t.data_as<int32_t>());
  return t;
}

absl::StatusOr<Tensor> Upload(Ops& ops, const Tensor& host) {
  ASSIGN_OR_RETURN(Tensor t, ops.Allocate(host.dtype(), host.shape()));
  RETURN_IF_ERROR(ops.Upload(host.data(), &t));
  // The host buffer may go away after this call returns.
  RETURN_IF_ERROR(ops.Synchronize());
  return t;
}

// The same host tensor on both backends.
absl::Status UploadBoth(const Tensor& host, PreparedRun* run, Tensor* reference,
                        Tensor* candidate) {
  ASSIGN_OR_RETURN(*reference, Upload(*run->reference.ops, host));
  ASSIGN_OR_RETURN(*candidate, Upload(*run->candidate.ops, host));
  return absl::OkStatus();
}

bool AllEqual(const std::vector<float>& v) {
  return std::all_of(v.begin(), v.end(), [&](float x) { return x == v.front(); });
}

// The forward + backward of one step, as Session::Step runs it.
absl::Status RunStep(const Layer& layer, const Fp8Recipe* fp8, bool tf32, BackendState* side,
                     LayerOutputs* out, LayerGrads* grads) {
  ForwardOptions opts;
  opts.deterministic = true;  // cuDNN's dropout RNG is not kernels/rng.h's
  opts.fp8 = fp8;
  opts.tf32 = tf32;
  opts.keep_for_backward = true;
  std::unique_ptr<SavedForward> saved;
  RETURN_IF_ERROR(layer.Forward(*side->ops, &side->vars, side->inputs, opts, out, &saved));
  if (saved == nullptr) {
    return absl::InternalError(absl::StrCat(layer.type_name(), " on ", side->ops->device_name(),
                                            ": forward kept nothing"));
  }
  RETURN_IF_ERROR(layer.Backward(*side->ops, &side->vars, *saved, side->dy, grads));
  if (HasFp8Metas(fp8)) RETURN_IF_ERROR(UpdateFp8Metas(*side->ops, *fp8, &side->vars));
  return side->ops->Synchronize();
}

// Records the relative error of one output pair under `key` (worst so far).
absl::Status CompareInto(const std::string& key, Ops& reference_ops, const Tensor& reference,
                         Ops& candidate_ops, const Tensor& candidate, Errors* errors) {
  if (!reference.defined() && !candidate.defined()) return absl::OkStatus();
  if (reference.defined() != candidate.defined()) {
    return absl::InternalError(absl::StrCat(
        key, ": defined on ", reference.defined() ? "the reference" : "the candidate", " only"));
  }
  if (reference.shape() != candidate.shape() || reference.dtype() != candidate.dtype()) {
    return absl::InternalError(absl::StrCat(
        key, ": reference ", DTypeName(reference.dtype()), ShapeString(reference.shape()),
        ", candidate ", DTypeName(candidate.dtype()), ShapeString(candidate.shape())));
  }
  ASSIGN_OR_RETURN(std::vector<float> want, HostValues(reference_ops, reference));
  ASSIGN_OR_RETURN(std::vector<float> got, HostValues(candidate_ops, candidate));
  Compared& worst = (*errors)[key];
  worst.error = std::max(worst.error, RelativeError(got, want));
  worst.dtype = reference.dtype();
  return absl::OkStatus();
}

// Both maps must hold the same names; each pair is compared under
// key_prefix + name.
absl::Status CompareMaps(const std::string& key_prefix, Ops& reference_ops,
                         const Variables& reference, Ops& candidate_ops, const Variables& candidate,
                         Errors* errors) {
  for (const auto& [name, tensor] : reference) {
    if (candidate.count(name) == 0) {
      return absl::InternalError(absl::StrCat(key_prefix, name, ": on the reference only"));
    }
  }
  for (const auto& [name, tensor] : candidate) {
    auto it = reference.find(name);
    if (it == reference.end()) {
      return absl::InternalError(absl::StrCat(key_prefix, name, ": on the candidate only"));
    }
    RETURN_IF_ERROR(
        CompareInto(key_prefix + name, reference_ops, it->second, candidate_ops, tensor, errors));
  }
  return absl::OkStatus();
}

bool IsFp8MetasKey(const std::string& key) { return absl::StartsWith(key, kFp8MetasPrefix); }

}  // namespace

// ---- copies between backends --------------------------------------------------

absl::StatusOr<Tensor> ToHost(Ops& ops, const Tensor& t) {
  Tensor host = NewHostTensor(t.dtype(), t.shape());
  if (t.nbytes() > 0) RETURN_IF_ERROR(ops.Download(t, host.data()));
  return host;
}

absl::StatusOr<std::vector<float>> HostValues(Ops& ops, const Tensor& t) {
  if (!IsFloating(t.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("HostValues: ", DTypeName(t.dtype()), " is not a float dtype"));
  }
  ASSIGN_OR_RETURN(Tensor host, ToHost(ops, t));
  return ToFloatVector(host);
}

absl::StatusOr<Tensor> CopyTensor(Ops& from, const Tensor& t, Ops& to) {
  ASSIGN_OR_RETURN(Tensor host, ToHost(from, t));
  return Upload(to, host);
}

absl::StatusOr<Variables> CopyVariables(Ops& from, const Variables& vars, Ops& to) {
  Variables copy;
  for (const auto& [name, tensor] : vars) {
    ASSIGN_OR_RETURN(copy[name], CopyTensor(from, tensor, to));
  }
  return copy;
}

double RelativeError(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i]) || !std::isfinite(want[i])) return INFINITY;
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

namespace {

// The key bias's exactly-zero gradient, judged by its size (the one rule:
// server/layers/testing.h's ZeroGradientError).
absl::Status JudgeZeroGradients(Ops& reference_ops, const Variables& reference, Ops& candidate_ops,
                                const Variables& candidate, Errors* errors) {
  for (const auto& [name, tensor] : reference) {
    if (!testing::IsKeyBiasGradient(name) || candidate.count(name) == 0) continue;
    const std::string kernel = testing::KeyKernelOf(name);
    if (reference.count(kernel) == 0) continue;
    ASSIGN_OR_RETURN(std::vector<float> want, HostValues(reference_ops, tensor));
    ASSIGN_OR_RETURN(std::vector<float> got, HostValues(candidate_ops, candidate.at(name)));
    ASSIGN_OR_RETURN(std::vector<float> scale, HostValues(reference_ops, reference.at(kernel)));
    (*errors)["grad " + name] = {testing::ZeroGradientError(got, want, scale), tensor.dtype()};
  }
  return absl::OkStatus();
}

}  // namespace

// ---- one run on two backends ---------------------------------------------------

absl::StatusOr<PreparedRun> Prepare(Ops& reference, Ops& candidate, const CaseRun& run,
                                    uint64_t seed) {
  const LayerCase& c = run.layer_case;
  PreparedRun prepared;
  ASSIGN_OR_RETURN(prepared.layer, CreateLayer(SpecFor(run)));
  if (run.fp8) prepared.fp8 = HybridDelayedScaling();
  prepared.tf32 = c.tf32;
  prepared.reference.ops = &reference;
  prepared.candidate.ops = &candidate;

  Variables initial;
  RETURN_IF_ERROR(prepared.layer->Init(reference, seed, c.x_shape, prepared.recipe(), &initial));
  uint64_t param_seed = seed * 1000 + 100;
  for (const auto& [name, tensor] : initial) {
    ASSIGN_OR_RETURN(Tensor host, ToHost(reference, tensor));
    if (absl::StartsWith(name, kParamsPrefix)) {
      std::vector<float> values = ToFloatVector(host);
      if (AllEqual(values)) {
        const Tensor noise = RandomHostTensor(DType::kF32, host.shape(), param_seed++, 0.5f);
        for (size_t i = 0; i < values.size(); ++i) values[i] += noise.data_as<float>()[i];
        FromFloatVector(values, &host);
      }
    }
    RETURN_IF_ERROR(UploadBoth(host, &prepared, &prepared.reference.vars[name],
                               &prepared.candidate.vars[name]));
  }

  uint64_t input_seed = seed * 1000 + 10;
  const Tensor x = c.token_vocab > 0 ? RandomHostIds(c.x_shape, c.token_vocab, input_seed++)
                                     : RandomHostTensor(run.dtype, c.x_shape, input_seed++);
  RETURN_IF_ERROR(
      UploadBoth(x, &prepared, &prepared.reference.inputs.x, &prepared.candidate.inputs.x));
  for (const Shape& shape : c.extra_shapes) {
    Tensor& ref = prepared.reference.inputs.extra.emplace_back();
    Tensor& cand = prepared.candidate.inputs.extra.emplace_back();
    RETURN_IF_ERROR(
        UploadBoth(RandomHostTensor(run.dtype, shape, input_seed++), &prepared, &ref, &cand));
  }
  if (!c.q_seqlens.empty()) {
    RETURN_IF_ERROR(UploadBoth(HostLengths(c.q_seqlens), &prepared,
                               &prepared.reference.inputs.q_seqlens,
                               &prepared.candidate.inputs.q_seqlens));
    RETURN_IF_ERROR(UploadBoth(HostLengths(c.kv_seqlens), &prepared,
                               &prepared.reference.inputs.kv_seqlens,
                               &prepared.candidate.inputs.kv_seqlens));
  }
  ASSIGN_OR_RETURN(const Shape y_shape, prepared.layer->OutputShape(c.x_shape));
  const DType y_dtype = prepared.layer->OutputDType(x.dtype());
  RETURN_IF_ERROR(UploadBoth(RandomHostTensor(y_dtype, y_shape, input_seed++), &prepared,
                             &prepared.reference.dy, &prepared.candidate.dy));
  return prepared;
}

absl::StatusOr<Errors> StepAndCompare(PreparedRun* run, int steps) {
  Errors errors;
  BackendState& ref = run->reference;
  BackendState& cand = run->candidate;
  for (int step = 0; step < steps; ++step) {
    LayerOutputs ref_out, cand_out;
    LayerGrads ref_grads, cand_grads;
    RETURN_IF_ERROR(RunStep(*run->layer, run->recipe(), run->tf32, &ref, &ref_out, &ref_grads));
    RETURN_IF_ERROR(
        RunStep(*run->layer, run->recipe(), run->tf32, &cand, &cand_out, &cand_grads));
    RETURN_IF_ERROR(CompareInto("y", *ref.ops, ref_out.y, *cand.ops, cand_out.y, &errors));
    RETURN_IF_ERROR(
        CompareInto("ln_out", *ref.ops, ref_out.ln_out, *cand.ops, cand_out.ln_out, &errors));
    if (!ref_grads.dx.defined() || IsFloating(ref_grads.dx.dtype())) {  // token ids have none
      RETURN_IF_ERROR(CompareInto("dx", *ref.ops, ref_grads.dx, *cand.ops, cand_grads.dx, &errors));
    }
    if (ref_grads.dextra.size() != cand_grads.dextra.size()) {
      return absl::InternalError(absl::StrCat("dextra: ", ref_grads.dextra.size(),
                                              " gradients on the reference, ",
                                              cand_grads.dextra.size(), " on the candidate"));
    }
    for (size_t i = 0; i < ref_grads.dextra.size(); ++i) {
      RETURN_IF_ERROR(CompareInto(absl::StrCat("dextra[", i, "]"), *ref.ops, ref_grads.dextra[i],
                                  *cand.ops, cand_grads.dextra[i], &errors));
    }
    RETURN_IF_ERROR(
        CompareMaps("grad ", *ref.ops, ref_grads.params, *cand.ops, cand_grads.params, &errors));
    RETURN_IF_ERROR(JudgeZeroGradients(*ref.ops, ref_grads.params, *cand.ops, cand_grads.params,
                                       &errors));
    RETURN_IF_ERROR(CompareMaps("", *ref.ops, ref.vars, *cand.ops, cand.vars, &errors));
  }
  return errors;
}

// ---- judging ------------------------------------------------------------------

double ToleranceFor(const Tolerances& tol, const CaseRun& run, const std::string& key,
                    DType stored) {
  if (run.fp8) {
    return IsFp8MetasKey(key) ? tol.fp8_metas : tol.fp8_values;
  }
  const bool composed = run.layer_case.composed;
  if (run.dtype == DType::kF32 && !run.layer_case.tf32) {
    if (stored == DType::kBF16) return tol.f32_run_bf16_tensor;
    return composed ? tol.f32_composed : tol.f32_single_op;
  }
  return composed ? tol.bf16_composed : tol.bf16_single_op;
}

::testing::AssertionResult AllWithin(const Tolerances& tol, const CaseRun& run,
                                     const Errors& errors) {
  std::ostringstream over;
  for (const auto& [key, compared] : errors) {
    const double bound = ToleranceFor(tol, run, key, compared.dtype);
    if (!(compared.error <= bound)) {
      over << "\n  " << key << " (" << DTypeName(compared.dtype) << "): " << compared.error
           << " > " << bound;
    }
  }
  const std::string report = over.str();
  if (report.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << run.name() << ": relative errors over tolerance:" << report;
}

std::string Summary(const Errors& errors) {
  std::string out;
  for (bool metas : {false, true}) {
    const std::string* worst_key = nullptr;
    double worst = -1.0;
    for (const auto& [key, compared] : errors) {
      if (IsFp8MetasKey(key) != metas || compared.error <= worst) continue;
      worst = compared.error;
      worst_key = &key;
    }
    if (worst_key == nullptr) continue;
    char value[32];
    std::snprintf(value, sizeof(value), "%.3g", worst);
    absl::StrAppend(&out, out.empty() ? "" : "; ",
                    metas ? "worst fp8_metas: " : "worst: ", *worst_key, " ", value);
  }
  return out;
}

absl::StatusOr<Fp8StateMovement> Fp8StateMoved(Ops& ops, const Variables& vars) {
  Fp8StateMovement moved;
  for (const auto& [name, tensor] : vars) {
    if (!absl::StartsWith(name, kFp8MetasPrefix)) continue;
    ASSIGN_OR_RETURN(std::vector<float> values, HostValues(ops, tensor));
    if (absl::EndsWith(name, "_amax_history")) {
      moved.amax_recorded |=
          std::any_of(values.begin(), values.end(), [](float v) { return v != 0.0f; });
    } else if (absl::EndsWith(name, "_scale")) {
      moved.scale_updated |=
          std::any_of(values.begin(), values.end(), [](float v) { return v != 1.0f; });
    }
  }
  return moved;
}

}  // namespace te::layers::compare
