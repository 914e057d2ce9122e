// Generation on the server from a causal model's variables: the prompt in,
// new tokens out as the server makes them, one Generate call (te.v1) for the
// whole sequence. The model is any layer or graph that takes int32 token ids
// and gives logits (with or without its loss node), such as the LM of
// client/decoder_lm.h or client/python/examples/train_lm.py.
//
//   GenerateOptions options;
//   options.max_new_tokens = 64;
//   options.stop_tokens = {'\n'};
//   auto made = Generate(vars, prompt, options,               // prompt: int32 [batch, length]
//                        [](const GenerateStep& step) { ...; return absl::OkStatus(); });
//
// The calling thread's Autocast and DefaultMatmulPrecision (recipe.h) go with
// the call, as with Apply. The variables' version is read and left as it was.
// Thread-safe as the Session is.
#ifndef TE_CLIENT_GENERATE_H_
#define TE_CLIENT_GENERATE_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/modules.h"
#include "client/tensor.h"

namespace te::client {

struct GenerateOptions {
  int64_t max_new_tokens = 16;  // >= 1; prompt + new tokens within what the model takes
  // Greedy (the argmax, lowest index on ties) unless `sample`: then
  // logits / temperature, the top_k most likely, the top_p nucleus, and a
  // draw that depends on (seed, step, sequence) alone, so the same call gives
  // the same tokens. Unset fields take te.v1.Sampling's defaults (1.0).
  bool sample = false;
  std::optional<float> temperature;  // > 0
  int64_t top_k = 0;                 // 0: every token
  std::optional<float> top_p;        // in (0, 1]
  uint64_t seed = 0;
  // A sequence that makes one of these stops there; the call ends when every
  // sequence has stopped.
  std::vector<int32_t> stop_tokens;
  int graph = 0;  // which of the layer's graphs runs (ApplyOptions::graph)
  // The call's deadline (rpc_timeout when that is shorter): on expiry the
  // call ends with DEADLINE_EXCEEDED after the steps already delivered.
  absl::Duration timeout = absl::InfiniteDuration();
};

// One position of every sequence, as the server sends it.
struct GenerateStep {
  int64_t step = 0;             // 0 for the first new token
  std::vector<int32_t> tokens;  // [batch]; a stopped sequence repeats its stop token
  std::vector<bool> stopped;    // [batch]: has made a stop token
};

struct GenerateResult {
  // Per sequence, its new tokens in order, up to and including its stop
  // token (none after it).
  std::vector<std::vector<int32_t>> tokens;
  std::vector<bool> stopped;
};

// Generates from `prompt` (int32 [batch, prompt_length]) with the model
// `vars` names. `on_step` (may be empty) sees each step as it arrives; a
// non-OK status from it cancels the call and is returned. Errors are the
// server's (INVALID_ARGUMENT naming the field: prompt, max_new_tokens,
// sampling.temperature, layer_id for a model that cannot generate...), or
// FAILED_PRECONDITION for variables not from Init.
absl::StatusOr<GenerateResult> Generate(
    const Variables& vars, const HostTensor& prompt, const GenerateOptions& options,
    const std::function<absl::Status(const GenerateStep& step)>& on_step = nullptr);

}  // namespace te::client

#endif  // TE_CLIENT_GENERATE_H_
