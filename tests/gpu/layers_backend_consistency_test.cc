// The comparison harness of layers_gpu_test, run here without a GPU: the CPU
// backend against a second CPU backend instance, on every run that the GPU
// test makes (tests/gpu/layer_cases.h), the 20-step FP8 runs included. The two
// sides run the same code on the same bytes, so every error must be exactly
// 0; what this proves is that the runs are well-formed (every spec, input
// shape and mask is accepted), that the copy of variables and inputs between
// two Ops is exact, and that the step harness compares what it claims to:
// perturbing the candidate's state must show up as an error.
#include <cstdint>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/ops.h"
#include "tests/gpu/layer_cases.h"
#include "tests/gpu/layer_compare.h"

namespace te::layers::compare {
namespace {

// Same code, same bytes, same order of operations: bit-identical.
constexpr Tolerances kExact = {};

class BackendConsistencyTest : public ::testing::TestWithParam<CaseRun> {
 protected:
  CpuOps reference_;
  CpuOps candidate_;

  void CompareExactly(const CaseRun& run) {
    absl::StatusOr<PreparedRun> prepared = Prepare(reference_, candidate_, run);
    ASSERT_TRUE(prepared.ok()) << prepared.status();
    absl::StatusOr<Errors> errors = StepAndCompare(&*prepared, run.steps);
    ASSERT_TRUE(errors.ok()) << errors.status();
    // What a run must compare: y, dx, and a gradient per parameter.
    ASSERT_GT(errors->count("y"), 0u);
    if (run.layer_case.token_vocab == 0) {
      ASSERT_GT(errors->count("dx"), 0u);
    }
    for (const auto& [name, tensor] : prepared->reference.vars) {
      if (absl::StartsWith(name, "params/")) {
        EXPECT_GT(errors->count("grad " + name), 0u) << name;
      }
    }
    EXPECT_EQ(errors->count("dextra[0]"), run.layer_case.extra_shapes.empty() ? 0u : 1u);
    EXPECT_TRUE(AllWithin(kExact, run, *errors));
    if (run.fp8) {
      absl::StatusOr<Fp8StateMovement> moved = Fp8StateMoved(reference_, prepared->reference.vars);
      ASSERT_TRUE(moved.ok()) << moved.status();
      EXPECT_TRUE(moved->amax_recorded);
      EXPECT_TRUE(moved->scale_updated);
    }
  }
};

std::string RunName(const ::testing::TestParamInfo<CaseRun>& info) { return info.param.name(); }

TEST_P(BackendConsistencyTest, SecondCpuBackendMatchesExactly) { CompareExactly(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Layers, BackendConsistencyTest, ::testing::ValuesIn(AllCaseRuns()),
                         RunName);

class Fp8StateConsistencyTest : public BackendConsistencyTest {};

TEST_P(Fp8StateConsistencyTest, TwentyStepsMatchExactly) {
  ASSERT_EQ(GetParam().steps, kFp8StateSteps);
  CompareExactly(GetParam());
}

INSTANTIATE_TEST_SUITE_P(TwentySteps, Fp8StateConsistencyTest, ::testing::ValuesIn(Fp8StateRuns()),
                         RunName);

// ---- the runs cover every module ------------------------------------------------

TEST(LayerCasesTest, EveryModuleOfLayerSpecIsRunInBothDtypesAndFp8WhereItHasGemms) {
  const google::protobuf::OneofDescriptor* module =
      te::v1::LayerSpec::descriptor()->FindOneofByName("module");
  ASSERT_NE(module, nullptr);
  std::set<int> f32, bf16, fp8;
  for (const CaseRun& run : AllCaseRuns()) {
    const int field = static_cast<int>(run.layer_case.spec.module_case());
    (run.fp8 ? fp8 : run.dtype == DType::kF32 ? f32 : bf16).insert(field);
  }
  for (int i = 0; i < module->field_count(); ++i) {
    const google::protobuf::FieldDescriptor* field = module->field(i);
    EXPECT_EQ(f32.count(field->number()), 1u) << field->name() << " has no f32 run";
    EXPECT_EQ(bf16.count(field->number()), 1u) << field->name() << " has no bf16 run";
  }
  for (te::v1::LayerSpec::ModuleCase gemm_module :
       {te::v1::LayerSpec::kDenseGeneral, te::v1::LayerSpec::kLayerNormDenseGeneral,
        te::v1::LayerSpec::kLayerNormMlp, te::v1::LayerSpec::kMultiHeadAttention,
        te::v1::LayerSpec::kTransformerLayer}) {
    EXPECT_EQ(fp8.count(gemm_module), 1u) << "module " << gemm_module << " has no FP8 run";
  }
}

TEST(LayerCasesTest, RunNamesAreUnique) {
  std::set<std::string> names;
  for (const CaseRun& run : AllCaseRuns())
    EXPECT_TRUE(names.insert(run.name()).second) << run.name();
}

// ---- the copy path and the comparison can fail ------------------------------------

TEST(CopyTest, CopyTensorKeepsBytesForEveryDType) {
  CpuOps from, to;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kE4M3, DType::kE5M2,
                      DType::kI32, DType::kBool}) {
    absl::StatusOr<Tensor> t = from.Allocate(dtype, {3, 37});
    ASSERT_TRUE(t.ok());
    for (size_t i = 0; i < t->nbytes(); ++i) {
      t->data_as<uint8_t>()[i] = static_cast<uint8_t>(i * 37 + 11);
    }
    absl::StatusOr<Tensor> copy = CopyTensor(from, *t, to);
    ASSERT_TRUE(copy.ok()) << copy.status();
    EXPECT_EQ(copy->dtype(), dtype);
    EXPECT_EQ(copy->shape(), t->shape());
    EXPECT_NE(copy->data(), t->data());
    EXPECT_EQ(0, std::memcmp(copy->data(), t->data(), t->nbytes())) << DTypeName(dtype);
  }
}

TEST(CompareTest, RelativeErrorFlagsNonFiniteAndSizeMismatch) {
  EXPECT_EQ(RelativeError({1.0f, 2.0f}, {1.0f, 2.0f}), 0.0);
  EXPECT_NEAR(RelativeError({3.0f, 4.0f}, {3.0f, 0.0f}), 4.0 / 3.0, 1e-12);
  EXPECT_EQ(RelativeError({1.0f, NAN}, {1.0f, NAN}), INFINITY);
  EXPECT_EQ(RelativeError({1.0f}, {1.0f, 2.0f}), INFINITY);
  EXPECT_EQ(RelativeError({0.5f}, {0.0f}), 0.5);  // a zero reference: the absolute norm
}

// A run whose candidate was prepared like the reference but then changed.
class PerturbedRunTest : public ::testing::Test {
 protected:
  CpuOps reference_, candidate_;

