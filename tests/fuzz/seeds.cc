// The seed corpus: valid requests of every RPC the harness runs, at the
// harness's sizes (x: [2, 3, 8] float32 into a DenseGeneral of 4 features).
#include <string>
#include <utility>
#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "te/state/v1/session_state.pb.h"
#include "te/v1/service.pb.h"
#include "tests/fuzz/request_harness.h"

namespace te::fuzz {
namespace {

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

te::v1::Autocast Fp8() {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(4);
  return autocast;
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

void AddInit(std::vector<std::pair<std::string, std::string>>* seeds, const std::string& name,
             const te::v1::LayerSpec& spec, std::vector<int64_t> shape, bool fp8) {
  te::v1::InitLayerRequest init;
  *init.mutable_spec() = spec;
  init.set_seed(11);
  init.set_input_dtype(te::v1::FLOAT32);
  init.mutable_input_shape()->Assign(shape.begin(), shape.end());
  if (fp8) *init.mutable_autocast() = Fp8();
  seeds->emplace_back("init_" + name, Input(Rpc::kInitLayer, 0, init));
}

}  // namespace

std::vector<std::pair<std::string, std::string>> SeedInputs() {
  std::vector<std::pair<std::string, std::string>> seeds;

  te::v1::CreateSessionRequest create;
  create.add_preferred_recipes()->mutable_delayed_scaling()->set_amax_history_len(16);
  create.add_preferred_recipes()->mutable_float8_current_scaling();
  create.set_policy(te::v1::FALLBACK);
  create.set_ttl_seconds(60);
  seeds.emplace_back("create_session", Input(Rpc::kCreateSession, 0, create));
  create.set_policy(te::v1::STRICT);
  create.clear_preferred_recipes();
  create.add_preferred_recipes()->mutable_mxfp8_block_scaling();
  seeds.emplace_back("create_session_strict_mxfp8", Input(Rpc::kCreateSession, 0, create));

  seeds.emplace_back("close_session", Input(Rpc::kCloseSession, 0, te::v1::CloseSessionRequest()));

  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(4);
  AddInit(&seeds, "dense_general_fp8", spec, {2, 3, 8}, true);
  spec.Clear();
  spec.mutable_layer_norm()->set_epsilon(1e-5f);
  AddInit(&seeds, "layer_norm", spec, {2, 3, 8}, false);
  spec.Clear();
  spec.mutable_layer_norm_mlp()->set_intermediate_dim(16);
  spec.mutable_layer_norm_mlp()->add_activations("gelu");
  spec.mutable_layer_norm_mlp()->add_activations("linear");
  AddInit(&seeds, "layer_norm_mlp_fp8", spec, {2, 3, 8}, true);
  spec.Clear();
  spec.mutable_transformer_layer()->set_hidden_size(8);
  spec.mutable_transformer_layer()->set_mlp_hidden_size(16);
  spec.mutable_transformer_layer()->set_num_attention_heads(2);
  AddInit(&seeds, "transformer_layer", spec, {2, 3, 8}, false);
  spec.Clear();
  spec.mutable_multi_head_attention()->set_head_dim(4);
  spec.mutable_multi_head_attention()->set_num_attention_heads(2);
  AddInit(&seeds, "multi_head_attention", spec, {2, 3, 8}, false);

  te::v1::ForwardRequest forward;
  *forward.mutable_x() = Floats({2, 3, 8}, 0.7f);
  forward.set_keep_for_backward(true);
  *forward.mutable_autocast() = Fp8();
  seeds.emplace_back("forward_fp8", Input(Rpc::kForward, 0, forward));
  forward.clear_autocast();
  forward.set_keep_outputs(true);
  forward.set_deterministic(true);
  seeds.emplace_back("forward_keep_outputs_undone", Input(Rpc::kForward, 4, forward));

  te::v1::BackwardRequest backward;
  *backward.mutable_dy() = Floats({2, 3, 4}, 0.3f);
  backward.set_keep_grads(true);
  seeds.emplace_back("backward", Input(Rpc::kBackward, 0, backward));

  te::v1::ForwardBackwardRequest step;
  *step.mutable_autocast() = Fp8();
  for (int i = 0; i < 2; ++i) {
    te::v1::MicroBatch* batch = step.add_micro_batches();
    *batch->mutable_x() = Floats({2, 3, 8}, 0.5f + i);
    *batch->mutable_dy() = Floats({2, 3, 4}, 0.2f);
    batch->set_dropout_seed(i);
  }
  step.set_return_dx(true);
  step.set_return_grads(true);
  seeds.emplace_back("forward_backward_fp8", Input(Rpc::kForwardBackward, 0, step));

  te::v1::GetVariablesRequest get_variables;
  get_variables.add_collections("params");
  get_variables.add_collections("fp8_metas");
  seeds.emplace_back("get_variables", Input(Rpc::kGetVariables, 0, get_variables));

  te::v1::SetVariablesRequest set_variables;
  te::v1::Variable* kernel = set_variables.add_variables();
  kernel->set_collection("params");
  kernel->set_path("kernel");
  *kernel->mutable_value() = Floats({8, 4}, 0.1f);
  te::v1::Variable* bias = set_variables.add_variables();
  bias->set_collection("params");
  bias->set_path("bias");
  *bias->mutable_value() = Floats({4}, 0.1f);
  seeds.emplace_back("set_variables", Input(Rpc::kSetVariables, 0, set_variables));

  te::v1::PutTensorChunk header;
  header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
  header.mutable_header()->mutable_tensor()->add_shape(6);
  header.mutable_header()->mutable_tensor()->add_shape(4);
  te::v1::PutTensorChunk first, second;
  first.set_data(std::string(40, '\x01'));
  second.set_data(std::string(56, '\x02'));
  seeds.emplace_back("put_tensor", Stream({header, first, second}));

  te::v1::GetTensorRequest get_tensor;
  get_tensor.set_chunk_bytes(16);
  seeds.emplace_back("get_tensor", Input(Rpc::kGetTensor, 0, get_tensor));
  seeds.emplace_back("delete_tensor", Input(Rpc::kDeleteTensor, 0, te::v1::DeleteTensorRequest()));

  te::v1::BenchmarkRequest benchmark;
  *benchmark.mutable_inputs()->mutable_x() = Floats({2, 3, 8}, 0.4f);
  *benchmark.mutable_inputs()->mutable_dy() = Floats({2, 3, 4}, 0.4f);
  benchmark.set_warmup_iters(1);
  benchmark.set_timing_iters(2);
  seeds.emplace_back("benchmark", Input(Rpc::kBenchmark, 0, benchmark));

  te::v1::RegisterSharedMemoryRequest region;
  region.set_name("/te_client_1_0");
  region.set_size(4096);
  seeds.emplace_back("register_shared_memory", Input(Rpc::kRegisterSharedMemory, 0, region));
  te::v1::UnregisterSharedMemoryRequest unregister;
  unregister.set_region_id("region-5");
  seeds.emplace_back("unregister_shared_memory",
                     Input(Rpc::kUnregisterSharedMemory, 0, unregister));

  seeds.emplace_back("checkpoint", Input(Rpc::kCheckpoint, 0, te::v1::CheckpointRequest()));

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
  seeds.emplace_back("restore_checkpoint", Input(Rpc::kRestoreCheckpoint, 0, state));

  te::v1::GetSessionInfoRequest info;
  seeds.emplace_back("get_session_info", Input(Rpc::kGetSessionInfo, 0, info));
  return seeds;
}

}  // namespace te::fuzz
