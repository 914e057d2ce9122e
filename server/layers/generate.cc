#include "server/layers/generate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"
#include "server/layers/cache.h"

namespace te::layers {
namespace {

absl::Status CheckSampling(const SamplingOptions& o) {
  if (o.greedy) return absl::OkStatus();
  if (!(o.temperature > 0.0f) || !std::isfinite(o.temperature)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.temperature must be positive and finite; got ", o.temperature));
  }
  if (o.top_k < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_k must be >= 0 (0: every token); got ", o.top_k));
  }
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling.top_p must be in (0, 1]; got ", o.top_p));
  }
  return absl::OkStatus();
}

// Uniform in [0, 1) with 53 random bits, from (seed, step, row) alone.
double Uniform(uint64_t seed, int64_t step, int64_t row) {
  const uint64_t bits = MixBits(MixBits(seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(step + 1)) ^
                                static_cast<uint64_t>(row));
  return static_cast<double>(bits >> 11) * (1.0 / 9007199254740992.0);
}

// jnp.argmax: the first maximum, and the first NaN if there is one.
int32_t Argmax(const float* row, int64_t vocab) {
  int64_t best = 0;
  for (int64_t v = 0; v < vocab; ++v) {
    if (std::isnan(row[v])) return static_cast<int32_t>(v);
    if (row[v] > row[best]) best = v;
  }
  return static_cast<int32_t>(best);
}

int32_t Sample(const float* row, int64_t vocab, const SamplingOptions& o, double u) {
  size_t keep = static_cast<size_t>(vocab);
  if (o.top_k > 0) keep = std::min(keep, static_cast<size_t>(o.top_k));
  const std::vector<int32_t> order = MostLikelyFirst(row, vocab, keep);
  // softmax(logits / temperature) over the kept tokens, in double.
  const double top = static_cast<double>(row[order[0]]) / o.temperature;
  std::vector<double> p(keep);
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp(static_cast<double>(row[order[i]]) / o.temperature - top);
    total += p[i];
  }
  if (o.top_p < 1.0f) {
    // The smallest prefix whose probability reaches top_p.
    double mass = 0.0;
    size_t nucleus = 0;
    while (nucleus < keep) {
      mass += p[nucleus++] / total;
      if (mass >= o.top_p) break;
    }
    keep = nucleus;
    total = std::accumulate(p.begin(), p.begin() + keep, 0.0);
  }
  const double target = u * total;
  double cumulative = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    cumulative += p[i];
    if (target < cumulative) return order[i];
  }
  return order[keep - 1];
}

// *last [B, V] = row S - 1 of each sequence of y [B, S, V] (S > 1: the
// prompt's step).
absl::Status GatherLastRows(Ops& ops, const Tensor& y, Tensor* last) {
  const int64_t batch = y.dim(0), seq = y.dim(1), vocab = y.dim(2);
  ASSIGN_OR_RETURN(*last, ops.Allocate(y.dtype(), {batch, vocab}));
  const Tensor rows = y.Reshaped({batch * seq, vocab});
  std::vector<Tensor> from, to;
  for (int64_t b = 0; b < batch; ++b) {
    from.push_back(rows.Slice0(b * seq + seq - 1, b * seq + seq));
    to.push_back(last->Slice0(b, b + 1));
  }
  std::vector<const Tensor*> src;
  std::vector<Tensor*> dst;
  for (size_t i = 0; i < from.size(); ++i) {
    src.push_back(&from[i]);
    dst.push_back(&to[i]);
  }
  return ops.CopyAll(src, dst);
}

// The last position's logits of y [B, S, V], float32 on the host [B * V]
// (a one-token step's y is its own last row: no copy).
absl::StatusOr<std::vector<float>> LastLogits(Ops& ops, const Tensor& y) {
  const int64_t batch = y.dim(0), seq = y.dim(1), vocab = y.dim(2);
  Tensor last = y.Reshaped({batch * seq, vocab});
  if (seq > 1) RETURN_IF_ERROR(GatherLastRows(ops, y, &last));
  Tensor f32 = last;
  if (y.dtype() != DType::kF32) {
    ASSIGN_OR_RETURN(f32, ops.Allocate(DType::kF32, {batch, vocab}));
    RETURN_IF_ERROR(ops.Cast(last, &f32));
  }
  std::vector<float> host(static_cast<size_t>(batch * vocab));
  RETURN_IF_ERROR(ops.Download(f32, host.data()));
  return host;
}