  PreparedRun PrepareRun(const CaseRun& run) {
    absl::StatusOr<PreparedRun> prepared = Prepare(reference_, candidate_, run);
    EXPECT_TRUE(prepared.ok()) << prepared.status();
    return *std::move(prepared);
  }

  static CaseRun Fp8Transformer() {
    CaseRun run = Fp8StateRuns().front();
    run.steps = 2;
    return run;
  }

  // Adds `delta` to element `index` of the candidate's variable `name`.
  void Nudge(PreparedRun* run, const std::string& name, int64_t index, float delta) {
    ASSERT_EQ(run->candidate.vars.count(name), 1u) << name;
    Tensor& t = run->candidate.vars[name];
    StoreFromFloat(&t, index, LoadAsFloat(t, index) + delta);
  }

  // The first variable whose name ends with `suffix`.
  static std::string Find(const PreparedRun& run, const std::string& suffix) {
    for (const auto& [name, tensor] : run.candidate.vars) {
      if (absl::EndsWith(name, suffix)) return name;
    }
    ADD_FAILURE() << "no variable ending with " << suffix;
    return "";
  }
};

TEST_F(PerturbedRunTest, ChangedParameterShowsInOutputsAndGradients) {
  const CaseRun run = Fp8Transformer();
  PreparedRun prepared = PrepareRun(run);
  const std::string kernel = Find(prepared, "/wo_kernel");
  Nudge(&prepared, kernel, 0, 0.25f);
  absl::StatusOr<Errors> errors = StepAndCompare(&prepared, 1);
  ASSERT_TRUE(errors.ok()) << errors.status();
  EXPECT_GT(errors->at("y").error, 0.0);
  EXPECT_GT(errors->at("dx").error, 0.0);
  EXPECT_GT(errors->at(kernel).error, 0.0);
  EXPECT_FALSE(AllWithin(kExact, run, *errors));
}

TEST_F(PerturbedRunTest, ChangedAmaxHistoryShowsInFp8Metas) {
  const CaseRun run = Fp8Transformer();
  PreparedRun prepared = PrepareRun(run);
  // A past amax far above the current ones: the update's max over the window
  // takes it, so the scale differs too. Element 2: a step writes element 0,
  // and the update's roll (new[i] = old[i + 1], then new[0] = 0) clears
  // what was element 1 but keeps element 2, as element 1.
  const std::string history = Find(prepared, "/x_amax_history");
  const std::string scale = history.substr(0, history.size() - 13) + "_scale";
  Nudge(&prepared, history, 2, 1000.0f);
  absl::StatusOr<Errors> errors = StepAndCompare(&prepared, 1);
  ASSERT_TRUE(errors.ok()) << errors.status();
  EXPECT_GT(errors->at(history).error, 0.0);
  EXPECT_GT(errors->at(scale).error, 0.0) << scale;
  EXPECT_FALSE(AllWithin(kExact, run, *errors));
}

TEST_F(PerturbedRunTest, VariableOnOneSideOnlyIsAnError) {
  PreparedRun prepared = PrepareRun(Fp8Transformer());
  prepared.reference.vars["params/extra"] = prepared.reference.vars.begin()->second;
  absl::StatusOr<Errors> errors = StepAndCompare(&prepared, 1);
  ASSERT_FALSE(errors.ok());
  EXPECT_TRUE(absl::IsInternal(errors.status())) << errors.status();
  EXPECT_TRUE(absl::StrContains(errors.status().message(), "params/extra")) << errors.status();
}

}  // namespace
}  // namespace te::layers::compare
