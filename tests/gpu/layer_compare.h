// Runs one layer on two backends (a reference and a candidate Ops) from the
// same variables and inputs, step by step as the server's session does
// (Forward with keep_for_backward, Backward, UpdateFp8Metas), and measures how
// far the candidate's outputs, gradients and variables are from the
// reference's: relative error ||candidate - reference|| / ||reference||.
//
// The variables are initialised once on the reference, their bytes copied to
// the candidate (Download, then Upload), so both start from identical state.
// Everything here is test-only and thread-compatible.
#ifndef TE_TESTS_GPU_LAYER_COMPARE_H_
#define TE_TESTS_GPU_LAYER_COMPARE_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/layers/layer.h"
#include "tests/gpu/layer_cases.h"

namespace te::layers::compare {

// ---- copies between backends --------------------------------------------------

// `t`'s bytes in host memory (a tensor with its own storage).
absl::StatusOr<Tensor> ToHost(Ops& ops, const Tensor& t);
// `t`'s values as float32 (float dtypes).
absl::StatusOr<std::vector<float>> HostValues(Ops& ops, const Tensor& t);
// A new tensor on `to` with `t`'s dtype, shape and bytes.
absl::StatusOr<Tensor> CopyTensor(Ops& from, const Tensor& t, Ops& to);
// Every variable copied byte for byte.
absl::StatusOr<Variables> CopyVariables(Ops& from, const Variables& vars, Ops& to);

// ||got - want|| / ||want|| (||got|| when want is all zeros); +inf when the
// sizes differ or either side holds a NaN or an infinity.
double RelativeError(const std::vector<float>& got, const std::vector<float>& want);

// ---- one run on two backends ---------------------------------------------------

// What one backend holds for a run.
struct BackendState {
  Ops* ops = nullptr;
  Variables vars;
  LayerInputs inputs;
  Tensor dy;
};

struct PreparedRun {
  std::unique_ptr<Layer> layer;
  std::optional<Fp8Recipe> fp8;
  bool tf32 = false;  // the call's matmul precision: DEFAULT for a tf32 case
  BackendState reference, candidate;
  const Fp8Recipe* recipe() const { return fp8 ? &*fp8 : nullptr; }
};

// Builds the layer, initialises its variables on `reference` (Init with
// `seed`, then every param that Init left constant, such as biases and norm
// scales, redrawn around its value so no gradient check sees zeros or ones),
// makes random inputs (x, k/v, seqlens) and dy in the run's dtype, and copies
// all of it to `candidate`.
absl::StatusOr<PreparedRun> Prepare(Ops& reference, Ops& candidate, const CaseRun& run,
                                    uint64_t seed = 1);

// Key -> the worst relative error over the steps. Keys: "y", "ln_out", "dx",
// "dextra[i]" (dk, dv), "grad <param>" for each parameter gradient, and each
// variable's own name ("fp8_metas/..._scale", "params/...") after the step's
// FP8 update. Each with the compared tensor's dtype, which its bound depends on.
struct Compared {
  double error = 0.0;
  DType dtype = DType::kF32;
};
using Errors = std::map<std::string, Compared>;

// `steps` ForwardBackward steps on both sides, on the same inputs each step:
// Forward (keep_for_backward), Backward with dy, UpdateFp8Metas under FP8, as
// Session::Step does. INTERNAL when the sides disagree on what exists (a
// gradient or variable on one side only, a shape or dtype that differs), or
// a layer call's error.
absl::StatusOr<Errors> StepAndCompare(PreparedRun* run, int steps);

// ---- judging ------------------------------------------------------------------

// Relative-error bounds by the kind of run and of output.
struct Tolerances {
  double f32_single_op = 0.0;  // modules that are one op (norm, GEMM, activation, attention)
  double f32_composed = 0.0;   // several ops chained
  double bf16_single_op = 0.0;
  double bf16_composed = 0.0;
  // A bfloat16 tensor of a float32 run (bf16 params and their gradients
  // beside float32 activations): float32 values rounded once to bfloat16.
  double f32_run_bf16_tensor = 0.0;
  double fp8_values = 0.0;  // y, dx and gradients of FP8 runs
  double fp8_metas = 0.0;   // amax histories and scales
};
double ToleranceFor(const Tolerances& tol, const CaseRun& run, const std::string& key,
                    DType stored);

// Success iff every error is within its tolerance; the failure lists each key
// over it with its error and bound.
::testing::AssertionResult AllWithin(const Tolerances& tol, const CaseRun& run,
                                     const Errors& errors);

// "worst y/dx/grad: <key> <err>; worst fp8_metas: <key> <err>", for the log.
std::string Summary(const Errors& errors);

// Whether a step moved the FP8 state off its init (so a comparison of it
// compares something): some amax_history holds a non-zero amax, and some
// scale is no longer 1.
struct Fp8StateMovement {
  bool amax_recorded = false;
  bool scale_updated = false;
};
absl::StatusOr<Fp8StateMovement> Fp8StateMoved(Ops& ops, const Variables& vars);

}  // namespace te::layers::compare

#endif  // TE_TESTS_GPU_LAYER_COMPARE_H_
