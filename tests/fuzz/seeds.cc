// The seed corpus: valid requests of every RPC the harness runs, at the
// harness's sizes (x: [2, 3, 8] float32 into the live layer), for every live
// layer kind; and the hostile values a valid, authenticated client has sent
// (huge module sizes, shapes whose products overflow int64, short streams,
// many micro-batches, FP8 recipes that do not match the layer's), each with
// the codes its call may end with: a clean refusal, never a crash.
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "te/state/v1/session_state.pb.h"
#include "te/v1/service.pb.h"
#include "tests/fuzz/request_harness.h"
#include "tests/fuzz/request_specs.h"

namespace te::fuzz {
namespace {

using Code = absl::StatusCode;

// A clean refusal of a request too large or malformed: either code.
const std::vector<Code> kRefused = {Code::kInvalidArgument, Code::kResourceExhausted};

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

te::v1::Tensor Floats(const std::vector<int64_t>& shape, float scale) {
  te::v1::Tensor tensor;
  tensor.set_dtype(te::v1::FLOAT32);
  int64_t n = 1;
  for (int64_t d : shape) {
    tensor.add_shape(d);
    n *= d;
  }
  std::vector<float> values(static_cast<size_t>(n));
  for (size_t i = 0; i < values.size(); ++i) values[i] = scale * static_cast<float>(i % 5) - 1.3f;
  tensor.set_inline_data(values.data(), values.size() * sizeof(float));
  return tensor;
}

// A tensor without data: the harness makes it the live x (or dy).
te::v1::Tensor Live() {
  te::v1::Tensor tensor;
  return tensor;
}

te::v1::Autocast CurrentScaling() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_float8_current_scaling();
  return autocast;
}

te::v1::Autocast Mxfp8() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_mxfp8_block_scaling();
  return autocast;
}

// The live layer's autocast (SetupFor in request_harness.cc).
te::v1::Autocast AutocastOf(LayerKind kind) {
  switch (kind) {
    case LayerKind::kMhaCurrentScaling:
      return CurrentScaling();
    case LayerKind::kLayerNormDenseMxfp8:
      return Mxfp8();
    case LayerKind::kDenseFp8:
    case LayerKind::kLayerNormMlpFp8:
    case LayerKind::kUnfusedGraphFp8:
    case LayerKind::kTransformerFp8:
    case LayerKind::kAttentionGraphFp8:
    case LayerKind::kGraphFp8:
    case LayerKind::kCount:
      break;
  }
  return DelayedScaling();
}

const char* KindName(LayerKind kind) {
  switch (kind) {
    case LayerKind::kDenseFp8:
      return "dense_fp8";
    case LayerKind::kLayerNormMlpFp8:
      return "layer_norm_mlp_fp8";
    case LayerKind::kUnfusedGraphFp8:
      return "unfused_graph_fp8";
    case LayerKind::kTransformerFp8:
      return "transformer_fp8";
    case LayerKind::kMhaCurrentScaling:
      return "mha_current_scaling";
    case LayerKind::kAttentionGraphFp8:
      return "attention_graph_fp8";
    case LayerKind::kLayerNormDenseMxfp8:
      return "layer_norm_dense_mxfp8";
    case LayerKind::kGraphFp8:
      return "graph_fp8";
    case LayerKind::kCount:
      break;
  }
  return "unknown";
}

std::string Input(Rpc rpc, uint8_t flags, const google::protobuf::MessageLite& request) {
  return std::string{static_cast<char>(rpc), static_cast<char>(flags)} +
         request.SerializeAsString();
}

std::string Stream(const std::vector<te::v1::PutTensorChunk>& chunks) {
  std::string out = {static_cast<char>(Rpc::kPutTensor), 0};
  google::protobuf::io::StringOutputStream sink(&out);
  google::protobuf::io::CodedOutputStream coded(&sink);
  for (const te::v1::PutTensorChunk& chunk : chunks) {
    const std::string bytes = chunk.SerializeAsString();
    coded.WriteVarint32(static_cast<uint32_t>(bytes.size()));
    coded.WriteString(bytes);
  }
  coded.Trim();
  return out;
}

te::v1::PutTensorChunk Header(te::v1::DType dtype, const std::vector<int64_t>& shape) {
  te::v1::PutTensorChunk chunk;
  chunk.mutable_header()->mutable_tensor()->set_dtype(dtype);
  chunk.mutable_header()->mutable_tensor()->mutable_shape()->Assign(shape.begin(), shape.end());
  return chunk;
}

te::v1::PutTensorChunk Data(size_t bytes, char fill) {
  te::v1::PutTensorChunk chunk;
  chunk.set_data(std::string(bytes, fill));
  return chunk;
}

class Seeds {
 public:
  void Add(std::string name, std::string bytes, std::vector<Code> allowed = {Code::kOk}) {
    seeds_.push_back({std::move(name), std::move(bytes), std::move(allowed)});
  }

  void Init(const std::string& name, const te::v1::LayerSpec& spec, std::vector<int64_t> shape,
            const te::v1::Autocast& autocast, std::vector<Code> allowed = {Code::kOk},
            te::v1::DType dtype = te::v1::FLOAT32) {
    te::v1::InitLayerRequest init;
    *init.mutable_spec() = spec;
    init.set_seed(11);
    init.set_input_dtype(dtype);
    init.mutable_input_shape()->Assign(shape.begin(), shape.end());
    *init.mutable_autocast() = autocast;
    Add("init_" + name, Input(Rpc::kInitLayer, 0, init), std::move(allowed));
  }

  std::vector<Seed> Take() { return std::move(seeds_); }

 private:
  std::vector<Seed> seeds_;
};

// ---- the original seeds: every RPC, valid ------------------------------------------

