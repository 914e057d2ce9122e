// Training steps sent ahead of their answers, as JAX's async dispatch runs a
// jitted train step (and as the Python client's train_step does,
// client/python/te_client/pipeline.py):
//
//   TrainSteps steps(model, vars);                    // vars: Init's, after SetOptimizer
//   std::vector<PendingStep> sent;
//   for (int i = 0; i < n; ++i) {
//     ApplyOptions options;
//     options.extra_inputs = {labels[i]};
//     sent.push_back(steps.Step(tokens[i], options).value());   // returns once the step is sent
//     if (i % 100 == 0) std::cout << sent[i].Get()->loss;       // waits for that step only
//   }
//   absl::StatusOr<Variables> trained = steps.Wait();
//
// Each step is Module::LossValueAndGrad with apply_update (one ForwardBackward
// of a graph whose y is its float32 loss; no dy, and nothing but the loss and
// the update's UpdateInfo comes back), under the Autocast current when Step is
// called. A step sent while the one before it is in flight reads the layer's
// newest version (ForwardBackwardRequest.version 0): the one that step makes,
// since the session runs its calls in the order they were numbered. So while
// a TrainSteps has steps in flight, nothing else may make versions of its
// layer (a step or SetVariables through other Variables of it): Wait() first.
//
// At most `depth` steps are in flight; Step waits for the oldest beyond that
// (without failing for it). A step the server fails reports the server's
// status from its Get(); the steps sent on top of it report the same code,
// naming it ("not run on the variables the program meant: ..."), and the
// versions they made (they ran on the one before the failed step) are
// released unseen: a failed step never lets a later one change variables().
// Once a failure is known, Step returns it without sending. Thread-compatible;
// a PendingStep may be read from any thread.
#ifndef TE_CLIENT_TRAIN_STEPS_H_
#define TE_CLIENT_TRAIN_STEPS_H_

#include <cstdint>
#include <deque>
#include <future>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/modules.h"

namespace te::client {

struct StepMetrics {
  double loss = 0.0;          // before the update
  te::v1::UpdateInfo update;  // applied, count, learning_rate, grad_norm, ...
};

namespace internal {
struct StepRecord;  // train_steps.cc
}

// One step sent: its metrics once answered. Copies share the step.
class PendingStep {
 public:
  // Waits for this step (and the ones it continues from); the server's
  // status, or that of a failed step it was sent on top of.
  absl::StatusOr<StepMetrics> Get() const;
  // Whether its own answer is here (Get then waits at most for the steps
  // it continues from).
  bool Ready() const;

 private:
  friend class TrainSteps;
  std::shared_ptr<internal::StepRecord> record_;
};

class TrainSteps {
 public:
  // Steps of `module`'s loss graph (which must outlive this object) on the
  // layer `vars` names, from the
  // version `vars` read now (a live handle is read, not moved: the steps'
  // results are values, variables()). depth >= 1 (1: each step is sent once
  // the one before has answered).
  // `donate`: every step donates the version it reads
  // (ForwardBackwardRequest.donate, as jax.jit's donate_argnums): the
  // server updates params and opt_state in place with no copy for it and
  // releases it, so `vars`'s version is gone once the first step runs, and
  // variables() before Wait() may name a version a later step released.
  TrainSteps(const Module& module, const Variables& vars, int depth = 2, bool donate = false);
  // Waits for the steps in flight (their failures dropped).
  ~TrainSteps();
  TrainSteps(const TrainSteps&) = delete;
  TrainSteps& operator=(const TrainSteps&) = delete;

  // Sends the next step on x (options: extra_inputs such as the labels, an
  // attention mask, dropout, graph; apply_update is implied). Returns once it
  // is sent. Errors at once: Send's (a tensor that cannot travel), or the
  // failure of an earlier step once known.
  absl::StatusOr<PendingStep> Step(const HostTensor& x, const ApplyOptions& options = {});
  // Waits for every step sent: the variables after the last one (a value),
  // or the first failure.
  absl::StatusOr<Variables> Wait();
  // The variables after the last step known to have succeeded (a value;
  // `vars` as given before any), as of the last Step or Wait.
  const Variables& variables() const { return current_; }

 private:
  // Settles the oldest step in flight and takes it off the queue (its
  // version becomes variables(), or its failure failed_).
  void SettleFront();

  const Module& module_;
  const int depth_;
  const bool donate_;
  Variables current_;
  absl::Status failed_;
  std::deque<std::shared_ptr<internal::StepRecord>> in_flight_;
  std::deque<std::future<void>> deletes_;  // the steps' uploads, deleted after them
};

// A value (modules.h: Variables) of version `version` of the layer `vars`
// names, held as a step's result is (released when its last copy goes).
// Defined in modules.cc, which holds versions.
Variables ValueAt(const Variables& vars, int64_t version);

}  // namespace te::client

#endif  // TE_CLIENT_TRAIN_STEPS_H_
