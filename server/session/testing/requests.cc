#include "server/session/testing/requests.h"

#include "kernels/fp8.h"
#include "kernels/rng.h"

namespace te::session::testing {
namespace {

int64_t Elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

te::v1::Tensor Header(const std::vector<int64_t>& shape, te::v1::DType dtype) {
  te::v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  return t;
}

}  // namespace

te::v1::Tensor RandomFloats(const std::vector<int64_t>& shape, uint64_t seed, float scale,
                            te::v1::DType dtype) {
  const int64_t n = Elements(shape);
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = MixBits(seed * 0x9e3779b97f4a7c15ULL + static_cast<uint64_t>(i));
    v[static_cast<size_t>(i)] = scale * (static_cast<float>(r >> 40) / (1 << 23) - 1.0f);
  }
  te::v1::Tensor t = Header(shape, dtype);
  if (dtype == te::v1::BFLOAT16) {
    std::vector<uint16_t> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = FloatToBf16(v[i]);
    t.set_inline_data(b.data(), b.size() * sizeof(uint16_t));
  } else {
    t.set_inline_data(v.data(), v.size() * sizeof(float));
  }
  return t;
}

te::v1::Tensor RandomIds(const std::vector<int64_t>& shape, uint64_t seed, int64_t vocab) {
  const int64_t n = Elements(shape);
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    v[static_cast<size_t>(i)] =
        static_cast<int32_t>(MixBits(seed * 31 + static_cast<uint64_t>(i)) % vocab);
  }
  te::v1::Tensor t = Header(shape, te::v1::INT32);
  t.set_inline_data(v.data(), v.size() * sizeof(int32_t));
  return t;
}

te::v1::Recipe DelayedScalingRecipe() {
  te::v1::Recipe recipe;
  te::v1::DelayedScaling* d = recipe.mutable_delayed_scaling();
  d->set_fp8_format(te::v1::HYBRID);
  d->set_amax_history_len(4);
  d->set_amax_compute_algo("max");
  return recipe;
}

te::v1::GraphSpec::Node* AddNode(te::v1::GraphSpec* g, const std::string& name,
                                 const std::vector<std::string>& inputs,
                                 const std::vector<std::string>& outputs) {
  te::v1::GraphSpec::Node* node = g->add_nodes();
  node->set_name(name);
  for (const std::string& i : inputs) node->add_inputs(i);
  for (const std::string& o : outputs) node->add_outputs(o);
  return node;
}

te::v1::InitLayerRequest AutocastInitRequest(uint64_t seed, const std::vector<int64_t>& shape) {
  te::v1::InitLayerRequest init;
  init.set_seed(seed);
  init.set_input_dtype(te::v1::FLOAT32);
  for (int64_t d : shape) init.add_input_shape(d);
  init.mutable_autocast()->set_enabled(true);
  return init;
}

te::v1::SetOptimizerRequest AdamWRequest(const std::string& layer_id, double lr, double decay) {
  te::v1::SetOptimizerRequest optimizer;
  optimizer.set_layer_id(layer_id);
  te::v1::AdamW* adamw = optimizer.mutable_optimizer()->mutable_adamw();
  adamw->mutable_learning_rate()->set_constant(lr);
  adamw->set_weight_decay(decay);
  return optimizer;
}

te::v1::TransformerLayer* AddTransformerLayer(te::v1::GraphSpec* g, const std::string& name,
                                              const std::string& input,
                                              const std::string& output, int64_t hidden,
                                              int64_t ffn) {
  te::v1::TransformerLayer* t =
      AddNode(g, name, {input}, {output})->mutable_module()->mutable_transformer_layer();
  t->set_hidden_size(hidden);
  t->set_mlp_hidden_size(ffn);
  t->set_num_attention_heads(2);
  t->add_mlp_activations("gelu");
  t->set_hidden_dropout(0.0f);
  t->set_attention_dropout(0.0f);
  t->set_intermediate_dropout(0.0f);
  return t;
}

}  // namespace te::session::testing