void AddBasics(Seeds* seeds) {
  te::v1::CreateSessionRequest create;
  create.add_preferred_recipes()->mutable_delayed_scaling()->set_amax_history_len(16);
  create.add_preferred_recipes()->mutable_float8_current_scaling();
  create.set_policy(te::v1::FALLBACK);
  create.set_ttl_seconds(60);
  seeds->Add("create_session", Input(Rpc::kCreateSession, 0, create));
  create.set_policy(te::v1::STRICT);
  create.clear_preferred_recipes();
  create.add_preferred_recipes()->mutable_mxfp8_block_scaling();
  // STRICT asks for MXFP8 natively; the CPU only emulates it.
  seeds->Add("create_session_strict_mxfp8", Input(Rpc::kCreateSession, 0, create),
             {Code::kFailedPrecondition});

  seeds->Add("close_session", Input(Rpc::kCloseSession, 0, te::v1::CloseSessionRequest()));

  te::v1::LayerSpec spec = DenseSpec({4});
  seeds->Init("dense_general_fp8", spec, {2, 3, 8}, DelayedScaling());
  spec.Clear();
  spec.mutable_layer_norm()->set_epsilon(1e-5f);
  seeds->Init("layer_norm", spec, {2, 3, 8}, te::v1::Autocast());
  spec.Clear();
  spec.mutable_layer_norm_mlp()->set_intermediate_dim(16);
  spec.mutable_layer_norm_mlp()->add_activations("gelu");
  spec.mutable_layer_norm_mlp()->add_activations("linear");
  seeds->Init("layer_norm_mlp_fp8", spec, {2, 3, 8}, DelayedScaling());
  spec.Clear();
  spec.mutable_transformer_layer()->set_hidden_size(8);
  spec.mutable_transformer_layer()->set_mlp_hidden_size(16);
  spec.mutable_transformer_layer()->set_num_attention_heads(2);
  seeds->Init("transformer_layer", spec, {2, 3, 8}, te::v1::Autocast());
  spec.Clear();
  spec.mutable_multi_head_attention()->set_head_dim(4);
  spec.mutable_multi_head_attention()->set_num_attention_heads(2);
  seeds->Init("multi_head_attention", spec, {2, 3, 8}, te::v1::Autocast());

  te::v1::ForwardRequest forward;
  *forward.mutable_x() = Floats({2, 3, 8}, 0.7f);
  forward.set_keep_for_backward(true);
  *forward.mutable_autocast() = DelayedScaling();
  seeds->Add("forward_fp8", Input(Rpc::kForward, 0, forward));
  forward.clear_autocast();
  forward.set_keep_outputs(true);
  forward.set_deterministic(true);
  seeds->Add("forward_keep_outputs_undone", Input(Rpc::kForward, kUndo, forward));

  te::v1::BackwardRequest backward;
  *backward.mutable_dy() = Floats({2, 3, 4}, 0.3f);
  backward.set_keep_grads(true);
  seeds->Add("backward", Input(Rpc::kBackward, 0, backward));

  te::v1::ForwardBackwardRequest step;
  *step.mutable_autocast() = DelayedScaling();
  for (int i = 0; i < 2; ++i) {
    te::v1::MicroBatch* batch = step.add_micro_batches();
    *batch->mutable_x() = Floats({2, 3, 8}, 0.5f + i);
    *batch->mutable_dy() = Floats({2, 3, 4}, 0.2f);
    batch->set_dropout_seed(i);
  }
  step.set_return_dx(true);
  step.set_return_grads(true);
  seeds->Add("forward_backward_fp8", Input(Rpc::kForwardBackward, 0, step));

  te::v1::GetVariablesRequest get_variables;
  get_variables.add_collections("params");
  get_variables.add_collections("fp8_metas");
  seeds->Add("get_variables", Input(Rpc::kGetVariables, 0, get_variables));

  te::v1::SetVariablesRequest set_variables;
  te::v1::Variable* kernel = set_variables.add_variables();
  kernel->set_collection("params");
  kernel->set_path("kernel");
  *kernel->mutable_value() = Floats({8, 4}, 0.1f);
  te::v1::Variable* bias = set_variables.add_variables();
  bias->set_collection("params");
  bias->set_path("bias");
  *bias->mutable_value() = Floats({4}, 0.1f);
  seeds->Add("set_variables", Input(Rpc::kSetVariables, 0, set_variables));

  seeds->Add("put_tensor",
             Stream({Header(te::v1::FLOAT32, {6, 4}), Data(40, '\x01'), Data(56, '\x02')}));

  te::v1::GetTensorRequest get_tensor;
  get_tensor.set_chunk_bytes(16);
  seeds->Add("get_tensor", Input(Rpc::kGetTensor, 0, get_tensor));
  seeds->Add("delete_tensor", Input(Rpc::kDeleteTensor, 0, te::v1::DeleteTensorRequest()));

  te::v1::BenchmarkRequest benchmark;
  *benchmark.mutable_inputs()->mutable_x() = Floats({2, 3, 8}, 0.4f);
  *benchmark.mutable_inputs()->mutable_dy() = Floats({2, 3, 4}, 0.4f);
  benchmark.set_warmup_iters(1);
  benchmark.set_timing_iters(2);
  seeds->Add("benchmark", Input(Rpc::kBenchmark, 0, benchmark));

  te::v1::RegisterSharedMemoryRequest region;
  region.set_name("/te_client_1_0");
  region.set_size(4096);
  seeds->Add("register_shared_memory", Input(Rpc::kRegisterSharedMemory, 0, region));
  // Larger than the object: refused.
  region.set_size(std::numeric_limits<uint64_t>::max());
  seeds->Add("register_shared_memory_2p64", Input(Rpc::kRegisterSharedMemory, 0, region),
             {Code::kInvalidArgument});
  te::v1::UnregisterSharedMemoryRequest unregister;
  unregister.set_region_id("region-99");
  // No such region.
  seeds->Add("unregister_shared_memory", Input(Rpc::kUnregisterSharedMemory, 0, unregister),
             {Code::kNotFound});
  seeds->Add("unregister_shared_memory_live",
             Input(Rpc::kUnregisterSharedMemory, 0, te::v1::UnregisterSharedMemoryRequest()));

  seeds->Add("checkpoint", Input(Rpc::kCheckpoint, 0, te::v1::CheckpointRequest()));

  te::state::v1::SessionState state;
  state.set_format_version(1);
  state.set_ttl_seconds(60);
  state.set_next_id(3);
  te::state::v1::SavedLayer* layer = state.add_layers();
  layer->set_layer_id("layer-1");
  layer->mutable_spec()->mutable_dense_general()->add_features(4);
  layer->add_input_shape(2);
  layer->add_input_shape(8);
  layer->set_input_dtype(te::v1::FLOAT32);
  uint64_t offset = 0;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"params/kernel", {8, 4}}, {"params/bias", {4}}, {"grads/kernel", {8, 4}}}) {
    te::state::v1::SavedVariable* variable = layer->add_variables();
    variable->set_name(name);
    variable->set_dtype(te::v1::FLOAT32);
    variable->mutable_shape()->Assign(shape.begin(), shape.end());
    uint64_t bytes = 4;
    for (int64_t d : shape) bytes *= static_cast<uint64_t>(d);
    variable->set_offset(offset);
    variable->set_bytes(bytes);
    offset += bytes;
  }
  // The harness's data file is longer than the manifest's variables.
  seeds->Add("restore_checkpoint", Input(Rpc::kRestoreCheckpoint, 0, state), {Code::kDataLoss});
  // A manifest whose variable's shape overflows int64 (bytes still 128), and
  // one whose layer is huge: refused, never rebuilt.
  {
    te::state::v1::SessionState bad = state;
    bad.mutable_layers(0)->mutable_variables(0)->clear_shape();
    bad.mutable_layers(0)->mutable_variables(0)->add_shape(int64_t{1} << 32);
    bad.mutable_layers(0)->mutable_variables(0)->add_shape(int64_t{1} << 32);
    seeds->Add("restore_variable_shape_overflows", Input(Rpc::kRestoreCheckpoint, 0, bad),
               {Code::kDataLoss, Code::kInvalidArgument});
    bad = state;
    bad.mutable_layers(0)->mutable_spec()->mutable_dense_general()->set_features(0,
                                                                                 int64_t{1} << 31);
    seeds->Add("restore_layer_features_2p31", Input(Rpc::kRestoreCheckpoint, 0, bad),
               {Code::kDataLoss, Code::kInvalidArgument, Code::kResourceExhausted});
  }

  te::v1::GetSessionInfoRequest info;
  seeds->Add("get_session_info", Input(Rpc::kGetSessionInfo, 0, info));
}

