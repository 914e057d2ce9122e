// Layer::BackwardOnce (a training step's backward, which frees each saved
// tensor once it is read for the last time) gives bit for bit what Backward
// gives on a saved forward the caller keeps: the quickstart's TransformerLayer
// shape at a small size, in bf16 and under FP8 DelayedScaling (with and
// without kept weight copies), dropout on. dx, every parameter gradient and
// the FP8 state the backward writes are compared byte for byte.
#include <cstring>
#include <map>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/layers/attention_layers.h"
#include "server/layers/fp8_weight_cache.h"
#include "server/layers/layer.h"
#include "server/layers/testing.h"

namespace te::layers {
namespace {

using testing::NewCpuOps;
using testing::RandomTensor;

te::v1::TransformerLayer QuickstartShaped() {
  te::v1::TransformerLayer t;
  t.set_hidden_size(64);
  t.set_mlp_hidden_size(256);
  t.set_num_attention_heads(4);
  t.add_mlp_activations("gelu");
  t.set_self_attn_mask_type(te::v1::CAUSAL);
  t.set_layernorm_epsilon(1e-5f);
  t.set_use_bias(true);
  t.set_intermediate_dropout(0.0f);
  t.set_enable_relative_embedding(false);
  t.set_self_attn_bias_type(te::v1::NO_BIAS);
  t.set_hidden_dropout(0.0f);
  t.set_dtype(te::v1::PARAM_BFLOAT16);
  return t;
}

std::string Bytes(Ops& ops, const Tensor& t) {
  std::string out(t.nbytes(), '\0');
  EXPECT_TRUE(ops.Download(t, out.data()).ok());
  return out;
}

// A copy of every variable in fresh memory, so two runs share no state.
Variables DeepCopy(Ops& ops, const Variables& vars) {
  Variables out;
  for (const auto& [name, t] : vars) {
    Tensor copy = *ops.Allocate(t.dtype(), t.shape());
    EXPECT_TRUE(ops.Copy(t, &copy).ok());
    out[name] = copy;
  }
  return out;
}

struct StepResult {
  std::string dx;
  std::map<std::string, std::string> grads;
  std::map<std::string, std::string> vars;  // after the backward (FP8 amaxes)
};

StepResult RunStep(Ops& ops, const Layer& layer, const Variables& initial, const Tensor& x,
                   const Tensor& dy, const Fp8Recipe* fp8_in, bool once) {
  Variables vars = DeepCopy(ops, initial);
  Fp8WeightCache cache;
  std::optional<Fp8Recipe> fp8;
  if (fp8_in != nullptr) fp8 = *fp8_in;
  if (fp8 && fp8->weight_cache != nullptr) fp8->weight_cache = &cache;
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 7;
  opts.fp8 = fp8 ? &*fp8 : nullptr;
  opts.keep_for_backward = true;
  LayerInputs in;
  in.x = x;
  LayerOutputs out;
  std::unique_ptr<SavedForward> saved;
  EXPECT_TRUE(layer.Forward(ops, &vars, in, opts, &out, &saved).ok());
  LayerGrads grads;
  const absl::Status backward = once ? layer.BackwardOnce(ops, &vars, std::move(saved), dy, &grads)
                                     : layer.Backward(ops, &vars, *saved, dy, &grads);
  EXPECT_TRUE(backward.ok()) << backward;
  StepResult r;
  r.dx = Bytes(ops, grads.dx);
  for (const auto& [name, g] : grads.params) r.grads[name] = Bytes(ops, g);
  for (const auto& [name, v] : vars) r.vars[name] = Bytes(ops, v);
  return r;
}

void ExpectSameStep(const Fp8Recipe* fp8) {
  std::unique_ptr<Ops> ops = NewCpuOps();
  std::unique_ptr<Layer> layer = *MakeTransformerLayer(QuickstartShaped());
  const Shape shape = {2, 16, 64};
  Variables vars = *testing::InitLayer(*ops, *layer, shape, fp8, 3);
  testing::RandomizeParams(*ops, &vars, 5);
  const Tensor x = RandomTensor(*ops, shape, DType::kBF16, 11);
  const Tensor dy = RandomTensor(*ops, shape, DType::kBF16, 12);
  const StepResult kept = RunStep(*ops, *layer, vars, x, dy, fp8, /*once=*/false);
  const StepResult once = RunStep(*ops, *layer, vars, x, dy, fp8, /*once=*/true);
  EXPECT_EQ(kept.dx, once.dx);
  ASSERT_EQ(kept.grads.size(), once.grads.size());
  for (const auto& [name, bytes] : kept.grads) EXPECT_EQ(bytes, once.grads.at(name)) << name;
  for (const auto& [name, bytes] : kept.vars) EXPECT_EQ(bytes, once.vars.at(name)) << name;
  EXPECT_FALSE(kept.grads.empty());
}

TEST(BackwardOnceTest, Bf16SameAsBackward) { ExpectSameStep(nullptr); }

TEST(BackwardOnceTest, Fp8SameAsBackward) {
  Fp8Recipe fp8;  // DelayedScaling, HYBRID
  fp8.amax_history_len = 16;
  ExpectSameStep(&fp8);
}

TEST(BackwardOnceTest, Fp8WithKeptWeightsSameAsBackward) {
  Fp8Recipe fp8;
  fp8.amax_history_len = 16;
  Fp8WeightCache marker;  // RunStep gives each run a cache of its own
  fp8.weight_cache = &marker;
  ExpectSameStep(&fp8);
}

}  // namespace
}  // namespace te::layers
