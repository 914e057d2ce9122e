// Session::Generate: generation (server/layers/generate.h) over one retained
// version of a layer's variables, in the session's turn.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"
#include "server/layers/fp8_state.h"
#include "server/layers/generate.h"
#include "server/layers/variables.h"
#include "server/session/session.h"
#include "server/session/log.h"
#include "server/session/session_internal.h"
#include "server/session/step_transaction.h"

namespace te::session {
namespace {

// The request's Sampling as the layers' options. Every field is checked,
// whether or not `sample` is set: a value out of range is a mistake either
// way, and a greedy request that names one would otherwise pass unnoticed.
absl::StatusOr<layers::SamplingOptions> SamplingOf(const te::v1::Sampling& sampling) {
  layers::SamplingOptions options;
  options.greedy = !sampling.sample();
  if (sampling.has_temperature()) options.temperature = sampling.temperature();
  options.top_k = sampling.top_k();
  if (sampling.has_top_p()) options.top_p = sampling.top_p();
  options.seed = sampling.seed();
  if (!(options.temperature > 0.0f) || !std::isfinite(options.temperature)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sampling.temperature: ", options.temperature, "; must be positive and finite "
        "(unset: 1.0; greedy decoding is sample false, not temperature 0)"));
  }
  if (options.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_k: ", options.top_k, "; must be >= 0 (0: every token)"));
  }
  if (!(options.top_p > 0.0f && options.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p: ", options.top_p, "; must be in (0, 1] (unset: 1.0)"));
  }
  return options;
}

const layers::Fp8Recipe* PtrOf(const std::optional<layers::Fp8Recipe>& fp8) {
  return fp8 ? &*fp8 : nullptr;
}

}  // namespace

