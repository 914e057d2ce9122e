// Generation: a causal model (a graph LM such as Embed -> TransformerLayers
// -> LayerNorm -> attend, with or without its loss node; or any layer that
// takes token ids and gives logits) run autoregressively on its device.
//
//   1. The caches: the model's CacheSpecs for the whole length (prompt +
//      new tokens - 1) with internal_decode, zeros, held by this call alone.
//   2. Prefill: one decode step with the whole prompt [B, P] (each
//      attention writes P rows of its cache at once); its last row's logits
//      give the first new token.
//   3. Then one step per new token, [B, 1], at the position the loop knows
//      (ForwardOptions::decode_cache_index: no device read per module). The
//      step's position and attention lengths live on the device
//      (DecodeContext): uploaded for the first one-token step, then advanced
//      by each step on the device, so every one-token step issues the same
//      launches: the second is recorded (Ops::CaptureStep) and the rest
//      replay it, one launch a token instead of hundreds, under every
//      recipe. Where a backend cannot record (the CPU), or when recording
//      fails, the steps run as the first did.
//   Greedy steps pick their tokens on the device (Ops::ArgmaxLast, the
//   lowest index on ties, as jnp.argmax) into the buffer the next step
//   reads, so the next step is queued before the host reads this one's
//   tokens (Ops::DownloadAsync): the device does not wait for the host
//   between tokens. (Not the prompt's: its tokens, the first, go out before
//   the first one-token step is issued.) Sampled steps read their logits to the host and draw
//   there: temperature, then top-k, then top-p (nucleus), from a uniform
//   draw that depends on (seed, step, batch row) alone, so a generation is
//   reproducible.
//
// Greedy generation gives the tokens that re-running the full causal
// forward on the growing prefix gives (decode steps are the forward's rows,
// cache.h). Between tokens the call asks ops.CheckInterrupt() (a deadline,
// a cancelled call) and stops with its status.
#ifndef TE_SERVER_LAYERS_GENERATE_H_
#define TE_SERVER_LAYERS_GENERATE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"

namespace te::layers {

struct SamplingOptions {
  bool greedy = true;          // argmax; the fields below apply when false
  float temperature = 1.0f;    // > 0: logits / temperature
  int64_t top_k = 0;           // keep the k most likely tokens; 0: all
  float top_p = 1.0f;          // in (0, 1]: the smallest set whose probability reaches top_p
  uint64_t seed = 0;
};

struct GenerateOptions {
  int64_t max_new_tokens = 16;  // >= 1
  SamplingOptions sampling;
  // A sequence that makes one of these stops there (the stop token is its
  // last); generation ends when every sequence has stopped.
  std::vector<int32_t> stop_tokens;
  const Fp8Recipe* fp8 = nullptr;  // as ForwardOptions::fp8
  bool tf32 = false;               // as ForwardOptions::tf32
  bool replay_steps = true;        // record a one-token step and replay it (step 3)
};

struct GenerateResult {
  // Per sequence, the new tokens in order (a stop token included).
  std::vector<std::vector<int32_t>> tokens;
  std::vector<bool> stopped;  // made a stop token
  int64_t replayed_steps = 0;  // one-token steps issued as a replay
  absl::Status record_status;  // why no step was recorded, when one was tried and failed
  // Host time from the call's start until the prompt's step was queued, and
  // until its tokens (the first new ones) were read.
  absl::Duration prompt_queued;
  absl::Duration first_token;
};

// Called after each step with its position (0 for the first new token) and
// the token each sequence made ([B]; a sequence that has stopped repeats its
// stop token). A non-OK status ends generation with that status.
using TokenSink = std::function<absl::Status(int64_t step, const std::vector<int32_t>& tokens)>;

// The first `keep` (<= vocab) token ids of `row` [vocab] by logit, the most
// likely first and ties by the lower id: the order std::stable_sort gives
// with `>` (the sampling order), without its O(V log V), which is 4 ms a
// row at GPT-2's 50,257 tokens: a partial sort by (logit, id) when few are
// kept, else a stable radix sort on the logits' bits (four passes of a
// byte). -0 and +0 tie; a row with a NaN takes the stable sort itself.
std::vector<int32_t> MostLikelyFirst(const float* row, int64_t vocab, size_t keep);

// One token for each row of logits [B, V] (float32 on the host) at `step`.
// INVALID_ARGUMENT naming the sampling field that is out of range.
absl::StatusOr<std::vector<int32_t>> SampleTokens(const std::vector<float>& logits, int64_t batch,
                                                  int64_t vocab, const SamplingOptions& options,
                                                  int64_t step);

// Generates from `prompt` (int32 [B, P] on ops' device) with `model`, whose x
// is token ids and whose decode output is logits [B, S, V]. `vars` holds the
// model's variables (shared, not copied). Under DelayedScaling the steps run
// as inference (Fp8Recipe::inference): they record no amax, except that the
// prompt's step checks each kept FP8 weight copy, which writes the kernel's
// amax into history[0] of its fp8_metas; pass a working copy to keep them
// as they are. INVALID_ARGUMENT for a prompt that is not
// int32 [B, P], options out of range, or a model that cannot decode (naming
// the module); `sink` may be null.
absl::StatusOr<GenerateResult> Generate(Ops& ops, const Layer& model, const Variables& vars,
                                        const Tensor& prompt, const GenerateOptions& options,
                                        const TokenSink& sink);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_GENERATE_H_