// INVALID_ARGUMENT unless a decode step of `tokens` tokens gave float
// logits [batch, tokens, vocab].
absl::Status CheckLogits(const Tensor& y, int64_t batch, int64_t tokens) {
  if (y.rank() != 3 || y.dim(0) != batch || y.dim(1) != tokens || !IsFloating(y.dtype()) ||
      IsFloat8(y.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: its decode step gave ", ShapeString(y.shape()), " ", DTypeName(y.dtype()),
        "; generation needs float logits [batch, tokens, vocab]"));
  }
  return absl::OkStatus();
}

// Waits, when it goes, for the downloads its completions were armed with
// (and so for all work issued before them); their failures were or will be
// reported by the reads that wait for them.
struct WaitOnExit {
  std::unique_ptr<Ops::Completion> (&completions)[2];
  ~WaitOnExit() {
    for (auto& completion : completions) {
      if (completion != nullptr) (void)completion->Wait();
    }
  }
};

// A float's bits as an unsigned key whose ascending order is the values'
// descending order (-0 as +0, which compare equal).
uint32_t DescendingKey(float v) {
  if (v == 0.0f) v = 0.0f;
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uint32_t ascending = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return ~ascending;
}

}  // namespace

std::vector<int32_t> MostLikelyFirst(const float* row, int64_t vocab, size_t keep) {
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  const bool has_nan = std::any_of(row, row + vocab, [](float v) { return std::isnan(v); });
  if (has_nan || keep * 16 < order.size()) {
    std::iota(order.begin(), order.end(), 0);
    if (has_nan) {
      std::stable_sort(order.begin(), order.end(),
                       [row](int32_t a, int32_t b) { return row[a] > row[b]; });
    } else {
      std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(keep),
                        order.end(), [row](int32_t a, int32_t b) {
                          return row[a] > row[b] || (row[a] == row[b] && a < b);
                        });
    }
  } else {
    // (key, id) in one word, so each pass reads and writes in sequence.
    std::vector<uint64_t> items(order.size()), sorted(order.size());
    for (size_t i = 0; i < items.size(); ++i) {
      items[i] = static_cast<uint64_t>(DescendingKey(row[i])) << 32 | static_cast<uint32_t>(i);
    }
    for (int shift = 32; shift < 64; shift += 8) {
      size_t start[257] = {0};
      for (uint64_t item : items) ++start[((item >> shift) & 0xff) + 1];
      for (int b = 0; b < 256; ++b) start[b + 1] += start[b];
      for (uint64_t item : items) sorted[start[(item >> shift) & 0xff]++] = item;
      items.swap(sorted);
    }
    for (size_t i = 0; i < keep; ++i) order[i] = static_cast<int32_t>(items[i] & 0xffffffffu);
  }
  order.resize(keep);
  return order;
}

absl::StatusOr<std::vector<int32_t>> SampleTokens(const std::vector<float>& logits, int64_t batch,
                                                  int64_t vocab, const SamplingOptions& options,
                                                  int64_t step) {
  RETURN_IF_ERROR(CheckSampling(options));
  if (batch < 1 || vocab < 1 || static_cast<int64_t>(logits.size()) != batch * vocab) {
    return absl::InvalidArgumentError(absl::StrCat("logits: ", logits.size(), " values for ",
                                                   batch, " rows of ", vocab));
  }
  std::vector<int32_t> tokens(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    const float* row = logits.data() + b * vocab;
    tokens[b] = options.greedy ? Argmax(row, vocab)
                               : Sample(row, vocab, options, Uniform(options.seed, step, b));
  }
  return tokens;
}

