// Flax's modules on the CUDA backend against the CPU reference: identical
// variables and inputs (made on the CPU, their bytes copied to the GPU), a
// forward and a backward on each, and y, dx (dk, dv) and every parameter
// gradient compared. The cases take the paths the Flax dtype rules open on
// the GPU: a norm that reads bfloat16 x with float32 params and writes
// float32 y, float32 GEMMs, float32 attention with a head_dim cuDNN does not
// take (the unfused kernels), bfloat16 attention through cuDNN, and the
// quickstart's plain-Flax layer as a graph at small, odd sizes. Then the
// quickstart's layer at its real size (hidden 4096, 32 heads, seq 2048,
// batch 4, bfloat16 x), timed per forward + backward step.
//
// Deterministic runs only: cuDNN draws dropout from its own stream. Needs a
// GPU: without one every test is skipped, unless TE_REQUIRE_GPU=1 (as
// deploy/bundle.sh's run.sh sets).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"
#include "server/layers/flax_modules.h"
#include "server/layers/layer.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::RandomizeParams;
using testing::RandomTensor;
using testing::RelativeError;
using testing::Values;

// Relative errors ||gpu - cpu|| / ||cpu||. Most cases compute in float32
// (the promoted dtype) at precision HIGHEST, exact float32 on both backends,
// so only the order of float32 sums differs; chained ops and backward's
// cancellations can take that past 1e-5, 1e-4 still flags a real error.
constexpr double kF32Tolerance = 1e-4;
// Precision DEFAULT on the GPU: TensorFloat-32 products (operands rounded to
// 10 mantissa bits: 2^-11 relative each) against the CPU's exact float32;
// over K-long sums the errors average down to a few 1e-4.
constexpr double kTf32Tolerance = 5e-3;
// bfloat16 compute: one-ulp differences (2^-8) where the backends' float32
// values straddle a rounding boundary, compounded over the chain.
constexpr double kBF16Tolerance = 2e-2;

// A tensor stored in bfloat16 (dx of a bfloat16 x) holds float32 values
// rounded once: where the backends' values straddle a rounding boundary they
// land one bfloat16 ulp apart.
double ToleranceOf(DType stored) { return stored == DType::kBF16 ? kBF16Tolerance : 0.0; }

using Backends = testing::GpuBackends;

Backends& GetBackends() { return testing::GetGpuBackends(int64_t{96} << 30); }

using testing::DeviceValues;
using testing::StepOutputs;
using testing::ToDevice;

te::v1::LayerSpec Dense(int64_t features, te::v1::Precision precision = te::v1::PRECISION_HIGHEST) {
  te::v1::LayerSpec spec;
  spec.mutable_flax_dense()->set_features(features);
  spec.mutable_flax_dense()->set_precision(precision);
  return spec;
}
te::v1::LayerSpec Norm() {
  te::v1::LayerSpec spec;
  spec.mutable_flax_layer_norm()->set_epsilon(1e-5f);
  return spec;
}
te::v1::LayerSpec Mha(int heads, int64_t qkv, te::v1::DType param_dtype = te::v1::DTYPE_UNSPECIFIED,
                      te::v1::Precision precision = te::v1::PRECISION_HIGHEST) {
  te::v1::LayerSpec spec;
  auto* m = spec.mutable_flax_multi_head_dot_product_attention();
  m->set_num_heads(heads);
  m->set_qkv_features(qkv);
  m->set_param_dtype(param_dtype);
  m->set_precision(precision);
  return spec;
}

te::v1::GraphSpec::Node* Add(te::v1::GraphSpec* g, const std::string& name,
                             std::vector<std::string> in, std::vector<std::string> out) {
  auto* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& s : in) node->add_inputs(s);
  for (const std::string& s : out) node->add_outputs(s);
  return node;
}

