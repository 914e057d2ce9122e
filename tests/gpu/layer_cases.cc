#include "tests/gpu/layer_cases.h"

#include <utility>

namespace te::layers::compare {
namespace {

constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 37;         // 74 tokens
constexpr int64_t kHidden = 96;      // not a multiple of 64
constexpr int64_t kOddHidden = 100;  // not a multiple of 8 either (vector tails)
constexpr int kHeads = 4;
constexpr int kHeadDim = 24;  // kHeads * kHeadDim == kHidden
constexpr int kGqaGroups = 2;
constexpr int64_t kFfn = 160;

const Shape kTokens = {kBatch, kSeq, kHidden};

LayerCase Case(std::string name, te::v1::LayerSpec spec, Shape x_shape, bool composed,
               bool has_gemms) {
  LayerCase c;
  c.name = std::move(name);
  c.spec = std::move(spec);
  c.x_shape = std::move(x_shape);
  c.composed = composed;
  c.has_gemms = has_gemms;
  return c;
}

void AddLayerNorms(std::vector<LayerCase>* cases) {
  te::v1::LayerSpec spec;
  spec.mutable_layer_norm()->set_layernorm_type(te::v1::LAYERNORM);
  cases->push_back(Case("LayerNorm_layernorm", spec, {kBatch, kSeq, kOddHidden}, false, false));
  spec.mutable_layer_norm()->set_layernorm_type(te::v1::RMSNORM);
  spec.mutable_layer_norm()->set_epsilon(1e-5f);
  cases->push_back(Case("LayerNorm_rmsnorm", spec, kTokens, false, false));
  spec.mutable_layer_norm()->set_layernorm_type(te::v1::LAYERNORM);
  spec.mutable_layer_norm()->set_zero_centered_gamma(true);
  cases->push_back(Case("LayerNorm_zero_centred", spec, kTokens, false, false));
  spec.mutable_layer_norm()->set_layernorm_type(te::v1::RMSNORM);
  cases->push_back(Case("LayerNorm_rmsnorm_zero_centred", spec, kTokens, false, false));
}

void AddDenseGenerals(std::vector<LayerCase>* cases) {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(kFfn);
  cases->push_back(Case("DenseGeneral", spec, kTokens, false, true));
  // Two feature axes, a contraction length that is not a multiple of 16 (the
  // FP8 GEMM's unit) and no bias.
  spec.mutable_dense_general()->clear_features();
  spec.mutable_dense_general()->add_features(3);
  spec.mutable_dense_general()->add_features(20);
  spec.mutable_dense_general()->set_use_bias(false);
  cases->push_back(
      Case("DenseGeneral_two_features", spec, {kBatch, kSeq, kOddHidden}, false, true));
}

void AddActivations(std::vector<LayerCase>* cases) {
  const char* singles[] = {"gelu", "silu", "relu", "quick_gelu", "squared_relu"};
  for (const char* act : singles) {
    te::v1::LayerSpec spec;
    spec.mutable_activation()->add_activations(act);
    cases->push_back(
        Case(std::string("Activation_") + act, spec, {kBatch, kSeq, kFfn}, false, false));
  }
  const char* gated[] = {"gelu", "silu", "relu", "quick_gelu", "squared_relu"};
  for (const char* act : gated) {
    te::v1::LayerSpec spec;
    spec.mutable_activation()->add_activations(act);
    spec.mutable_activation()->add_activations("linear");
    cases->push_back(Case(std::string("Activation_") + act + "_linear", spec,
                          {kBatch, kSeq, 2, kFfn / 2}, false, false));
  }
}

void AddFusedMlpBlocks(std::vector<LayerCase>* cases) {
  te::v1::LayerSpec spec;
  auto* dense = spec.mutable_layer_norm_dense_general();
  dense->add_features(3);
  dense->add_features(kHidden);
  dense->set_use_bias(true);
  cases->push_back(Case("LayerNormDenseGeneral", spec, kTokens, true, true));
  dense->set_layernorm_type(te::v1::RMSNORM);
  dense->set_zero_centered_gamma(true);
  dense->set_use_bias(false);
  cases->push_back(Case("LayerNormDenseGeneral_rmsnorm_zero_centred", spec, kTokens, true, true));

  te::v1::LayerSpec mlp_spec;
  auto* mlp = mlp_spec.mutable_layer_norm_mlp();
  mlp->set_intermediate_dim(kFfn);
  mlp->add_activations("gelu");
  mlp->add_activations("linear");
  mlp->set_use_bias(true);
  mlp->set_intermediate_dropout_rate(0.0f);
  cases->push_back(Case("LayerNormMLP_gelu_linear", mlp_spec, kTokens, true, true));
  mlp->clear_activations();  // TE's default: relu
  mlp->set_use_bias(false);
  mlp->set_layernorm_type(te::v1::RMSNORM);
  cases->push_back(Case("LayerNormMLP_relu_rmsnorm", mlp_spec, kTokens, true, true));
}

te::v1::LayerSpec Attention(te::v1::AttnMaskType mask, int groups,
                            te::v1::QkvLayout layout = te::v1::BSHD_BSHD_BSHD) {
  te::v1::LayerSpec spec;
  auto* a = spec.mutable_dot_product_attention();
  a->set_head_dim(kHeadDim);
  a->set_num_attention_heads(kHeads);
  a->set_num_gqa_groups(groups);
  a->set_attn_mask_type(mask);
  a->set_qkv_layout(layout);
  return spec;
}

void AddDotProductAttentions(std::vector<LayerCase>* cases) {
  const Shape q = {kBatch, kSeq, kHeads, kHeadDim};
  LayerCase causal =
      Case("DotProductAttention_causal", Attention(te::v1::CAUSAL, kHeads), q, false, false);
  causal.extra_shapes = {q, q};
  cases->push_back(causal);

  // Padding with a longer key sequence and lengths short of both.
  const Shape kv_long = {kBatch, 41, kHeads, kHeadDim};
  LayerCase padding =
      Case("DotProductAttention_padding", Attention(te::v1::PADDING, kHeads), q, false, false);
  padding.extra_shapes = {kv_long, kv_long};
  padding.q_seqlens = {37, 20};
  padding.kv_seqlens = {41, 29};
  cases->push_back(padding);

  LayerCase padding_causal = Case("DotProductAttention_padding_causal",
                                  Attention(te::v1::PADDING_CAUSAL, kHeads), q, false, false);
  padding_causal.extra_shapes = {q, q};
  padding_causal.q_seqlens = {30, 37};
  padding_causal.kv_seqlens = {30, 37};
  cases->push_back(padding_causal);

  const Shape kv_no_mask = {kBatch, 45, kHeads, kHeadDim};
  LayerCase no_mask =
      Case("DotProductAttention_no_mask", Attention(te::v1::NO_MASK, kHeads), q, false, false);
  no_mask.extra_shapes = {kv_no_mask, kv_no_mask};
  cases->push_back(no_mask);

  const Shape kv_gqa = {kBatch, kSeq, kGqaGroups, kHeadDim};
  LayerCase gqa = Case("DotProductAttention_gqa_causal", Attention(te::v1::CAUSAL, kGqaGroups), q,
                       false, false);
  gqa.extra_shapes = {kv_gqa, kv_gqa};
  cases->push_back(gqa);

  cases->push_back(Case("DotProductAttention_bs3hd_causal",
                        Attention(te::v1::CAUSAL, kHeads, te::v1::BS3HD),
                        {kBatch, kSeq, 3, kHeads, kHeadDim}, false, false));
}

te::v1::LayerSpec MultiHead(int groups) {
  te::v1::LayerSpec spec;
  auto* m = spec.mutable_multi_head_attention();
  m->set_head_dim(kHeadDim);
  m->set_num_attention_heads(kHeads);
  m->set_num_gqa_groups(groups);
  m->set_attention_dropout(0.1f);  // off: the runs are deterministic
  return spec;
}

void AddMultiHeadAttentions(std::vector<LayerCase>* cases) {
  te::v1::LayerSpec fused = MultiHead(kHeads);
  fused.mutable_multi_head_attention()->set_use_bias(true);
  cases->push_back(Case("MultiHeadAttention_fused_qkv", fused, kTokens, true, true));

  te::v1::LayerSpec gqa = MultiHead(kGqaGroups);
  gqa.mutable_multi_head_attention()->set_enable_rotary_pos_emb(true);
  gqa.mutable_multi_head_attention()->set_scale_attn_logits(true);
  cases->push_back(Case("MultiHeadAttention_gqa_rotary", gqa, kTokens, true, true));

  te::v1::LayerSpec padded = MultiHead(kHeads);
  padded.mutable_multi_head_attention()->set_attn_mask_type(te::v1::PADDING_CAUSAL);
  padded.mutable_multi_head_attention()->set_layernorm_type(te::v1::RMSNORM);
  LayerCase padded_case =
      Case("MultiHeadAttention_padding_causal_rmsnorm", padded, kTokens, true, true);
  padded_case.q_seqlens = {37, 23};
  padded_case.kv_seqlens = {37, 23};
  cases->push_back(padded_case);
}

te::v1::LayerSpec SmallTransformer() {
  te::v1::LayerSpec spec;
  auto* t = spec.mutable_transformer_layer();
  t->set_hidden_size(kHidden);
  t->set_mlp_hidden_size(kFfn);
  t->set_num_attention_heads(kHeads);
  return spec;
}

// transformer_layer.cc's quickstart arguments at small size.
te::v1::LayerSpec QuickstartTransformer() {
  te::v1::LayerSpec spec = SmallTransformer();
  auto* t = spec.mutable_transformer_layer();
  t->add_mlp_activations("gelu");
  t->set_self_attn_mask_type(te::v1::CAUSAL);
  t->set_layernorm_epsilon(1e-5f);
  t->set_use_bias(true);
  t->set_intermediate_dropout(0.0f);
  t->set_enable_relative_embedding(false);
  t->set_self_attn_bias_type(te::v1::NO_BIAS);
  t->set_hidden_dropout(0.0f);
  t->set_dtype(te::v1::PARAM_BFLOAT16);
  return spec;
}

// The attention block of the quickstart's TEUnfusedTransformerLayer as a
// te.v1.GraphSpec, node by node as a client's tracer writes it: LayerNorm,
// DenseGeneral (qkv), reshape to [B, S, heads, 3 * head_dim], split into q,
// k, v, DotProductAttention (causal), reshape back to [B, S, hidden],
// DenseGeneral (proj), and the residual add of x. Then the whole layer: the
// block followed by the MLP block (LayerNorm, DenseGeneral, gelu,
// DenseGeneral) in another residual.
void AddGraphs(std::vector<LayerCase>* cases) {
  te::v1::LayerSpec spec;
  te::v1::GraphSpec* graph = spec.mutable_graph();
  auto node = [&](const std::string& name, std::vector<std::string> inputs,
                  std::vector<std::string> outputs) {
    te::v1::GraphSpec::Node* n = graph->add_nodes();
    n->set_name(name);
    for (const std::string& in : inputs) n->add_inputs(in);
    for (const std::string& out : outputs) n->add_outputs(out);
    return n;
  };
  auto dense = [&](const std::string& name, const std::string& in, int64_t features) {
    auto* d = node(name, {in}, {name})->mutable_module()->mutable_dense_general();
    d->add_features(features);
    d->set_use_bias(true);
  };
  node("LayerNorm_0", {"x"}, {"ln"})->mutable_module()->mutable_layer_norm();
  dense("DenseGeneral_0", "ln", 3 * kHidden);
  te::v1::GraphSpec::Node* reshape = node("qkv_reshape", {"DenseGeneral_0"}, {"qkv"});
  for (int64_t d : {kBatch, kSeq, int64_t{kHeads}, int64_t{3 * kHeadDim}}) {
    reshape->mutable_reshape()->add_shape(d);
  }
  te::v1::GraphSpec::Node* split = node("qkv_split", {"qkv"}, {"q", "k", "v"});
  split->mutable_split()->set_axis(3);
  split->mutable_split()->set_parts(3);
  auto* attention = node("DotProductAttention_0", {"q", "k", "v"}, {"attended"})
                        ->mutable_module()
                        ->mutable_dot_product_attention();
  attention->set_head_dim(kHeadDim);
  attention->set_num_attention_heads(kHeads);
  attention->set_attn_mask_type(te::v1::CAUSAL);
  te::v1::GraphSpec::Node* merge = node("heads_merge", {"attended"}, {"merged"});
  for (int64_t d : {kBatch, kSeq, kHidden}) merge->mutable_reshape()->add_shape(d);
  dense("DenseGeneral_1", "merged", kHidden);
  node("residual_add", {"DenseGeneral_1", "x"}, {"h"})->mutable_add();
  graph->add_outputs("h");
  cases->push_back(Case("Graph_attention_block", spec, kTokens, true, true));

  graph->clear_outputs();
  node("LayerNorm_1", {"h"}, {"ln_1"})->mutable_module()->mutable_layer_norm();
  dense("TEUnfusedMLP_0/DenseGeneral_0", "ln_1", kFfn);
  node("TEUnfusedMLP_0/activation", {"TEUnfusedMLP_0/DenseGeneral_0"}, {"act"})
      ->mutable_module()
      ->mutable_activation()
      ->add_activations("gelu");
  dense("TEUnfusedMLP_0/DenseGeneral_1", "act", kHidden);
  node("mlp_residual_add", {"TEUnfusedMLP_0/DenseGeneral_1", "h"}, {"y"})->mutable_add();
  graph->add_outputs("y");
  cases->push_back(Case("Graph_unfused_layer", spec, kTokens, true, true));
}

void AddTransformerLayers(std::vector<LayerCase>* cases) {
  // TE's defaults (relative embedding, causal, layernorm, gelu MLP, dropouts
  // that deterministic switches off).
  cases->push_back(Case("TransformerLayer_default", SmallTransformer(), kTokens, true, true));
  cases->push_back(
      Case("TransformerLayer_quickstart", QuickstartTransformer(), kTokens, true, true));
  te::v1::LayerSpec gqa = SmallTransformer();
  auto* t = gqa.mutable_transformer_layer();
  t->set_num_gqa_groups(kGqaGroups);
  t->set_layernorm_type(te::v1::RMSNORM);
  t->set_zero_centered_gamma(true);
  t->add_mlp_activations("silu");
  t->add_mlp_activations("linear");
  t->set_enable_relative_embedding(false);
  t->set_enable_rotary_pos_emb(true);
  t->set_self_attn_mask_type(te::v1::PADDING_CAUSAL);
  LayerCase padded = Case("TransformerLayer_gqa_rotary_padding", gqa, kTokens, true, true);
  padded.q_seqlens = {37, 26};
  padded.kv_seqlens = {37, 26};
  cases->push_back(padded);
  // Rotary embedding on the packed qkv (no GQA, self-attention): under FP8
  // the qkv projection's dy comes from RotaryQkQuantizeTranspose, here at a
  // size whose rows the CUDA backend rotates and quantizes in one pass (128
  // tokens, 3 * 128 columns, head_dim 32); the cases above take its
  // fallback.
  te::v1::LayerSpec rotary = SmallTransformer();
  t = rotary.mutable_transformer_layer();
  t->set_hidden_size(128);
  t->set_enable_relative_embedding(false);
  t->set_enable_rotary_pos_emb(true);
  cases->push_back(Case("TransformerLayer_rotary_packed", rotary, {2, 64, 128}, true, true));
  // TE's defaults at a size where the CUDA backend forms the relative
  // table's gradient with the band kernel (bf16 or f16 operands, a causal
  // self-attention whose sequence is a multiple of 16, head_dim 32): the
  // layer reads and writes rel_embedding [heads, buckets] as TE lays it out.
  te::v1::LayerSpec band = SmallTransformer();
  band.mutable_transformer_layer()->set_hidden_size(128);
  cases->push_back(Case("TransformerLayer_relative_band", band, {2, 64, 128}, true, true));
  // TE's decoder layer: causal self-attention with one-directional relative
  // buckets, then cross-attention over `encoded` (29 positions) under the
  // encoder_decoder_mask's padding, then the MLP.
  te::v1::LayerSpec decoder = SmallTransformer();
  decoder.mutable_transformer_layer()->set_layer_type(te::v1::DECODER);
  LayerCase cross = Case("TransformerLayer_decoder", decoder, kTokens, true, true);
  cross.extra_shapes = {{kBatch, 29, kHidden}};
  cross.q_seqlens = {37, 30};
  cross.kv_seqlens = {29, 17};
  cases->push_back(cross);
}

// Flax's own modules (no FP8: Flax ignores autocast). Float32 parameters by
// default, so a bf16 input computes and returns float32 as Flax does. At
// precision HIGHEST both backends compute exact float32; one case runs JAX's
// default precision (TensorFloat-32 GEMMs on the GPU).
void AddFlaxModules(std::vector<LayerCase>* cases) {
  const te::v1::Precision kExact = te::v1::PRECISION_HIGHEST;
  te::v1::LayerSpec dense;
  dense.mutable_flax_dense()->set_features(kFfn);
  dense.mutable_flax_dense()->set_precision(kExact);
  cases->push_back(Case("FlaxDense", dense, kTokens, false, false));
  dense.mutable_flax_dense()->set_precision(te::v1::PRECISION_DEFAULT);
  LayerCase tf32 = Case("FlaxDense_tf32", dense, kTokens, false, false);
  tf32.tf32 = true;
  cases->push_back(tf32);
  te::v1::LayerSpec general;
  general.mutable_flax_dense_general()->add_features(kHeads);
  general.mutable_flax_dense_general()->add_features(kHeadDim);
  general.mutable_flax_dense_general()->set_precision(kExact);
  cases->push_back(Case("FlaxDenseGeneral", general, {kBatch, kSeq, kOddHidden}, false, false));
  te::v1::LayerSpec norm;
  norm.mutable_flax_layer_norm();
  cases->push_back(Case("FlaxLayerNorm", norm, {kBatch, kSeq, kOddHidden}, false, false));
  te::v1::LayerSpec mha;
  mha.mutable_flax_multi_head_dot_product_attention()->set_num_heads(kHeads);
  mha.mutable_flax_multi_head_dot_product_attention()->set_precision(kExact);
  cases->push_back(Case("FlaxMultiHeadDotProductAttention", mha, kTokens, true, false));
  // 74 tokens over 24 rows: ids repeat, so the backward sums into rows.
  constexpr int64_t kVocab = 24;
  te::v1::LayerSpec embed;
  embed.mutable_flax_embed()->set_num_embeddings(kVocab);
  embed.mutable_flax_embed()->set_features(kOddHidden);
  LayerCase ids = Case("FlaxEmbed", embed, {kBatch, kSeq}, false, false);
  ids.token_vocab = kVocab;
  cases->push_back(ids);
}

std::vector<LayerCase> AllCases() {
  std::vector<LayerCase> cases;
  AddLayerNorms(&cases);
  AddDenseGenerals(&cases);
  AddActivations(&cases);
  AddFusedMlpBlocks(&cases);
  AddDotProductAttentions(&cases);
  AddMultiHeadAttentions(&cases);
  AddTransformerLayers(&cases);
  AddGraphs(&cases);
  AddFlaxModules(&cases);
  return cases;
}

}  // namespace

std::string CaseRun::name() const {
  return layer_case.name + (dtype == DType::kBF16 ? "_bf16" : "_f32") + (fp8 ? "_fp8" : "");
}

void PrintTo(const CaseRun& run, std::ostream* os) { *os << run.name(); }

std::vector<CaseRun> AllCaseRuns() {
  std::vector<CaseRun> runs;
  for (const LayerCase& c : AllCases()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      runs.push_back({c, dtype, /*fp8=*/false, /*steps=*/1});
      if (c.has_gemms) runs.push_back({c, dtype, /*fp8=*/true, /*steps=*/2});
    }
  }
  return runs;
}

std::vector<CaseRun> Fp8StateRuns() {
  return {
      {Case("TransformerLayer_default", SmallTransformer(), kTokens, true, true), DType::kBF16,
       true, kFp8StateSteps},
      {Case("TransformerLayer_quickstart", QuickstartTransformer(), kTokens, true, true),
       DType::kBF16, true, kFp8StateSteps},
  };
}

Fp8Recipe HybridDelayedScaling(int amax_history_len) {
  Fp8Recipe recipe;
  recipe.kind = Fp8Recipe::Kind::kDelayedScaling;
  recipe.format = Fp8Recipe::Format::kHybrid;
  recipe.margin = 0.0f;
  recipe.amax_history_len = amax_history_len;
  recipe.most_recent = false;
  return recipe;
}

}  // namespace te::layers::compare