absl::StatusOr<GenerateResult> Generate(Ops& ops, const Layer& model, const Variables& vars,
                                        const Tensor& prompt, const GenerateOptions& options,
                                        const TokenSink& sink) {
  if (prompt.dtype() != DType::kI32 || prompt.rank() != 2 || prompt.dim(0) < 1 ||
      prompt.dim(1) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt: ", ShapeString(prompt.shape()), " ", DTypeName(prompt.dtype()),
        "; want int32 token ids [batch, length] with both positive"));
  }
  if (options.max_new_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens must be >= 1; got ", options.max_new_tokens));
  }
  RETURN_IF_ERROR(CheckSampling(options.sampling));
  if (!model.TakesTokenIds()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: ", model.type_name(), " does not take token ids; generation feeds it tokens"));
  }
  const int64_t batch = prompt.dim(0), prompt_length = prompt.dim(1);
  // The last new token is not fed back: the caches hold every other one.
  const int64_t length = prompt_length + options.max_new_tokens - 1;
  // The caches are a multiple of 64 rows long: a GPU's fused attention
  // takes a relative bias only over such lengths. Rows past `length` are
  // never visible (every step's kv lengths stop at its own position).
  const int64_t cache_length = (length + 63) / 64 * 64;
  ASSIGN_OR_RETURN(const std::vector<VariableSpec> cache_specs,
                   model.CacheSpecs({batch, cache_length}, DType::kI32, /*internal_decode=*/true));
  Variables working = vars;
  RETURN_IF_ERROR(InitCache(ops, cache_specs, &working));
  // The weights stay put for the whole generation: each is cast to the
  // compute dtype at its first step, not at every step (Ops::CastKept).
  // The memo installed (a session layer's kept casts, which already hold
  // the weights from its last call), or else a fresh one for this call.
  CastMemoScope kept_casts(
      ops, ops.cast_memo() != nullptr ? ops.cast_memo() : std::make_shared<Ops::CastMemo>());

  GenerateResult result;
  result.tokens.resize(static_cast<size_t>(batch));
  result.stopped.assign(static_cast<size_t>(batch), false);
  ForwardOptions opts;
  opts.deterministic = true;
  // No step reads its amaxes back or moves a scale: FP8 steps run as
  // inference (Fp8Recipe::inference: no amax recorded, each kept weight copy
  // checked once, by the prompt's step).
  Fp8Recipe fp8;
  if (options.fp8 != nullptr) {
    fp8 = *options.fp8;
    fp8.inference = true;
    opts.fp8 = &fp8;
  }
  opts.tf32 = options.tf32;
  opts.decode = true;
  opts.internal_decode = true;
  // Shared by every step and attention: the query lengths (the prompt's and
  // 1) in one upload, and the step state (position, kv lengths), uploaded
  // for the prompt and the first one-token step and advanced on the device
  // after; the loop knows the index, so the caches' cache_index is never
  // written (nobody else reads them).
  DecodeContext context;
  context.write_index = false;
  RETURN_IF_ERROR(context.Reserve(ops, batch, {1, prompt_length}));
  opts.decode_context = &context;

  const bool greedy = options.sampling.greedy;
  // Each step's tokens [B, 1], which the next step reads: written on the
  // device by a greedy step (ArgmaxLast), uploaded after a sampled one.
  ASSIGN_OR_RETURN(Tensor next, ops.Allocate(DType::kI32, {batch, 1}));
  // The one-token step recorded at its second run (the first fills the
  // cast memo and the context's constants), and the outputs it writes.
  bool record = options.replay_steps;
  std::unique_ptr<Ops::StepRecord> recorded;
  LayerOutputs recorded_out;
  // Greedy tokens come down through two staging slots, so that step t's are
  // read while step t + 1 runs; whatever a return leaves in flight finishes
  // before the slots and the step's buffers go.
  std::shared_ptr<void> staging;
  std::unique_ptr<Ops::Completion> landed[2];
  if (greedy) {
    ASSIGN_OR_RETURN(staging, ops.AllocateStaging(2 * batch * sizeof(int32_t)));
    for (auto& completion : landed) {
      ASSIGN_OR_RETURN(completion, ops.NewCompletion());
    }
  }
  const WaitOnExit drain{landed};
  auto slot = [&](int64_t step) { return static_cast<int32_t*>(staging.get()) + (step % 2) * batch; };
  Tensor logits;  // a sampled step's logits [B, S, V], read on the host

  // Issues step `step` (0: the prompt, [B, P] at position 0; then one token
  // at position P + step - 1) without waiting for it. A one-token step ends
  // with its greedy tokens in `next` and the step state one position
  // further, so every one-token step issues the same launches.
  auto issue = [&](int64_t step) -> absl::Status {
    RETURN_IF_ERROR(ops.CheckInterrupt());
    const int64_t tokens = step == 0 ? prompt_length : 1;
    const int64_t position = step == 0 ? 0 : prompt_length + step - 1;
    opts.decode_cache_index = position;
    // The prompt's state, then the first one-token step's; later steps
    // advance it on the device.
    if (step <= 1) RETURN_IF_ERROR(context.SetStep(ops, batch, position, tokens));
    LayerInputs in;
    in.x = step == 0 ? prompt : next;
    LayerOutputs out;
    if (step == 0) {
      RETURN_IF_ERROR(model.Forward(ops, &working, in, opts, &out, nullptr));
      RETURN_IF_ERROR(CheckLogits(out.y, batch, tokens));
      if (greedy) {
        Tensor last;
        RETURN_IF_ERROR(GatherLastRows(ops, out.y, &last));
        RETURN_IF_ERROR(ops.ArgmaxLast(last, &next));
      }
    } else {
      auto one_token = [&](LayerOutputs* to) -> absl::Status {
        RETURN_IF_ERROR(model.Forward(ops, &working, in, opts, to, nullptr));
        RETURN_IF_ERROR(CheckLogits(to->y, batch, 1));
        if (greedy) RETURN_IF_ERROR(ops.ArgmaxLast(to->y, &next));
        return context.AdvanceOneToken(ops);
      };
      if (step >= 2 && record && recorded == nullptr) {
        const uint64_t before_recording = ops.cast_memo()->stamp();
        absl::StatusOr<std::unique_ptr<Ops::StepRecord>> made =
            ops.CaptureStep([&] { return one_token(&recorded_out); });
        if (made.ok()) {
          recorded = *std::move(made);
        } else {
          record = false;
          recorded_out = LayerOutputs();
          if (!absl::IsUnimplemented(made.status())) {
            // Nothing recorded ran: the copy of a weight first cast while
            // recording was never made, so it goes.
            result.record_status = made.status();
            ops.cast_memo()->ForgetSince(before_recording);
          }
        }
      }
      if (recorded != nullptr) {
        RETURN_IF_ERROR(ops.Replay(*recorded));
        out = recorded_out;
        ++result.replayed_steps;
      } else {
        RETURN_IF_ERROR(one_token(&out));
      }
    }
    if (greedy) return ops.DownloadAsync(next, slot(step), landed[step % 2].get());
    logits = out.y;
    return absl::OkStatus();
  };
  // Step `step`'s tokens, once it has run.
  auto read = [&](int64_t step) -> absl::StatusOr<std::vector<int32_t>> {
    if (greedy) {
      RETURN_IF_ERROR(landed[step % 2]->Wait());
      return std::vector<int32_t>(slot(step), slot(step) + batch);
    }
    ASSIGN_OR_RETURN(const std::vector<float> host, LastLogits(ops, logits));
    return SampleTokens(host, batch, logits.dim(2), options.sampling, step);
  };

  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(issue(0));
  result.prompt_queued = absl::Now() - start;
  for (int64_t step = 0; step < options.max_new_tokens; ++step) {
    const bool last_step = step + 1 == options.max_new_tokens;
    // A greedy step reads its tokens on the device: it is queued before the
    // host reads the last step's, so the device never waits for the host.
    // Not after the prompt's, whose tokens go out first: the first one-token
    // step is issued launch by launch, as slow on the host as the prompt's
    // step is on the device.
    const bool queue_ahead = greedy && !last_step && step > 0;
    if (queue_ahead) RETURN_IF_ERROR(issue(step + 1));
    ASSIGN_OR_RETURN(std::vector<int32_t> tokens, read(step));
    if (step == 0) result.first_token = absl::Now() - start;
    for (int64_t b = 0; b < batch; ++b) {
      if (result.stopped[b]) {
        tokens[b] = result.tokens[b].back();
        continue;
      }
      result.tokens[b].push_back(tokens[b]);
      result.stopped[b] = std::find(options.stop_tokens.begin(), options.stop_tokens.end(),
                                    tokens[b]) != options.stop_tokens.end();
    }
    if (sink) RETURN_IF_ERROR(sink(step, tokens));
    const bool all_stopped =
        std::all_of(result.stopped.begin(), result.stopped.end(), [](bool s) { return s; });
    if (all_stopped || last_step) break;
    if (!greedy) {
      // The step has finished (its logits were read), so `next` is free.
      RETURN_IF_ERROR(ops.Upload(tokens.data(), &next));
    }
    if (!queue_ahead) RETURN_IF_ERROR(issue(step + 1));
  }
  kept_casts.Commit();
  return result;
}

}  // namespace te::layers