// TE's quickstart FlaxTransformerLayer as its tracer records it (as in
// flax_modules_test.cc), dropout rates 0.1, its matmuls at `precision`.
te::v1::LayerSpec Quickstart(int64_t batch, int64_t seq, int64_t hidden, int heads, int64_t ffn,
                             te::v1::Precision precision = te::v1::PRECISION_HIGHEST) {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* g = spec.mutable_graph();
  const int64_t kv = hidden / heads;
  Add(g, "causal_mask", {"x"}, {"mask"})->mutable_causal_mask();
  *Add(g, "LayerNorm_0", {"x"}, {"ln0"})->mutable_module() = Norm();
  *Add(g, "Dense_0", {"ln0"}, {"qkv"})->mutable_module() = Dense(3 * hidden, precision);
  auto* r = Add(g, "reshape_qkv", {"qkv"}, {"qkv4"})->mutable_reshape();
  for (int64_t d : {batch, seq, int64_t{heads}, 3 * kv}) r->add_shape(d);
  auto* split = Add(g, "split_qkv", {"qkv4"}, {"q4", "k4", "v4"})->mutable_split();
  split->set_axis(3);
  split->set_parts(3);
  for (const char* t : {"q", "k", "v"}) {
    auto* flat = Add(g, std::string("reshape_") + t, {std::string(t) + "4"}, {t})->mutable_reshape();
    for (int64_t d : {batch, seq, hidden}) flat->add_shape(d);
  }
  auto* attention = Add(g, "MultiHeadDotProductAttention_0", {"q", "k", "v"}, {"attn"});
  *attention->mutable_module() = Mha(heads, kv, te::v1::DTYPE_UNSPECIFIED, precision);
  attention->mutable_module()->mutable_flax_multi_head_dot_product_attention()->set_dropout_rate(0.1f);
  attention->set_mask("mask");
  Add(g, "Dropout_0", {"attn"}, {"attn_d"})->mutable_dropout()->set_rate(0.1f);
  Add(g, "cast_res", {"x"}, {"res0"})->mutable_cast()->set_dtype(te::v1::FLOAT32);
  Add(g, "add_0", {"res0", "attn_d"}, {"h"})->mutable_add();
  *Add(g, "LayerNorm_1", {"h"}, {"ln1"})->mutable_module() = Norm();
  *Add(g, "FlaxMLP_0/Dense_0", {"ln1"}, {"f1"})->mutable_module() = Dense(ffn, precision);
  Add(g, "FlaxMLP_0/gelu", {"f1"}, {"g"})->mutable_module()->mutable_activation()->add_activations("gelu");
  *Add(g, "FlaxMLP_0/Dense_1", {"g"}, {"f2"})->mutable_module() = Dense(hidden, precision);
  Add(g, "Dropout_1", {"f2"}, {"f2_d"})->mutable_dropout()->set_rate(0.1f);
  Add(g, "add_1", {"h", "f2_d"}, {"y"})->mutable_add();
  g->add_outputs("y");
  return spec;
}

struct Case {
  std::string name;
  te::v1::LayerSpec spec;
  Shape x;
  DType dtype;
  std::vector<Shape> extra;
  double tolerance;
};

class FlaxModulesGpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Backends& b = GetBackends();
    if (b.gpu == nullptr) TE_SKIP_OR_FAIL_WITHOUT_GPU("no CUDA device: " << b.unavailable);
    cpu_ = b.cpu.get();
    gpu_ = b.gpu.get();
  }

  void Compare(const Case& c) {
    SCOPED_TRACE(c.name);
    auto layer = CreateLayer(c.spec);
    ASSERT_TRUE(layer.ok()) << layer.status();
    auto cpu_vars = testing::InitLayer(*cpu_, **layer, c.x, nullptr, 7);
    ASSERT_TRUE(cpu_vars.ok()) << cpu_vars.status();
    RandomizeParams(*cpu_, &*cpu_vars, 50, 0.5f);
    Variables gpu_vars;
    for (const auto& [name, t] : *cpu_vars) {
      auto g = ToDevice(*gpu_, t);
      ASSERT_TRUE(g.ok()) << g.status();
      gpu_vars[name] = *g;
    }
    LayerInputs cpu_in, gpu_in;
    cpu_in.x = RandomTensor(*cpu_, c.x, c.dtype, 1);
    uint64_t seed = 2;
    for (const Shape& s : c.extra) cpu_in.extra.push_back(RandomTensor(*cpu_, s, c.dtype, seed++));
    auto gx = ToDevice(*gpu_, cpu_in.x);
    ASSERT_TRUE(gx.ok());
    gpu_in.x = *gx;
    for (const Tensor& e : cpu_in.extra) gpu_in.extra.push_back(*ToDevice(*gpu_, e));
    auto y_shape = (*layer)->OutputShape(c.x);
    ASSERT_TRUE(y_shape.ok());
    const Tensor cpu_dy = RandomTensor(*cpu_, *y_shape, (*layer)->OutputDType(c.dtype), 9);
    // Every call at JAX's default precision: the HIGHEST modules stay exact.
    auto ref = testing::TrainingStep(*cpu_, **layer, &*cpu_vars, cpu_in, cpu_dy, /*tf32=*/true);
    ASSERT_TRUE(ref.ok()) << ref.status();
    auto got = testing::TrainingStep(*gpu_, **layer, &gpu_vars, gpu_in, *ToDevice(*gpu_, cpu_dy),
                                     /*tf32=*/true);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_TRUE(gpu_->Synchronize().ok());
    EXPECT_EQ(got->y.dtype(), ref->y.dtype());
    std::map<std::string, double> errors;
    std::map<std::string, DType> dtypes;
    auto compare = [&](const std::string& name, const Tensor& gpu, const Tensor& cpu) {
      errors[name] = RelativeError(DeviceValues(*gpu_, *cpu_, gpu), Values(cpu));
      dtypes[name] = cpu.dtype();
    };
    compare("y", got->y, ref->y);
    compare("dx", got->dx, ref->dx);
    for (size_t i = 0; i < ref->dextra.size(); ++i) {
      compare("dextra[" + std::to_string(i) + "]", got->dextra[i], ref->dextra[i]);
    }
    for (const auto& [name, g] : ref->grads) {
      if (testing::IsKeyBiasGradient(name)) {
        // Judged by its size: testing.h's ZeroGradientError.
        errors[name] = testing::ZeroGradientError(DeviceValues(*gpu_, *cpu_, got->grads.at(name)),
                                                  Values(g),
                                                  Values(ref->grads.at(testing::KeyKernelOf(name))));
        dtypes[name] = g.dtype();
        continue;
      }
      compare(name, got->grads.at(name), g);
    }
    std::string summary;
    for (const auto& [name, e] : errors) {
      summary += " " + name + "=" + std::to_string(e);
      EXPECT_LT(e, std::max(c.tolerance, ToleranceOf(dtypes[name]))) << name;
    }
    std::printf("%s:%s\n", c.name.c_str(), summary.c_str());
  }

  Ops* cpu_ = nullptr;
  Ops* gpu_ = nullptr;
};

TEST_F(FlaxModulesGpuTest, ModulesMatchTheCpu) {
  te::v1::LayerSpec general;
  general.mutable_flax_dense_general()->add_features(4);
  general.mutable_flax_dense_general()->add_features(24);
  general.mutable_flax_dense_general()->add_axis(1);
  general.mutable_flax_dense_general()->set_precision(te::v1::PRECISION_HIGHEST);
  const std::vector<Case> cases = {
      {"LayerNorm_bf16_x", Norm(), {74, 100}, DType::kBF16, {}, kF32Tolerance},
      {"Dense_bf16_x", Dense(96), {2, 37, 100}, DType::kBF16, {}, kF32Tolerance},
      {"DenseGeneral_axis1", general, {2, 37, 10}, DType::kF32, {}, kF32Tolerance},
      // head_dim 6: cuDNN wants a multiple of 8, the unfused kernels run.
      {"MHDPA_f32_head_dim_6", Mha(4, 24), {2, 37, 96}, DType::kF32, {}, kF32Tolerance},
      {"MHDPA_f32_cross", Mha(4, 32), {2, 37, 96}, DType::kF32, {{2, 29, 96}, {2, 29, 96}},
       kF32Tolerance},
      // bfloat16 params and x: bfloat16 compute, cuDNN's attention.
      {"MHDPA_bf16_cudnn", Mha(4, 96, te::v1::BFLOAT16), {2, 37, 96}, DType::kBF16, {},
       kBF16Tolerance},
      {"Quickstart_bf16_x", Quickstart(2, 37, 96, 4, 160), {2, 37, 96}, DType::kBF16, {},
       kF32Tolerance},
      // JAX's default precision: TensorFloat-32 GEMMs on the GPU.
      {"Dense_tf32", Dense(96, te::v1::PRECISION_DEFAULT), {2, 37, 100}, DType::kF32, {},
       kTf32Tolerance},
      {"Quickstart_tf32", Quickstart(2, 37, 96, 4, 160, te::v1::PRECISION_DEFAULT), {2, 37, 96},
       DType::kBF16, {}, kTf32Tolerance},
  };
  for (const Case& c : cases) Compare(c);
}

