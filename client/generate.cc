#include "client/generate.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te::client {

absl::StatusOr<GenerateResult> Generate(
    const Variables& vars, const HostTensor& prompt, const GenerateOptions& options,
    const std::function<absl::Status(const GenerateStep& step)>& on_step) {
  if (vars.session == nullptr || vars.layer_id.empty()) {
    return absl::FailedPreconditionError("variables: not from Module::Init (no session or layer id)");
  }
  Session& session = *vars.session;
  te::v1::GenerateRequest request;
  request.set_layer_id(vars.layer_id);
  request.set_graph(options.graph);
  request.set_version(vars.version());
  std::vector<std::string> uploads;
  absl::StatusOr<te::v1::Tensor> sent = session.Send(prompt, &uploads);
  if (!sent.ok()) {
    session.DeleteAll(uploads).IgnoreError();
    return sent.status();
  }
  *request.mutable_prompt() = *std::move(sent);
  request.set_max_new_tokens(options.max_new_tokens);
  te::v1::Sampling* sampling = request.mutable_sampling();
  sampling->set_sample(options.sample);
  if (options.temperature) sampling->set_temperature(*options.temperature);
  sampling->set_top_k(options.top_k);
  if (options.top_p) sampling->set_top_p(*options.top_p);
  sampling->set_seed(options.seed);
  for (int32_t stop : options.stop_tokens) request.add_stop_tokens(stop);
  *request.mutable_autocast() = ToProto(Autocast::Current());
  request.set_matmul_precision(ToProto(DefaultMatmulPrecision::Current()));

  GenerateResult result;
  int64_t expected_step = 0;
  absl::Status status = session.Generate(
      std::move(request),
      [&](const te::v1::GenerateResponse& response) -> absl::Status {
        GenerateStep step;
        step.step = response.step();
        step.tokens.assign(response.tokens().begin(), response.tokens().end());
        step.stopped.assign(response.stopped().begin(), response.stopped().end());
        if (step.step != expected_step++ || step.tokens.empty() ||
            step.tokens.size() != step.stopped.size() ||
            (!result.tokens.empty() && step.tokens.size() != result.tokens.size())) {
          return absl::DataLossError(absl::StrCat(
              "Generate: step ", step.step, " with ", step.tokens.size(), " tokens and ",
              step.stopped.size(), " stopped flags after ", expected_step - 1, " steps of ",
              result.tokens.size(), " sequences"));
        }
        if (result.tokens.empty()) {
          result.tokens.resize(step.tokens.size());
          result.stopped.assign(step.tokens.size(), false);
        }
        for (size_t b = 0; b < step.tokens.size(); ++b) {
          if (!result.stopped[b]) result.tokens[b].push_back(step.tokens[b]);
          result.stopped[b] = step.stopped[b];
        }
        return on_step ? on_step(step) : absl::OkStatus();
      },
      options.timeout);
  // The prompt's upload (if it was too large to go inline) goes either way.
  absl::Status deleted = session.DeleteAll(uploads);
  RETURN_IF_ERROR(status);
  RETURN_IF_ERROR(deleted);
  return result;
}

}  // namespace te::client