// ---- every live layer: forward, backward, a step, a benchmark, its variables --------

void AddPerKind(Seeds* seeds) {
  for (int k = 0; k < kLayerKindCount; ++k) {
    const LayerKind kind = static_cast<LayerKind>(k);
    const uint8_t flags = KindFlags(kind);
    const std::string name = KindName(kind);
    const te::v1::Autocast autocast = AutocastOf(kind);

    te::v1::ForwardRequest forward;
    *forward.mutable_autocast() = autocast;
    forward.set_keep_for_backward(true);
    forward.set_dropout_seed(9);
    seeds->Add("forward_" + name, Input(Rpc::kForward, flags, forward));
    // No backward will end the step: the FP8 update runs in the forward.
    forward.set_keep_for_backward(false);
    forward.set_deterministic(true);
    seeds->Add("forward_no_backward_" + name, Input(Rpc::kForward, flags, forward));

    te::v1::BackwardRequest backward;
    backward.set_keep_grads(k % 2 == 0);
    seeds->Add("backward_" + name, Input(Rpc::kBackward, flags, backward));

    te::v1::ForwardBackwardRequest step;
    *step.mutable_autocast() = autocast;
    for (int i = 0; i < 2; ++i) step.add_micro_batches()->set_dropout_seed(i);
    step.set_return_dx(true);
    step.set_return_grads(k % 2 == 1);
    seeds->Add("forward_backward_" + name, Input(Rpc::kForwardBackward, flags, step));

    te::v1::BenchmarkRequest benchmark;
    *benchmark.mutable_autocast() = autocast;
    *benchmark.mutable_inputs()->mutable_dy() = Live();
    benchmark.set_warmup_iters(1);
    benchmark.set_timing_iters(1);
    benchmark.set_deterministic(true);
    seeds->Add("benchmark_" + name, Input(Rpc::kBenchmark, flags, benchmark));

    seeds->Add("get_variables_" + name,
               Input(Rpc::kGetVariables, flags, te::v1::GetVariablesRequest()));
  }
}

// ---- hostile: InitLayer with huge modules and overflowing shapes -----------------------