absl::Status Session::Generate(const te::v1::GenerateRequest& request, const GenerateSink& sink,
                               const CallContext& call) {
  ASSIGN_OR_RETURN(const Target target,
                   Resolve(request.layer_id(), request.graph(), request.version()));
  LayerEntry* layer = target.entry;
  const layers::Layer& model = *target.layer;
  const std::string model_name =
      absl::StrCat(layer->id, " (", model.type_name(),
                   target.graph > 0 ? absl::StrCat(", graph ", target.graph) : "", ")");
  ASSIGN_OR_RETURN(const bool tf32,
                   layers::MatmulTf32(request.matmul_precision(), "matmul_precision"));
  ASSIGN_OR_RETURN(std::optional<layers::Fp8Recipe> fp8,
                   ResolveAutocast(request.autocast(), "autocast"));
  ASSIGN_OR_RETURN(const layers::SamplingOptions sampling, SamplingOf(request.sampling()));
  if (!model.TakesTokenIds()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer_id: ", model_name, " does not take token ids, so it cannot generate (Generate "
        "feeds a model the tokens it makes: a graph whose x feeds an nn.Embed)"));
  }

  ASSIGN_OR_RETURN(
      const CheckedTensor prompt,
      CheckTensor(request.prompt(), "prompt", config_.max_tensor_bytes, Resident(), Regions()));
  if (prompt.dtype != DType::kI32 || prompt.shape.size() != 2 || prompt.shape[0] < 1 ||
      prompt.shape[1] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt: ", ShapeString(prompt.shape), " ", DTypeName(prompt.dtype),
        "; want int32 token ids [batch, prompt_length] with both positive"));
  }
  const int64_t batch = prompt.shape[0], prompt_length = prompt.shape[1];
  // A bound on the count alone keeps the length's arithmetic in range; the
  // model and the session's memory bound it far lower (below).
  constexpr int64_t kMaxNewTokens = std::numeric_limits<int32_t>::max();
  if (request.max_new_tokens() < 1 || request.max_new_tokens() > kMaxNewTokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_new_tokens: ", request.max_new_tokens(), "; must be in [1, ", kMaxNewTokens, "]"));
  }
  // The caches hold every position but the last new token's (it is not fed
  // back): the model must take sequences of this length with the variables
  // it has (one whose positions are parameters of one length takes no other).
  const int64_t length = prompt_length + request.max_new_tokens() - 1;
  const Shape full = {batch, length};
  const std::string length_field =
      absl::StrCat("max_new_tokens: ", request.max_new_tokens(), " after a prompt of ",
                   prompt_length, " makes sequences of ", length, " tokens");
  absl::StatusOr<std::vector<layers::VariableSpec>> specs =
      model.VariableSpecs(full, PtrOf(fp8));
  absl::Status fits = specs.ok() ? model.OutputShape(full).status() : specs.status();
  if (fits.ok()) fits = layers::CheckVariables(target.read->vars, *specs);
  if (absl::IsFailedPrecondition(fits)) {
    return absl::FailedPreconditionError(absl::StrCat(
        model_name, ": ", fits.message(), " (TE: ScopeCollectionNotFound)"));
  }
  if (!fits.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        length_field, ", beyond what ", model_name, " takes: ", fits.message()));
  }
  absl::StatusOr<std::vector<layers::VariableSpec>> caches =
      model.CacheSpecs(full, DType::kI32, /*internal_decode=*/true);
  if (!caches.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer_id: ", model_name, " cannot generate: ", caches.status().message()));
  }
  // The caches are the call's largest allocation: refused before any is
  // made when they cannot fit.
  int64_t cache_bytes = 0;
  for (const layers::VariableSpec& spec : *caches) {
    const std::optional<int64_t> bytes = CheckedNumBytes(spec.shape, spec.dtype);
    if (!bytes || __builtin_add_overflow(cache_bytes, *bytes, &cache_bytes)) {
      return absl::InvalidArgumentError(
          absl::StrCat(length_field, ", whose keys and values are over 2^63 bytes"));
    }
  }
  const int64_t free_bytes = ops_->memory_limit() - ops_->bytes_in_use();
  if (cache_bytes > free_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        length_field, ", whose keys and values for ", batch, " sequences need ", cache_bytes,
        " bytes, more than the ", free_bytes, " bytes this session has left of its ",
        ops_->memory_limit(), " (--session_memory_bytes); ask for fewer tokens"));
  }

  ASSIGN_OR_RETURN(const Tensor prompt_ids, Materialize(*ops_, prompt));
  // Generation is inference: its steps record no amax, but the prompt's
  // step checks each kept FP8 weight copy, which writes kernel amaxes into
  // the transaction's copy of the version's fp8_metas, dropped at the end;
  // the version read stays as it was (contract 9).
  ASSIGN_OR_RETURN(std::unique_ptr<StepTransaction> tx,
                   StepTransaction::Open(*this, StepTransaction::ReadOf(target), fp8, call,
                                         "Generate"));
  layers::GenerateOptions options;
  options.max_new_tokens = request.max_new_tokens();
  options.sampling = sampling;
  options.stop_tokens.assign(request.stop_tokens().begin(), request.stop_tokens().end());
  options.fp8 = tx->fp8();
  options.tf32 = tf32;
  options.replay_steps = config_.replay_decode_steps;

  // A sequence has stopped once it made a stop token; one that has stopped
  // repeats it, so the test holds at every later step too.
  std::vector<bool> stopped(static_cast<size_t>(batch), false);
  auto each_step = [&](int64_t step, const std::vector<int32_t>& tokens) -> absl::Status {
    te::v1::GenerateResponse response;
    response.set_step(step);
    for (size_t b = 0; b < tokens.size(); ++b) {
      for (int32_t stop : options.stop_tokens) stopped[b] = stopped[b] || tokens[b] == stop;
      response.add_tokens(tokens[b]);
      response.add_stopped(stopped[b]);
    }
    return sink ? sink(response) : absl::OkStatus();
  };
  ASSIGN_OR_RETURN(const layers::GenerateResult generated,
                   layers::Generate(*ops_, model, tx->vars(), prompt_ids, options, each_step));
  if (!generated.record_status.ok()) {
    // The tokens are right either way; the steps ran one launch at a time.
    LogForSession(LogLevel::kWarning, id(), "Generate: its one-token step was not recorded",
                  {{"why", generated.record_status.message()}});
  }
  size_t made = 0;
  for (const std::vector<int32_t>& tokens : generated.tokens) made = std::max(made, tokens.size());
  LogForSession(LogLevel::kInfo, id(), "Generate done",
                {{"layer", model_name},
                 {"batch", absl::StrCat(batch)},
                 {"prompt", absl::StrCat(prompt_length)},
                 {"steps", absl::StrCat(made)},
                 {"replayed", absl::StrCat(generated.replayed_steps)},
                 {"prompt_queued_ms", absl::StrCat(absl::ToDoubleMilliseconds(generated.prompt_queued))},
                 {"first_token_ms", absl::StrCat(absl::ToDoubleMilliseconds(generated.first_token))}});
  // Only the FP8 weight copies outlive the call (they follow the newest
  // version's weights, whatever call made them): nothing changed the
  // working copy, so no version is made.
  return tx->Commit().status();
}

}  // namespace te::session