// Milliseconds per forward + backward step of `layer` on x (filled with 0.5)
// and dy (0.01), the mean of kTimed steps after kWarmup.
double StepMs(Ops& ops, const Layer& layer, const Shape& shape, DType dtype, bool deterministic) {
  constexpr int kWarmup = 2, kTimed = 5;
  Variables vars;
  EXPECT_TRUE(layer.Init(ops, 1, shape, nullptr, &vars).ok());
  auto x = ops.Allocate(dtype, shape);
  auto y_shape = layer.OutputShape(shape);
  EXPECT_TRUE(x.ok() && y_shape.ok());
  auto dy = ops.Allocate(layer.OutputDType(dtype), *y_shape);
  EXPECT_TRUE(dy.ok());
  EXPECT_TRUE(ops.Fill(0.5f, &*x).ok());
  EXPECT_TRUE(ops.Fill(0.01f, &*dy).ok());
  ForwardOptions opts;
  opts.keep_for_backward = true;
  opts.deterministic = deterministic;
  opts.tf32 = true;  // JAX's default: the modules' own precision decides
  double total_ms = 0.0;
  for (int it = 0; it < kWarmup + kTimed; ++it) {
    opts.dropout_seed = static_cast<uint64_t>(it);
    EXPECT_TRUE(ops.Synchronize().ok());
    const auto start = std::chrono::steady_clock::now();
    LayerOutputs out;
    std::unique_ptr<SavedForward> saved;
    absl::Status s = layer.Forward(ops, &vars, {*x}, opts, &out, &saved);
    EXPECT_TRUE(s.ok()) << s;
    if (!s.ok()) return 0.0;
    LayerGrads grads;
    s = layer.Backward(ops, &vars, *saved, *dy, &grads);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_TRUE(ops.Synchronize().ok());
    if (it >= kWarmup) {
      total_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                      .count();
    }
  }
  return total_ms / kTimed;
}

// The reference workload's plain-Flax layer through the graph, timed as the
// quickstart's speedometer times a step (forward + backward of vdot(y, dy)),
// with dropout off and on; then its attention and its largest GEMM alone.
TEST_F(FlaxModulesGpuTest, QuickstartStepTime) {
  constexpr int64_t kBatch = 4, kSeq = 2048, kHidden = 4096, kFfn = 16384;
  constexpr int kHeads = 32;
  const Shape shape = {kBatch, kSeq, kHidden};
  for (te::v1::Precision precision : {te::v1::PRECISION_DEFAULT, te::v1::PRECISION_HIGHEST}) {
    auto layer = CreateLayer(Quickstart(kBatch, kSeq, kHidden, kHeads, kFfn, precision));
    ASSERT_TRUE(layer.ok()) << layer.status();
    for (bool deterministic : {true, false}) {
      std::printf("quickstart plain-Flax graph, B4 S2048 H4096 heads 32 ffn 16384, bf16 x, %s: "
                  "%.2f ms per forward + backward step (%s)\n",
                  precision == te::v1::PRECISION_DEFAULT ? "precision DEFAULT (TF32 GEMMs)"
                                                         : "precision HIGHEST (float32 GEMMs)",
                  StepMs(*gpu_, **layer, shape, DType::kBF16, deterministic),
                  deterministic ? "deterministic" : "dropout 0.1");
    }
  }
  te::v1::LayerSpec causal_mha;
  *causal_mha.mutable_flax_multi_head_dot_product_attention() =
      Mha(kHeads, kHidden / kHeads).flax_multi_head_dot_product_attention();
  auto mha = MakeFlaxMultiHeadDotProductAttention(causal_mha.flax_multi_head_dot_product_attention(),
                                                  /*causal=*/true);
  ASSERT_TRUE(mha.ok()) << mha.status();
  std::printf("  its MultiHeadDotProductAttention_0 alone (float32, head_dim 4, causal): %.2f ms\n",
              StepMs(*gpu_, **mha, shape, DType::kF32, true));
  for (te::v1::Precision precision : {te::v1::PRECISION_DEFAULT, te::v1::PRECISION_HIGHEST}) {
    auto fc1 = CreateLayer(Dense(kFfn, precision));
    ASSERT_TRUE(fc1.ok());
    // 3 GEMMs of 2 * 8192 * 4096 * 16384 FLOPs: 3.3 TFLOP per step.
    std::printf("  its FlaxMLP_0/Dense_0 alone (float32 GEMMs 8192 x 4096 x 16384, %s): %.2f ms\n",
                precision == te::v1::PRECISION_DEFAULT ? "TF32" : "float32",
                StepMs(*gpu_, **fc1, shape, DType::kF32, true));
  }
}

}  // namespace
}  // namespace te::layers