void AddHostileInit(Seeds* seeds) {
  te::v1::LayerSpec spec;
  // TransformerLayer(hidden_size 2^20): x [1, 1, 2^20] bfloat16 is 2 MiB (within
  // the harness's tensor limit); its QKV kernel alone is 2^20 x 3 * 2^20.
  spec.mutable_transformer_layer()->set_hidden_size(int64_t{1} << 20);
  spec.mutable_transformer_layer()->set_mlp_hidden_size(int64_t{4} << 20);
  spec.mutable_transformer_layer()->set_num_attention_heads(16);
  seeds->Init("transformer_hidden_2p20", spec, {1, 1, int64_t{1} << 20}, te::v1::Autocast(),
              kRefused, te::v1::BFLOAT16);
  seeds->Init("transformer_hidden_2p20_fp8", spec, {1, 1, int64_t{1} << 20}, DelayedScaling(),
              kRefused, te::v1::BFLOAT16);
  // hidden 2^40 with one head: head_dim as an int32 is 0.
  spec.mutable_transformer_layer()->set_hidden_size(int64_t{1} << 40);
  spec.mutable_transformer_layer()->set_num_attention_heads(1);
  seeds->Init("transformer_hidden_2p40", spec, {1, 1, 8}, te::v1::Autocast(), kRefused);
  // The MLP's width: 2^40 (a kernel of 2^43 elements: refused for memory),
  // 2^61 (8 x 2^61 elements: past 2^63).
  spec.mutable_transformer_layer()->set_hidden_size(8);
  spec.mutable_transformer_layer()->set_num_attention_heads(2);
  spec.mutable_transformer_layer()->set_mlp_hidden_size(int64_t{1} << 40);
  seeds->Init("transformer_mlp_hidden_2p40", spec, {2, 3, 8}, DelayedScaling(), kRefused);
  spec.mutable_transformer_layer()->set_mlp_hidden_size(int64_t{1} << 61);
  seeds->Init("transformer_mlp_hidden_2p61", spec, {2, 3, 8}, te::v1::Autocast(), kRefused);
  spec.Clear();
  spec.mutable_flax_dense()->set_features(int64_t{1} << 31);
  seeds->Init("flax_dense_features_2p31", spec, {2, 3, 1 << 30}, te::v1::Autocast(), kRefused);
  spec.Clear();
  spec.mutable_layer_norm_dense_general()->add_features(int64_t{1} << 31);
  spec.mutable_layer_norm_dense_general()->add_features(int64_t{1} << 31);
  seeds->Init("layer_norm_dense_features_2p31x2p31", spec, {2, 3, 8}, DelayedScaling(), kRefused);
  spec.Clear();
  // A multi-head attention whose heads * head_dim overflows int32.
  spec.mutable_multi_head_attention()->set_head_dim(1 << 30);
  spec.mutable_multi_head_attention()->set_num_attention_heads(1 << 30);
  seeds->Init("mha_heads_times_head_dim_2p60", spec, {2, 3, 8}, te::v1::Autocast(), kRefused);
  spec.Clear();
  // LayerNormMLP(intermediate 2^31) on [2, 3, 8]: wi 8 x 2^31.
  spec.mutable_layer_norm_mlp()->set_intermediate_dim(int64_t{1} << 31);
  seeds->Init("layer_norm_mlp_intermediate_2p31", spec, {2, 3, 8}, DelayedScaling(), kRefused);

  // DenseGeneral: features 2^31 (the per-dim limit), 2^40, near INT64_MAX,
  // and features whose product overflows int64.
  seeds->Init("dense_features_2p31", DenseSpec({int64_t{1} << 31}), {2, 3, 8}, DelayedScaling(),
              kRefused);
  seeds->Init("dense_features_2p31_input_2p20", DenseSpec({int64_t{1} << 31}),
              {1, int64_t{1} << 20}, te::v1::Autocast(), kRefused);
  seeds->Init("dense_features_2p40", DenseSpec({int64_t{1} << 40}), {2, 3, 8}, te::v1::Autocast(),
              kRefused);
  seeds->Init("dense_features_int64_max", DenseSpec({kInt64Max}), {2, 3, 8}, te::v1::Autocast(),
              kRefused);
  seeds->Init("dense_features_int64_max_minus_1", DenseSpec({kInt64Max - 1, 2}), {2, 3, 8},
              te::v1::Autocast(), kRefused);
  seeds->Init("dense_features_product_2p62", DenseSpec({int64_t{1} << 31, int64_t{1} << 31}),
              {2, 3, 8}, te::v1::Autocast(), kRefused);
  seeds->Init("dense_features_product_2p93",
              DenseSpec({int64_t{1} << 31, int64_t{1} << 31, int64_t{1} << 31}), {2, 3, 8},
              DelayedScaling(), kRefused);
  // The kernel's element count 8 * 2^31 * 2^30 = 2^64 wraps to 0.
  seeds->Init("dense_kernel_elements_wrap_to_0", DenseSpec({int64_t{1} << 31, int64_t{1} << 30}),
              {2, 3, 8}, te::v1::Autocast(), kRefused);
  // Contracting every axis of a large input: in = 2^20.
  spec = DenseSpec({int64_t{1} << 31});
  spec.mutable_dense_general()->add_axis(0);
  spec.mutable_dense_general()->add_axis(1);
  seeds->Init("dense_contract_2p20_features_2p31", spec, {1024, 1024}, te::v1::Autocast(), kRefused,
              te::v1::BFLOAT16);
  // The input shape itself: dims whose product overflows, a negative dim.
  seeds->Init("input_shape_product_overflow", DenseSpec({4}),
              {int64_t{1} << 32, int64_t{1} << 32, 8}, te::v1::Autocast(), kRefused);
  seeds->Init("input_shape_int64_max", DenseSpec({4}), {kInt64Max, 8}, te::v1::Autocast(),
              kRefused);
  seeds->Init("input_shape_negative", DenseSpec({4}), {2, -3, 8}, te::v1::Autocast(), kRefused);

  // A graph whose first node is attention: q is x, k and v are the layer's extra inputs.
  seeds->Init("attention_graph_first", AttentionGraphSpec(), {2, 3, 2, 4}, DelayedScaling());
  // GraphSpec (a composite as one server graph): valid glue of every kind,
  // then each glue op with hostile values.
  {
    auto graph_seed = [&](const std::string& name,
                          const std::function<void(te::v1::GraphSpec*)>& build,
                          std::vector<Code> allowed, const te::v1::Autocast& autocast) {
      te::v1::LayerSpec g;
      build(g.mutable_graph());
      seeds->Init("graph_" + name, g, {2, 3, 8}, autocast, std::move(allowed));
    };
    auto glue = [](te::v1::GraphSpec* g) {
      *GraphNode(g, "DenseGeneral_0", {"x"}, {"qkv"})->mutable_module() = DenseSpec({24});
      te::v1::GraphSpec::Node* split = GraphNode(g, "split", {"qkv"}, {"q", "k", "v"});
      split->mutable_split()->set_parts(3);
      split->mutable_split()->set_axis(-1);
      GraphNode(g, "concatenate", {"q", "k"}, {"qk"})->mutable_concatenate()->set_axis(-1);
      GraphNode(g, "cast", {"qk"}, {"qk16"})->mutable_cast()->set_dtype(te::v1::BFLOAT16);
      GraphNode(g, "cast_back", {"qk16"}, {"qk32"})->mutable_cast()->set_dtype(te::v1::FLOAT32);
      GraphNode(g, "dropout", {"qk32"}, {"qkd"})->mutable_dropout()->set_rate(0.25f);
      te::v1::GraphSpec::Node* t = GraphNode(g, "transpose", {"qkd"}, {"qkt"});
      for (int a : {1, 0, 2}) t->mutable_transpose()->add_axes(a);
      SetReshape(GraphNode(g, "reshape", {"qkt"}, {"qkr"}), {2, 3, -1});
      te::v1::GraphSpec::Node* halves = GraphNode(g, "split_qk", {"qkr"}, {"a", "b"});
      halves->mutable_split()->set_parts(2);
      halves->mutable_split()->set_axis(-1);
      GraphNode(g, "add", {"a", "b", "v", "x"}, {"s"})->mutable_add();
      GraphNode(g, "scale", {"s"}, {"y"})->mutable_scale()->set_factor(0.125);
      g->add_outputs("y");
    };
    graph_seed("glue_fp8", glue, {Code::kOk, Code::kInvalidArgument}, DelayedScaling());
    const std::vector<std::pair<std::string, std::vector<int64_t>>> reshapes = {
        {"reshape_wraps_2p64", {(int64_t{1} << 61) + 1, 8}},
        {"reshape_2p63", {2, 3, int64_t{1} << 62, 2}},
        {"reshape_int64_max_squared", {2, kInt64Max, kInt64Max}},
        {"reshape_wildcard_times_2p64", {-1, int64_t{1} << 62, 4}},
        {"reshape_two_wildcards", {-1, -1}},
        {"reshape_zero_dim", {0, 48}},
        {"reshape_int64_min", {std::numeric_limits<int64_t>::min(), -1}},
        {"reshape_wildcard_of_2p40", {-1, int64_t{1} << 40}},
    };
    for (const auto& [name, shape] : reshapes) {
      graph_seed(
          name,
          [&shape = shape](te::v1::GraphSpec* g) {
            SetReshape(GraphNode(g, "reshape", {"x"}, {"y"}), shape);
            g->add_outputs("y");
          },
          kRefused, te::v1::Autocast());
    }
    // A module between reshapes whose batch dims wrap.
    graph_seed(
        "reshape_batch_wraps_around_a_module",
        [](te::v1::GraphSpec* g) {
          SetReshape(GraphNode(g, "reshape", {"x"}, {"r"}), {2, (int64_t{1} << 62) + 3, 8});
          *GraphNode(g, "DenseGeneral_0", {"r"}, {"d"})->mutable_module() = DenseSpec({4});
          SetReshape(GraphNode(g, "reshape_back", {"d"}, {"y"}), {2, (int64_t{1} << 62) + 3, 2, 2});
          g->add_outputs("y");
        },
        kRefused, DelayedScaling());
    // A reshape of an extra input: its shape is unknown until a request gives one.
    graph_seed(
        "reshape_extra_input_wildcard_2p40",
        [](te::v1::GraphSpec* g) {
          SetReshape(GraphNode(g, "reshape", {"extra_inputs[0]"}, {"k"}), {-1, int64_t{1} << 40});
          GraphNode(g, "add", {"x", "x"}, {"y"})->mutable_add();
          g->add_outputs("y");
          g->add_outputs("k");
        },
        {Code::kOk, Code::kInvalidArgument}, te::v1::Autocast());
    graph_seed(
        "split_parts_int32_max",
        [](te::v1::GraphSpec* g) {
          te::v1::GraphSpec::Node* n = GraphNode(g, "split", {"x"}, {"a", "b"});
          n->mutable_split()->set_parts(std::numeric_limits<int32_t>::max());
          n->mutable_split()->set_axis(std::numeric_limits<int32_t>::min());
          g->add_outputs("a");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "split_axis_int32_min",
        [](te::v1::GraphSpec* g) {
          te::v1::GraphSpec::Node* n = GraphNode(g, "split", {"x"}, {"a", "b"});
          n->mutable_split()->set_parts(2);
          n->mutable_split()->set_axis(std::numeric_limits<int32_t>::min());
          GraphNode(g, "add", {"a", "b"}, {"y"})->mutable_add();
          g->add_outputs("y");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "transpose_axes_bad",
        [](te::v1::GraphSpec* g) {
          te::v1::GraphSpec::Node* n = GraphNode(g, "transpose", {"x"}, {"y"});
          for (int a : {0, std::numeric_limits<int32_t>::min(), 2})
            n->mutable_transpose()->add_axes(a);
          g->add_outputs("y");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "transpose_axes_repeated",
        [](te::v1::GraphSpec* g) {
          te::v1::GraphSpec::Node* n = GraphNode(g, "transpose", {"x"}, {"y"});
          for (int a : {2, 2, 0}) n->mutable_transpose()->add_axes(a);
          g->add_outputs("y");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "concatenate_axis_int32_min",
        [](te::v1::GraphSpec* g) {
          GraphNode(g, "concatenate", {"x", "x"}, {"y"})
              ->mutable_concatenate()
              ->set_axis(std::numeric_limits<int32_t>::min());
          g->add_outputs("y");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "dropout_broadcast_dims_bad",
        [](te::v1::GraphSpec* g) {
          te::v1::GraphSpec::Node* n = GraphNode(g, "dropout", {"x"}, {"y"});
          n->mutable_dropout()->set_rate(0.5f);
          n->mutable_dropout()->add_broadcast_dims(std::numeric_limits<int32_t>::min());
          n->mutable_dropout()->add_broadcast_dims(7);
          g->add_outputs("y");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "scale_float_max_times_2",
        [](te::v1::GraphSpec* g) {
          GraphNode(g, "scale", {"x"}, {"y"})->mutable_scale()->set_factor(6.8e38);
          g->add_outputs("y");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "cycle",
        [](te::v1::GraphSpec* g) {
          GraphNode(g, "a", {"x", "c"}, {"b"})->mutable_add();
          GraphNode(g, "b", {"b"}, {"c"})->mutable_scale()->set_factor(2);
          g->add_outputs("c");
        },
        kRefused, te::v1::Autocast());
    graph_seed(
        "causal_mask",
        [](te::v1::GraphSpec* g) {
          GraphNode(g, "mask", {"x"}, {"m"})->mutable_causal_mask();
          te::v1::GraphSpec::Node* mha = GraphNode(g, "MultiHeadAttention_0", {"x"}, {"y"});
          mha->set_mask("m");
          mha->mutable_module()->mutable_multi_head_attention()->set_head_dim(4);
          mha->mutable_module()->mutable_multi_head_attention()->set_num_attention_heads(2);
          mha->mutable_module()->mutable_multi_head_attention()->set_attn_mask_type(te::v1::CAUSAL);
          g->add_outputs("y");
        },
        {Code::kOk, Code::kInvalidArgument}, DelayedScaling());
    // Modules inside: one too large for memory, one whose kernel overflows.
    graph_seed(
        "module_dense_2p31",
        [](te::v1::GraphSpec* g) {
          *GraphNode(g, "DenseGeneral_0", {"x"}, {"y"})->mutable_module() =
              DenseSpec({int64_t{1} << 31});
          g->add_outputs("y");
        },
        kRefused, DelayedScaling());
    graph_seed(
        "module_dense_2p31x2p31",
        [](te::v1::GraphSpec* g) {
          *GraphNode(g, "DenseGeneral_0", {"x"}, {"y"})->mutable_module() =
              DenseSpec({int64_t{1} << 31, int64_t{1} << 31});
          g->add_outputs("y");
        },
        kRefused, te::v1::Autocast());
  }
  // FP8 state huge: the amax history is bounded by the recipe check.
  seeds->Init("dense_amax_history_int32_max", DenseSpec({4}), {2, 3, 8},
              DelayedScaling(std::numeric_limits<int32_t>::max()), kRefused);
}

// ---- hostile: PutTensor headers and streams ---------------------------------------------

void AddHostilePut(Seeds* seeds) {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"shape_product_overflow", {int64_t{1} << 32, int64_t{1} << 32}},
      {"bytes_overflow_2p62_floats", {int64_t{1} << 62}},
      {"bytes_wrap_to_0", {int64_t{1} << 32, int64_t{1} << 30}},  // 2^62 floats: 2^64 bytes
      {"overflow_then_zero_dim", {int64_t{1} << 62, int64_t{1} << 62, 0}},
      {"int64_max", {kInt64Max}},
      {"enormous_2p40", {int64_t{1} << 40}},
      {"negative_dim", {4, -1}},
      {"int64_min_dim", {std::numeric_limits<int64_t>::min()}},
  };
  for (const auto& [name, shape] : shapes) {
    seeds->Add("put_tensor_" + name, Stream({Header(te::v1::FLOAT32, shape), Data(16, 'x')}),
               kRefused);
  }
  // A zero dim first: zero bytes, whatever follows (a valid empty tensor, or refused).
  seeds->Add("put_tensor_zero_dim_then_2p124",
             Stream({Header(te::v1::FLOAT32, {0, int64_t{1} << 62, int64_t{1} << 62})}),
             {Code::kOk, Code::kInvalidArgument});
  // Within the tensor limit, and the stream stops short of its bytes.
  seeds->Add("put_tensor_at_limit_short",
             Stream({Header(te::v1::FLOAT32, {kMaxTensorBytes / 4}), Data(4000, '\x03')}),
             {Code::kInvalidArgument});
  seeds->Add("put_tensor_short", Stream({Header(te::v1::FLOAT32, {6, 4}), Data(40, '\x01')}),
             {Code::kInvalidArgument});
  seeds->Add("put_tensor_header_only", Stream({Header(te::v1::BFLOAT16, {3, 5})}),
             {Code::kInvalidArgument});
  seeds->Add("put_tensor_long",
             Stream({Header(te::v1::FLOAT32, {6, 4}), Data(90, '\x01'), Data(90, '\x02')}),
             {Code::kInvalidArgument});
  seeds->Add("put_tensor_second_header",
             Stream({Header(te::v1::FLOAT32, {2}), Data(4, 'a'), Header(te::v1::FLOAT32, {2})}),
             {Code::kInvalidArgument});
  seeds->Add("put_tensor_zero_elements", Stream({Header(te::v1::FLOAT32, {0, 7})}));
  seeds->Add("put_tensor_unspecified_dtype", Stream({Header(te::v1::DTYPE_UNSPECIFIED, {4})}),
             {Code::kInvalidArgument});
  // From the live shared-memory region (an empty region id), and past its end.
  te::v1::PutTensorChunk shm = Header(te::v1::FLOAT32, {64, 4});
  shm.mutable_header()->mutable_shm()->set_offset(128);
  seeds->Add("put_tensor_shm", Stream({shm}));
  shm.mutable_header()->mutable_shm()->set_offset(std::numeric_limits<uint64_t>::max() - 16);
  seeds->Add("put_tensor_shm_offset_wraps", Stream({shm}), {Code::kInvalidArgument});
  shm = Header(te::v1::FLOAT32, {int64_t{1} << 20});
  shm.mutable_header()->mutable_shm();
  seeds->Add("put_tensor_shm_past_end", Stream({shm}), {Code::kInvalidArgument});
  shm = Header(te::v1::FLOAT32, {4});
  shm.mutable_header()->mutable_shm();
  seeds->Add("put_tensor_shm_then_data", Stream({shm, Data(16, 'z')}), {Code::kInvalidArgument});
}

// ---- hostile: steps -----------------------------------------------------------------

void AddHostileSteps(Seeds* seeds) {
  // Many micro-batches, each naming the resident x and dy (a few bytes each):
  // validated in full, never run (the harness's cap).
  for (int count : {kMaxRunMicroBatches, kMaxRunMicroBatches + 1, kMaxMicroBatches,
                    kMaxMicroBatches + 1, 1000}) {
    te::v1::ForwardBackwardRequest step;
    *step.mutable_autocast() = DelayedScaling();
    for (int i = 0; i < count; ++i) step.add_micro_batches()->set_dropout_seed(i);
    step.set_return_dx(true);
    seeds->Add(absl::StrCat("forward_backward_", count, "_micro_batches"),
               Input(Rpc::kForwardBackward, 0, step),
               count <= kMaxRunMicroBatches ? std::vector<Code>{Code::kOk}
                                            : std::vector<Code>{Code::kInvalidArgument});
  }
  // The client's patience (flags bits 6-7): a deadline already passed, a
  // cancel after the call's first or third check; every kind of step.
  for (Interrupt interrupt :
       {Interrupt::kDeadlinePassed, Interrupt::kCancelAfterOne, Interrupt::kCancelAfterThree}) {
    const std::string how = interrupt == Interrupt::kDeadlinePassed   ? "deadline_passed"
                            : interrupt == Interrupt::kCancelAfterOne ? "cancel_after_1"
                                                                      : "cancel_after_3";
    const std::vector<Code> interrupted = {Code::kOk, Code::kDeadlineExceeded, Code::kCancelled};
    for (LayerKind kind :
         {LayerKind::kTransformerFp8, LayerKind::kUnfusedGraphFp8, LayerKind::kDenseFp8}) {
      const uint8_t flags = KindFlags(kind) | InterruptFlags(interrupt);
      te::v1::ForwardBackwardRequest step;
      *step.mutable_autocast() = AutocastOf(kind);
      for (int i = 0; i < 3; ++i) step.add_micro_batches()->set_dropout_seed(i);
      seeds->Add(absl::StrCat("forward_backward_", how, "_", KindName(kind)),
                 Input(Rpc::kForwardBackward, flags, step), interrupted);
      te::v1::ForwardRequest forward;
      *forward.mutable_autocast() = AutocastOf(kind);
      forward.set_keep_for_backward(kind != LayerKind::kDenseFp8);
      seeds->Add(absl::StrCat("forward_", how, "_", KindName(kind)),
                 Input(Rpc::kForward, flags, forward), interrupted);
      te::v1::BackwardRequest backward;
      backward.set_keep_grads(true);
      seeds->Add(absl::StrCat("backward_", how, "_", KindName(kind)),
                 Input(Rpc::kBackward, flags, backward), interrupted);
    }
  }

  // The steps fail on the last micro-batch: nothing may have run.
  {
    te::v1::ForwardBackwardRequest step;
    *step.mutable_autocast() = DelayedScaling();
    step.add_micro_batches();
    *step.add_micro_batches()->mutable_dy() = Floats({2, 3, 5}, 0.1f);
    seeds->Add("forward_backward_bad_last_dy", Input(Rpc::kForwardBackward, 0, step),
               {Code::kInvalidArgument});
  }
  // Micro-batches of different shapes (each valid on its own).
  {
    te::v1::ForwardBackwardRequest step;
    *step.mutable_autocast() = DelayedScaling();
    step.add_micro_batches();
    te::v1::MicroBatch* other = step.add_micro_batches();
    *other->mutable_x() = Floats({1, 5, 8}, 0.3f);
    *other->mutable_dy() = Floats({1, 5, 4}, 0.3f);
    step.set_return_grads(true);
    seeds->Add("forward_backward_mixed_shapes", Input(Rpc::kForwardBackward, 0, step));
  }
  // FP8: a recipe other than the layer's, FP8 on a layer without FP8 state,
  // a longer amax history than the layer's.
  te::v1::ForwardRequest forward;
  forward.set_keep_for_backward(true);
  *forward.mutable_autocast() = CurrentScaling();
  seeds->Add("forward_dense_fp8_current_scaling", Input(Rpc::kForward, 0, forward));
  *forward.mutable_autocast() = Mxfp8();
  // MXFP8 is emulated on the CPU, and the live session's policy is FALLBACK.
  seeds->Add("forward_dense_fp8_mxfp8", Input(Rpc::kForward, 0, forward),
             {Code::kOk, Code::kFailedPrecondition});
  *forward.mutable_autocast() = DelayedScaling(1024);
  seeds->Add("forward_dense_fp8_history_1024", Input(Rpc::kForward, 0, forward),
             {Code::kOk, Code::kInvalidArgument});
  forward.clear_autocast();
  seeds->Add("forward_dense_fp8_without_autocast", Input(Rpc::kForward, 0, forward));
  *forward.mutable_autocast() = DelayedScaling();
  // Current scaling keeps no fp8_metas: DelayedScaling on it has none to use.
  seeds->Add("forward_current_scaling_layer_delayed_scaling",
             Input(Rpc::kForward, KindFlags(LayerKind::kMhaCurrentScaling), forward),
             {Code::kFailedPrecondition});
  seeds->Add("forward_mxfp8_layer_delayed_scaling",
             Input(Rpc::kForward, KindFlags(LayerKind::kLayerNormDenseMxfp8), forward),
             {Code::kFailedPrecondition});
  forward.mutable_autocast()->mutable_recipe()->Clear();
  forward.mutable_autocast()->mutable_recipe()->mutable_nvfp4_block_scaling();
  seeds->Add("forward_dense_fp8_nvfp4", Input(Rpc::kForward, 0, forward),
             {Code::kInvalidArgument, Code::kFailedPrecondition, Code::kUnimplemented});
  // FP8 on, no recipe: the session's negotiated DelayedScaling.
  forward.mutable_autocast()->clear_recipe();
  seeds->Add("forward_dense_fp8_negotiated", Input(Rpc::kForward, 0, forward));
  // x that does not fit the layer, and x of another float dtype.
  forward.clear_autocast();
  *forward.mutable_x() = Floats({2, 3, 9}, 0.2f);
  seeds->Add("forward_x_does_not_fit", Input(Rpc::kForward, 0, forward), {Code::kInvalidArgument});
  // Extra inputs: a layer that takes none, and an attention whose k, v do not
  // fit q (another length, another head count, one missing).
  forward.clear_x();
  *forward.add_extra_inputs() = Live();
  seeds->Add("forward_dense_extra_input", Input(Rpc::kForward, 0, forward),
             {Code::kInvalidArgument});
  forward.clear_extra_inputs();
  const uint8_t attention = KindFlags(LayerKind::kAttentionGraphFp8);
  *forward.mutable_autocast() = DelayedScaling();
  *forward.add_extra_inputs() = Floats({2, 5, 2, 4}, 0.1f);
  *forward.add_extra_inputs() = Floats({2, 5, 2, 4}, 0.2f);
  seeds->Add("forward_attention_graph_longer_kv", Input(Rpc::kForward, attention, forward),
             {Code::kOk, Code::kInvalidArgument});
  forward.clear_extra_inputs();
  *forward.add_extra_inputs() = Floats({2, 3, 1, 4}, 0.1f);
  *forward.add_extra_inputs() = Floats({2, 3, 2, 4}, 0.2f);
  seeds->Add("forward_attention_graph_k_heads_differ",
             Input(Rpc::kForward, attention, forward), {Code::kInvalidArgument});
  forward.clear_extra_inputs();
  *forward.add_extra_inputs() = Live();
  seeds->Add("forward_attention_graph_one_extra", Input(Rpc::kForward, attention, forward),
             {Code::kInvalidArgument});
  forward.clear_extra_inputs();
  // The live graph: k and v of another length (a reshape's -1 takes it), of
  // a count the reshape cannot hold, of another dtype, one missing, from shm.
  {
    const uint8_t graph = KindFlags(LayerKind::kGraphFp8);
    te::v1::ForwardRequest g = forward;
    g.set_keep_for_backward(true);
    *g.add_extra_inputs() = Floats({2, 5, 8}, 0.1f);
    *g.add_extra_inputs() = Floats({2, 5, 8}, 0.2f);
    seeds->Add("forward_graph_longer_kv", Input(Rpc::kForward, graph, g),
               {Code::kOk, Code::kInvalidArgument});
    g.clear_extra_inputs();
    *g.add_extra_inputs() = Floats({2, 3, 7}, 0.1f);
    *g.add_extra_inputs() = Floats({2, 3, 7}, 0.2f);
    seeds->Add("forward_graph_kv_not_divisible", Input(Rpc::kForward, graph, g),
               {Code::kInvalidArgument});
    g.clear_extra_inputs();
    *g.add_extra_inputs() = Floats({2, 5, 8}, 0.1f);
    *g.add_extra_inputs() = Floats({2, 3, 8}, 0.2f);
    seeds->Add("forward_graph_k_v_lengths_differ", Input(Rpc::kForward, graph, g),
               {Code::kInvalidArgument});
    g.clear_extra_inputs();
    te::v1::Tensor ints;
    ints.set_dtype(te::v1::INT32);
    for (int64_t d : {2, 3, 8}) ints.add_shape(d);
    ints.set_inline_data(std::string(2 * 3 * 8 * 4, '\x01'));
    *g.add_extra_inputs() = ints;
    *g.add_extra_inputs() = ints;
    seeds->Add("forward_graph_kv_int32", Input(Rpc::kForward, graph, g), {Code::kInvalidArgument});
    g.clear_extra_inputs();
    *g.add_extra_inputs() = Live();
    seeds->Add("forward_graph_one_extra", Input(Rpc::kForward, graph, g), {Code::kInvalidArgument});
    g.clear_extra_inputs();
    te::v1::Tensor shm;
    shm.set_dtype(te::v1::FLOAT32);
    for (int64_t d : {2, 2048, 4}) shm.add_shape(d);
    shm.mutable_shm();
    *g.add_extra_inputs() = shm;
    *g.add_extra_inputs() = shm;
    seeds->Add("forward_graph_kv_2048_from_shm", Input(Rpc::kForward, graph, g),
               {Code::kOk, Code::kInvalidArgument, Code::kResourceExhausted});
    te::v1::ForwardBackwardRequest step;
    *step.mutable_autocast() = DelayedScaling();
    step.add_micro_batches();
    te::v1::MicroBatch* other = step.add_micro_batches();
    *other->add_extra_inputs() = Floats({2, 6, 8}, 0.3f);
    *other->add_extra_inputs() = Floats({2, 6, 8}, 0.4f);
    te::v1::MicroBatch* bad = step.add_micro_batches();
    *bad->add_extra_inputs() = Floats({2, 3, 7}, 0.3f);
    *bad->add_extra_inputs() = Floats({2, 3, 7}, 0.4f);
    seeds->Add("forward_backward_graph_third_kv_bad", Input(Rpc::kForwardBackward, graph, step),
               {Code::kInvalidArgument});
    step.mutable_micro_batches()->RemoveLast();
    seeds->Add("forward_backward_graph_kv_lengths", Input(Rpc::kForwardBackward, graph, step),
               {Code::kOk, Code::kInvalidArgument});
  }
  for (int i = 0; i < 3; ++i) *forward.add_extra_inputs() = Live();
  seeds->Add("forward_unfused_graph_fp8_extra_inputs",
             Input(Rpc::kForward, KindFlags(LayerKind::kUnfusedGraphFp8), forward),
             {Code::kInvalidArgument});
  forward.clear_extra_inputs();
  // y into the live region: fits, and past its end.
  forward.set_keep_for_backward(false);
  forward.mutable_y_shm()->set_offset(64);
  seeds->Add("forward_y_shm", Input(Rpc::kForward, 0, forward));
  forward.mutable_y_shm()->set_offset(kShmRegionBytes - 8);
  seeds->Add("forward_y_shm_past_end", Input(Rpc::kForward, 0, forward), {Code::kInvalidArgument});
  forward.clear_y_shm();

  // Inputs from the live shared-memory region (a few bytes of request), 1500
  // tokens: TransformerLayer's relative bias [2, 1500, 1500] float32 passes
  // the session's memory. Alone it fails before anything changes; as the
  // second micro-batch of a step it fails after the first has run (its FP8
  // update included), and the failed call must leave the fp8_metas as they
  // were. The attention layers without a bias run them within memory.
  {
    te::v1::Tensor big;
    big.set_dtype(te::v1::FLOAT32);
    big.add_shape(1);
    big.add_shape(1500);
    big.add_shape(8);
    big.mutable_shm();
    const std::vector<Code> ok_or_refused = {Code::kOk, Code::kInvalidArgument,
                                             Code::kResourceExhausted};
    for (LayerKind kind : {LayerKind::kTransformerFp8, LayerKind::kMhaCurrentScaling,
                           LayerKind::kUnfusedGraphFp8, LayerKind::kDenseFp8}) {
      const bool exhausts = kind == LayerKind::kTransformerFp8;
      te::v1::ForwardRequest shm_forward;
      *shm_forward.mutable_x() = big;
      *shm_forward.mutable_autocast() = AutocastOf(kind);
      seeds->Add(absl::StrCat("forward_shm_x_1500_tokens_", KindName(kind)),
                 Input(Rpc::kForward, KindFlags(kind), shm_forward),
                 exhausts ? kRefused : ok_or_refused);
      te::v1::ForwardBackwardRequest shm_step;
      *shm_step.mutable_autocast() = AutocastOf(kind);
      shm_step.add_micro_batches();
      te::v1::MicroBatch* second = shm_step.add_micro_batches();
      *second->mutable_x() = big;
      *second->mutable_dy() = big;
      if (kind == LayerKind::kDenseFp8) second->mutable_dy()->set_shape(2, 4);
      seeds->Add(absl::StrCat("forward_backward_shm_second_1500_tokens_", KindName(kind)),
                 Input(Rpc::kForwardBackward, KindFlags(kind), shm_step),
                 exhausts ? kRefused : ok_or_refused);
    }
  }

  // Backward: dy of another shape or dtype (the forward must survive), a
  // forward id of another layer kind's, twice the same forward.
  te::v1::BackwardRequest backward;
  *backward.mutable_dy() = Floats({2, 3, 5}, 0.1f);
  seeds->Add("backward_dy_wrong_shape", Input(Rpc::kBackward, 0, backward),
             {Code::kInvalidArgument});
  backward.mutable_dy()->set_dtype(te::v1::BFLOAT16);
  backward.mutable_dy()->clear_shape();
  backward.mutable_dy()->add_shape(2);
  backward.mutable_dy()->add_shape(3);
  backward.mutable_dy()->add_shape(4);
  backward.mutable_dy()->set_inline_data(std::string(48, '\0'));
  seeds->Add("backward_dy_bf16", Input(Rpc::kBackward, 0, backward), {Code::kInvalidArgument});
  backward.clear_dy();
  backward.set_forward_id("forward-1");
  seeds->Add("backward_unknown_forward", Input(Rpc::kBackward, 0, backward), {Code::kNotFound});
  // Benchmarks: a deadline passes; forward-only FP8.
  te::v1::BenchmarkRequest benchmark;
  *benchmark.mutable_autocast() = DelayedScaling();
  *benchmark.mutable_inputs()->mutable_dy() = Live();
  benchmark.set_warmup_iters(100000);
  benchmark.set_timing_iters(100000);
  seeds->Add("benchmark_deadline", Input(Rpc::kBenchmark, 0, benchmark), {Code::kDeadlineExceeded});
  benchmark.set_warmup_iters(-1);
  seeds->Add("benchmark_negative_iters", Input(Rpc::kBenchmark, 0, benchmark),
             {Code::kInvalidArgument});
  benchmark.set_warmup_iters(2);
  benchmark.set_timing_iters(2);
  benchmark.set_forward_only(true);
  benchmark.mutable_inputs()->clear_dy();
  seeds->Add("benchmark_forward_only_fp8", Input(Rpc::kBenchmark, 0, benchmark));

  // SetVariables: an amax history of another length; grads of a wrong shape.
  te::v1::SetVariablesRequest set;
  te::v1::Variable* v = set.add_variables();
  v->set_collection("grads");
  v->set_path("kernel");
  *v->mutable_value() = Floats({8, 5}, 0.1f);
  seeds->Add("set_variables_grads_wrong_shape", Input(Rpc::kSetVariables, 0, set),
             {Code::kInvalidArgument});
  v->set_collection("params");
  *v->mutable_value() = Floats({8, 4}, 0.1f);
  te::v1::Variable* w = set.add_variables();
  w->set_collection("params");
  w->set_path("missing");
  *w->mutable_value() = Floats({4}, 0.1f);
  seeds->Add("set_variables_second_missing", Input(Rpc::kSetVariables, 0, set),
             {Code::kInvalidArgument});
  // GetTensor into the live region.
  te::v1::GetTensorRequest get;
  get.mutable_destination()->set_offset(8);
  seeds->Add("get_tensor_to_shm", Input(Rpc::kGetTensor, 0, get));
  get.mutable_destination()->set_offset(kShmRegionBytes - 4);
  seeds->Add("get_tensor_to_shm_past_end", Input(Rpc::kGetTensor, 0, get),
             {Code::kInvalidArgument});
}

}  // namespace

std::vector<Seed> SeedInputs() {
  Seeds seeds;
  AddBasics(&seeds);
  AddPerKind(&seeds);
  AddHostileInit(&seeds);
  AddHostilePut(&seeds);
  AddHostileSteps(&seeds);
  return seeds.Take();
}

}  // namespace te::fuzz
