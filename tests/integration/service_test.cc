// Every RPC of te.v1.TeService against the real te_server over a loopback
// socket, at small sizes, with numerical checks against host references where
// the math is simple enough to restate (DenseGeneral, the FP8 scale update).
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

using te::v1::TeService;

class ServiceTest : public ServerSuite {
 protected:
  // The server's device: "cpu" here, "cuda:0" when run with TE_SERVER_FLAGS=--device=auto.
  std::string DeviceName() {
    grpc::ClientContext context;
    te::v1::ServerInfo info;
    const grpc::Status status =
        stub_->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return info.devices_size() > 0 ? info.devices(0).name() : "";
  }

  te::v1::InitLayerResponse Init(const te::v1::LayerSpec& spec,
                                 const std::vector<int64_t>& input_shape,
                                 te::v1::DType dtype, const te::v1::Autocast& autocast = {},
                                 uint64_t seed = 42) {
    te::v1::InitLayerRequest request = WithSession(te::v1::InitLayerRequest());
    *request.mutable_spec() = spec;
    request.set_seed(seed);
    request.set_input_dtype(dtype);
    for (int64_t d : input_shape) request.add_input_shape(d);
    *request.mutable_autocast() = autocast;
    grpc::ClientContext context;
    te::v1::InitLayerResponse response;
    const grpc::Status status = stub_->InitLayer(&context, request, &response);
    EXPECT_TRUE(status.ok()) << "InitLayer: " << Describe(status);
    return response;
  }

  grpc::Status Forward(const te::v1::ForwardRequest& request, te::v1::ForwardResponse* response) {
    grpc::ClientContext context;
    return stub_->Forward(&context, WithSession(request), response);
  }

  grpc::Status Backward(const te::v1::BackwardRequest& request,
                        te::v1::BackwardResponse* response) {
    grpc::ClientContext context;
    return stub_->Backward(&context, WithSession(request), response);
  }

  grpc::Status ForwardBackward(const te::v1::ForwardBackwardRequest& request,
                               te::v1::ForwardBackwardResponse* response) {
    grpc::ClientContext context;
    return stub_->ForwardBackward(&context, WithSession(request), response);
  }

  grpc::Status SetVariables(const std::string& layer_id,
                            const std::map<std::string, te::v1::Tensor>& values) {
    te::v1::SetVariablesRequest request = WithSession(te::v1::SetVariablesRequest());
    request.set_layer_id(layer_id);
    for (const auto& [name, value] : values) {
      te::v1::Variable* v = request.add_variables();
      v->set_collection(name.substr(0, name.find('/')));
      v->set_path(name.substr(name.find('/') + 1));
      *v->mutable_value() = value;
    }
    grpc::ClientContext context;
    te::v1::SetVariablesResponse response;
    return stub_->SetVariables(&context, request, &response);
  }

  // Uploads `bytes` with PutTensor in chunks of `chunk` bytes.
  grpc::Status Put(te::v1::DType dtype, const std::vector<int64_t>& shape,
                   const std::string& bytes, size_t chunk, te::v1::PutTensorResponse* response) {
    grpc::ClientContext context;
    auto writer = stub_->PutTensor(&context, response);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(dtype);
    for (int64_t d : shape) header.mutable_header()->mutable_tensor()->add_shape(d);
    writer->Write(header);
    for (size_t offset = 0; offset < bytes.size(); offset += chunk) {
      te::v1::PutTensorChunk data;
      data.set_data(bytes.substr(offset, chunk));
      if (!writer->Write(data)) break;
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // Fetches a resident tensor with GetTensor; returns the header and bytes.
  grpc::Status Get(const std::string& id, int chunk_bytes, te::v1::TensorHeader* header,
                   std::string* bytes, int* chunks) {
    grpc::ClientContext context;
    te::v1::GetTensorRequest request = WithSession(te::v1::GetTensorRequest());
    request.set_tensor_id(id);
    request.set_chunk_bytes(chunk_bytes);
    auto reader = stub_->GetTensor(&context, request);
    te::v1::TensorChunk message;
    *chunks = 0;
    bytes->clear();
    while (reader->Read(&message)) {
      if (message.has_header()) {
        *header = message.header();
      } else {
        bytes->append(message.data());
        ++*chunks;
      }
    }
    return reader->Finish();
  }
};

te::v1::LayerSpec DenseSpec(int features) {
  te::v1::LayerSpec spec;
  spec.mutable_dense_general()->add_features(features);
  return spec;
}

te::v1::LayerSpec SmallTransformerSpec() {
  te::v1::LayerSpec spec;
  te::v1::TransformerLayer* layer = spec.mutable_transformer_layer();
  layer->set_hidden_size(32);
  layer->set_mlp_hidden_size(64);
  layer->set_num_attention_heads(4);
  return spec;
}

te::v1::Autocast DelayedScalingAutocast(int history) {
  te::v1::Autocast autocast;
  autocast.set_enabled(true);
  autocast.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(history);
  return autocast;
}

// ---- server info, health, reflection --------------------------------------------------

TEST_F(ServiceTest, GetServerInfo) {
  grpc::ClientContext context;
  te::v1::ServerInfo info;
  ASSERT_TRUE(stub_->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info).ok());
  EXPECT_FALSE(info.version().empty());
  ASSERT_EQ(info.devices_size(), 1);
  const te::v1::DeviceInfo& device = info.devices(0);
  EXPECT_EQ(device.name(), DeviceName());
  EXPECT_EQ(device.backend(), device.name() == "cpu" ? "cpu" : "cuda");
  EXPECT_TRUE(device.healthy());
  std::map<te::v1::RecipeKind, te::v1::Support> support;
  for (const auto& r : device.recipes()) support[r.kind()] = r.support();
  EXPECT_EQ(support.size(), 4u);
  if (device.name() == "cpu" || device.compute_capability() == 90) {  // the reference, Hopper
    EXPECT_EQ(support[te::v1::DELAYED_SCALING], te::v1::NATIVE);
    EXPECT_EQ(support[te::v1::FLOAT8_CURRENT_SCALING], te::v1::NATIVE);
    EXPECT_EQ(support[te::v1::MXFP8_BLOCK_SCALING], te::v1::EMULATED);
    EXPECT_EQ(support[te::v1::NVFP4_BLOCK_SCALING], te::v1::EMULATED);
  }
  EXPECT_NE(std::find(info.backends().begin(), info.backends().end(), device.backend()),
            info.backends().end());
  EXPECT_EQ(info.dtypes_size(), 7);
  // The suite's flags come back as limits.
  EXPECT_EQ(info.limits().max_saved_forwards(), 4);
  EXPECT_EQ(info.limits().max_session_memory_bytes(), int64_t{1} << 30);
  EXPECT_EQ(info.limits().max_sessions(), 64);
  EXPECT_EQ(info.limits().max_message_bytes(), int64_t{64} << 20);
  EXPECT_EQ(info.limits().session_ttl_seconds(), 1800);
}

TEST_F(ServiceTest, HealthIsServing) {
  EXPECT_EQ(HealthStatus(server_->NewChannel(), ""), 1);
  EXPECT_EQ(HealthStatus(server_->NewChannel(), "te.v1.TeService"), 1);
}

TEST_F(ServiceTest, ReflectionListsTheService) {
  grpc::CompletionQueue cq;
  grpc::GenericStub stub(server_->NewChannel());
  grpc::ClientContext context;
  auto call = stub.PrepareCall(
      &context, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  ASSERT_NE(call, nullptr);
  void* tag = nullptr;
  bool ok = false;
  auto step = [&](intptr_t expected) {
    ASSERT_TRUE(cq.Next(&tag, &ok));
    EXPECT_EQ(reinterpret_cast<intptr_t>(tag), expected);
  };
  call->StartCall(reinterpret_cast<void*>(1));
  step(1);
  // ServerReflectionRequest{list_services: ""} = field 7, length 0.
  const std::string request_bytes("\x3a\x00", 2);
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  call->Write(request, reinterpret_cast<void*>(2));
  step(2);
  call->WritesDone(reinterpret_cast<void*>(3));
  step(3);
  grpc::ByteBuffer response;
  call->Read(&response, reinterpret_cast<void*>(4));
  step(4);
  EXPECT_TRUE(ok);
  grpc::Status status;
  call->Finish(&status, reinterpret_cast<void*>(5));
  step(5);
  EXPECT_TRUE(status.ok()) << Describe(status);
  std::vector<grpc::Slice> slices;
  response.Dump(&slices);
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  EXPECT_NE(bytes.find("te.v1.TeService"), std::string::npos);
  EXPECT_NE(bytes.find("grpc.health.v1.Health"), std::string::npos);
}

// ---- sessions -------------------------------------------------------------------

TEST_F(ServiceTest, SessionsAuthenticateAndClose) {
  const te::v1::CreateSessionResponse other = CreateSession(*stub_);
  auto info_code = [&](const te::v1::SessionRef& ref) {
    te::v1::GetVariablesRequest request;
    *request.mutable_session() = ref;
    request.set_layer_id("layer-1");
    grpc::ClientContext context;
    te::v1::GetVariablesResponse response;
    return stub_->GetVariables(&context, request, &response).error_code();
  };
  te::v1::SessionRef wrong = session_;
  wrong.set_token("0123456789abcdef0123456789abcdef");
  EXPECT_EQ(info_code(wrong), grpc::StatusCode::UNAUTHENTICATED);
  wrong.clear_token();
  EXPECT_EQ(info_code(wrong), grpc::StatusCode::UNAUTHENTICATED);
  wrong.set_token(other.session().token());
  EXPECT_EQ(info_code(wrong), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(info_code(session_), grpc::StatusCode::NOT_FOUND);  // authenticated; no such layer

  grpc::ClientContext context;
  te::v1::CloseSessionRequest close;
  *close.mutable_session() = other.session();
  te::v1::CloseSessionResponse closed;
  ASSERT_TRUE(stub_->CloseSession(&context, close, &closed).ok());
  te::v1::GetVariablesRequest request;
  *request.mutable_session() = other.session();
  grpc::ClientContext after;
  te::v1::GetVariablesResponse response;
  const grpc::Status status = stub_->GetVariables(&after, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(), "session " + other.session().session_id() + " was closed");
}

TEST_F(ServiceTest, IdleSessionsExpire) {
  te::v1::CreateSessionRequest request;
  request.set_ttl_seconds(1);
  const te::v1::CreateSessionResponse created = CreateSession(*stub_, request);
  EXPECT_EQ(created.ttl_seconds(), 1);
  absl::SleepFor(absl::Milliseconds(2500));  // the server sweeps every second
  te::v1::GetVariablesRequest get;
  *get.mutable_session() = created.session();
  grpc::ClientContext context;
  te::v1::GetVariablesResponse response;
  const grpc::Status status = stub_->GetVariables(&context, get, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(status.error_message(),
            "session " + created.session().session_id() + " expired after 1 s idle");
}

TEST_F(ServiceTest, NegotiationExplainsItsChoice) {
  te::v1::CreateSessionRequest request;
  request.add_preferred_recipes()->mutable_mxfp8_block_scaling();
  request.add_preferred_recipes()->mutable_delayed_scaling();
  const te::v1::CreateSessionResponse fallback = CreateSession(*stub_, request);
  EXPECT_TRUE(fallback.recipe().has_delayed_scaling());
  EXPECT_FALSE(fallback.emulated());
  EXPECT_NE(fallback.negotiation().find("MXFP8BlockScaling skipped"), std::string::npos)
      << fallback.negotiation();
  EXPECT_EQ(fallback.device(), DeviceName());

  request.set_policy(te::v1::EMULATE);
  const te::v1::CreateSessionResponse emulate = CreateSession(*stub_, request);
  EXPECT_TRUE(emulate.recipe().has_mxfp8_block_scaling());
  EXPECT_TRUE(emulate.emulated());
}

// ---- layers ---------------------------------------------------------------------------

// DenseGeneral is y = x @ kernel + bias: forward and backward are checked
// against float64 host math on parameters set through SetVariables.
TEST_F(ServiceTest, DenseGeneralForwardAndBackwardMatchTheHost) {
  constexpr int64_t kBatch = 2, kSeq = 4, kIn = 8, kOut = 16;
  const te::v1::InitLayerResponse init = Init(DenseSpec(kOut), {kBatch, kSeq, kIn},
                                              te::v1::FLOAT32);
  ASSERT_FALSE(init.layer_id().empty());
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& v : init.variables()) {
    shapes[v.collection() + "/" + v.path()] = {v.shape().begin(), v.shape().end()};
  }
  EXPECT_EQ(shapes["params/kernel"], std::vector<int64_t>({kIn, kOut}));
  EXPECT_EQ(shapes["params/bias"], std::vector<int64_t>({kOut}));
  EXPECT_EQ(std::vector<int64_t>(init.output_shape().begin(), init.output_shape().end()),
            std::vector<int64_t>({kBatch, kSeq, kOut}));

  const std::vector<float> kernel = RandomFloats(kIn * kOut, 1, 0.3f);
  const std::vector<float> bias = RandomFloats(kOut, 2);
  ASSERT_TRUE(SetVariables(init.layer_id(),
                           {{"params/kernel", MakeTensor(te::v1::FLOAT32, {kIn, kOut}, kernel)},
                            {"params/bias", MakeTensor(te::v1::FLOAT32, {kOut}, bias)}})
                  .ok());
  const std::vector<float> x = RandomFloats(kBatch * kSeq * kIn, 3);
  te::v1::ForwardRequest forward;
  forward.set_layer_id(init.layer_id());
  *forward.mutable_x() = MakeTensor(te::v1::FLOAT32, {kBatch, kSeq, kIn}, x);
  forward.set_deterministic(true);
  forward.set_keep_for_backward(true);
  te::v1::ForwardResponse y;
  ASSERT_TRUE(Forward(forward, &y).ok());
  EXPECT_EQ(ShapeOf(y.y()), std::vector<int64_t>({kBatch, kSeq, kOut}));
  ASSERT_FALSE(y.forward_id().empty());
  const int64_t rows = kBatch * kSeq;
  std::vector<double> want_y(rows * kOut);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t f = 0; f < kOut; ++f) {
      double acc = bias[f];
      for (int64_t i = 0; i < kIn; ++i) acc += double(x[r * kIn + i]) * kernel[i * kOut + f];
      want_y[r * kOut + f] = acc;
    }
  }
  EXPECT_LT(RelativeError(ToFloats(y.y()), want_y), kF32Tolerance);

  const std::vector<float> dy = RandomFloats(rows * kOut, 4);
  te::v1::BackwardRequest backward;
  backward.set_forward_id(y.forward_id());
  *backward.mutable_dy() = MakeTensor(te::v1::FLOAT32, {kBatch, kSeq, kOut}, dy);
  te::v1::BackwardResponse grads;
  ASSERT_TRUE(Backward(backward, &grads).ok());
  std::vector<double> want_dx(rows * kIn, 0.0), want_dk(kIn * kOut, 0.0), want_db(kOut, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t f = 0; f < kOut; ++f) {
      const double g = dy[r * kOut + f];
      want_db[f] += g;
      for (int64_t i = 0; i < kIn; ++i) {
        want_dx[r * kIn + i] += g * kernel[i * kOut + f];
        want_dk[i * kOut + f] += g * x[r * kIn + i];
      }
    }
  }
  EXPECT_LT(RelativeError(ToFloats(grads.dx()), want_dx), kF32Tolerance);
  std::map<std::string, te::v1::Tensor> by_path;
  for (const auto& g : grads.grads()) {
    EXPECT_EQ(g.collection(), "grads");
    by_path[g.path()] = g.value();
  }
  ASSERT_EQ(by_path.size(), 2u);
  EXPECT_LT(RelativeError(ToFloats(by_path["kernel"]), want_dk), kF32Tolerance);
  EXPECT_LT(RelativeError(ToFloats(by_path["bias"]), want_db), kF32Tolerance);

  // A backward consumes its forward.
  te::v1::BackwardResponse again;
  EXPECT_EQ(Backward(backward, &again).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, LayerNormMlpForwardBackward) {
  te::v1::LayerSpec spec;
  spec.mutable_layer_norm_mlp()->set_intermediate_dim(32);
  spec.mutable_layer_norm_mlp()->add_activations("gelu");
  spec.mutable_layer_norm_mlp()->set_return_layernorm_output(true);  // TE's default is false
  const te::v1::InitLayerResponse init = Init(spec, {2, 4, 16}, te::v1::BFLOAT16);
  ASSERT_FALSE(init.layer_id().empty());
  te::v1::ForwardRequest forward;
  forward.set_layer_id(init.layer_id());
  *forward.mutable_x() = MakeTensor(te::v1::BFLOAT16, {2, 4, 16}, RandomFloats(128, 5));
  forward.set_deterministic(true);
  forward.set_keep_for_backward(true);
  te::v1::ForwardResponse y;
  ASSERT_TRUE(Forward(forward, &y).ok());
  EXPECT_EQ(ShapeOf(y.y()), std::vector<int64_t>({2, 4, 16}));
  EXPECT_EQ(y.y().dtype(), te::v1::BFLOAT16);
  EXPECT_EQ(ShapeOf(y.ln_out()), std::vector<int64_t>({2, 4, 16}));

  te::v1::BackwardRequest backward;
  backward.set_forward_id(y.forward_id());
  *backward.mutable_dy() = MakeTensor(te::v1::BFLOAT16, {2, 4, 16}, RandomFloats(128, 6));
  te::v1::BackwardResponse grads;
  ASSERT_TRUE(Backward(backward, &grads).ok());
  EXPECT_EQ(ShapeOf(grads.dx()), std::vector<int64_t>({2, 4, 16}));
  // One gradient per parameter, same shapes.
  std::map<std::string, std::vector<int64_t>> params;
  for (const auto& v : init.variables()) {
    if (v.collection() == "params") params[v.path()] = {v.shape().begin(), v.shape().end()};
  }
  EXPECT_EQ(static_cast<size_t>(grads.grads_size()), params.size());
  for (const auto& g : grads.grads()) {
    EXPECT_EQ(ShapeOf(g.value()), params[g.path()]) << g.path();
    const std::vector<float> values = ToFloats(g.value());
    EXPECT_TRUE(std::all_of(values.begin(), values.end(), [](float v) { return std::isfinite(v); }));
  }
  EXPECT_NE(params.count("wi_kernel"), 0u);
}

// ForwardBackward over 3 micro-batches equals three separate steps: the
// values are vdot(y_i, dy_i) and the returned gradients their sum.
TEST_F(ServiceTest, TransformerLayerForwardBackwardOverMicroBatches) {
  const std::vector<int64_t> shape = {2, 8, 32};
  const te::v1::InitLayerResponse init = Init(SmallTransformerSpec(), shape, te::v1::BFLOAT16);
  ASSERT_FALSE(init.layer_id().empty());
  std::vector<te::v1::Tensor> xs, dys;
  for (int i = 0; i < 3; ++i) {
    xs.push_back(MakeTensor(te::v1::BFLOAT16, shape, RandomFloats(512, 10 + i)));
    dys.push_back(MakeTensor(te::v1::BFLOAT16, shape, RandomFloats(512, 20 + i)));
  }
  // Three separate steps.
  std::vector<double> want_values;
  std::map<std::string, std::vector<double>> want_grads;
  for (int i = 0; i < 3; ++i) {
    te::v1::ForwardRequest forward;
    forward.set_layer_id(init.layer_id());
    *forward.mutable_x() = xs[i];
    forward.set_deterministic(true);
    forward.set_keep_for_backward(true);
    te::v1::ForwardResponse y;
    ASSERT_TRUE(Forward(forward, &y).ok());
    const std::vector<float> yv = ToFloats(y.y()), dyv = ToFloats(dys[i]);
    double vdot = 0.0;
    for (size_t k = 0; k < yv.size(); ++k) vdot += double(yv[k]) * dyv[k];
    want_values.push_back(vdot);
    te::v1::BackwardRequest backward;
    backward.set_forward_id(y.forward_id());
    *backward.mutable_dy() = dys[i];
    te::v1::BackwardResponse grads;
    ASSERT_TRUE(Backward(backward, &grads).ok());
    for (const auto& g : grads.grads()) {
      const std::vector<float> v = ToFloats(g.value());
      std::vector<double>& sum = want_grads[g.path()];
      sum.resize(v.size(), 0.0);
      for (size_t k = 0; k < v.size(); ++k) sum[k] += v[k];
    }
  }
  te::v1::ForwardBackwardRequest request;
  request.set_layer_id(init.layer_id());
  request.set_deterministic(true);
  request.set_return_dx(true);
  request.set_return_grads(true);
  for (int i = 0; i < 3; ++i) {
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = xs[i];
    *mb->mutable_dy() = dys[i];
  }
  te::v1::ForwardBackwardResponse response;
  ASSERT_TRUE(ForwardBackward(request, &response).ok());
  ASSERT_EQ(response.values_size(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(response.values(i), want_values[i], kBf16Tolerance * std::abs(want_values[i]))
        << "micro-batch " << i;
  }
  ASSERT_EQ(response.dx_size(), 3);
  EXPECT_EQ(ShapeOf(response.dx(2)), shape);
  ASSERT_EQ(static_cast<size_t>(response.grads_size()), want_grads.size());
  for (const auto& g : response.grads()) {
    EXPECT_LT(RelativeError(ToFloats(g.value()), want_grads[g.path()]), kF32Tolerance)
        << g.path();
  }

  // Kept instead of returned: the "grads" collection accumulates over calls.
  request.set_return_grads(false);
  request.set_return_dx(false);
  for (int call = 0; call < 2; ++call) {
    te::v1::ForwardBackwardResponse kept;
    ASSERT_TRUE(ForwardBackward(request, &kept).ok());
    EXPECT_EQ(kept.grads_size(), 0);
  }
  const auto variables = GetAllVariables(*stub_, session_, init.layer_id());
  for (const auto& [path, sum] : want_grads) {
    auto it = variables.find("grads/" + path);
    ASSERT_NE(it, variables.end()) << path;
    std::vector<double> twice(sum);
    for (double& v : twice) v *= 2;
    EXPECT_LT(RelativeError(ToFloats(it->second), twice), kF32Tolerance) << path;
  }

  // Dropped: the values come back, the kept sum stays as it was.
  request.set_discard_grads(true);
  te::v1::ForwardBackwardResponse dropped;
  ASSERT_TRUE(ForwardBackward(request, &dropped).ok());
  ASSERT_EQ(dropped.values_size(), 3);
  EXPECT_NEAR(dropped.values(0), want_values[0], kBf16Tolerance * std::abs(want_values[0]));
  EXPECT_EQ(dropped.grads_size(), 0);
  const auto after = GetAllVariables(*stub_, session_, init.layer_id());
  for (const auto& [path, sum] : want_grads) {
    EXPECT_EQ(after.at("grads/" + path).inline_data(), variables.at("grads/" + path).inline_data())
        << path;
  }
  // Dropped gradients cannot also be returned or applied.
  for (const bool returned : {true, false}) {
    te::v1::ForwardBackwardRequest conflicting = request;
    conflicting.set_return_grads(returned);
    conflicting.set_apply_update(!returned);
    te::v1::ForwardBackwardResponse refused;
    const grpc::Status status = ForwardBackward(conflicting, &refused);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("discard_grads"), std::string::npos)
        << status.error_message();
  }
}

TEST_F(ServiceTest, GetAndSetVariablesRoundTrip) {
  const te::v1::InitLayerResponse init = Init(SmallTransformerSpec(), {2, 8, 32},
                                              te::v1::BFLOAT16);
  const auto before = GetAllVariables(*stub_, session_, init.layer_id());
  ASSERT_EQ(before.size(), static_cast<size_t>(init.variables_size()));
  std::map<std::string, te::v1::Tensor> replaced;
  uint32_t seed = 100;
  for (const auto& [name, tensor] : before) {
    size_t n = 1;
    for (int64_t d : tensor.shape()) n *= d;
    replaced[name] = MakeTensor(tensor.dtype(), ShapeOf(tensor), RandomFloats(n, seed++));
  }
  ASSERT_TRUE(SetVariables(init.layer_id(), replaced).ok());
  const auto after = GetAllVariables(*stub_, session_, init.layer_id());
  ASSERT_EQ(after.size(), replaced.size());
  for (const auto& [name, tensor] : replaced) {
    EXPECT_EQ(after.at(name).inline_data(), tensor.inline_data()) << name;
  }
  // Only what was asked for.
  te::v1::GetVariablesRequest request = WithSession(te::v1::GetVariablesRequest());
  request.set_layer_id(init.layer_id());
  request.add_collections("params");
  grpc::ClientContext context;
  te::v1::GetVariablesResponse params;
  ASSERT_TRUE(stub_->GetVariables(&context, request, &params).ok());
  for (const auto& v : params.variables()) EXPECT_EQ(v.collection(), "params");
}

// ---- resident tensors -----------------------------------------------------------------

TEST_F(ServiceTest, PutAndGetTensorInUnevenChunks) {
  const std::vector<int64_t> shape = {3, 1000, 7};
  const std::vector<float> values = RandomFloats(3 * 1000 * 7, 7);
  const std::string bytes = MakeTensor(te::v1::FLOAT32, shape, values).inline_data();
  te::v1::PutTensorResponse put;
  ASSERT_TRUE(Put(te::v1::FLOAT32, shape, bytes, 10007, &put).ok());  // 10007 does not divide 84000
  EXPECT_EQ(put.bytes(), 84000);
  te::v1::TensorHeader header;
  std::string fetched;
  int chunks = 0;
  ASSERT_TRUE(Get(put.tensor_id(), 4099, &header, &fetched, &chunks).ok());
  EXPECT_EQ(fetched, bytes);
  EXPECT_EQ(chunks, (84000 + 4098) / 4099);
  EXPECT_EQ(header.dtype(), te::v1::FLOAT32);
  EXPECT_EQ(std::vector<int64_t>(header.shape().begin(), header.shape().end()), shape);

  // Too few bytes, too many bytes: INVALID_ARGUMENT, nothing stored.
  te::v1::PutTensorResponse bad;
  EXPECT_EQ(Put(te::v1::FLOAT32, shape, bytes.substr(1), 10007, &bad).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Put(te::v1::FLOAT32, shape, bytes + "x", 10007, &bad).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  grpc::ClientContext context;
  te::v1::DeleteTensorRequest del = WithSession(te::v1::DeleteTensorRequest());
  del.set_tensor_id(put.tensor_id());
  te::v1::DeleteTensorResponse deleted;
  ASSERT_TRUE(stub_->DeleteTensor(&context, del, &deleted).ok());
  EXPECT_EQ(Get(put.tensor_id(), 0, &header, &fetched, &chunks).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(ServiceTest, ResidentTensorsAsInputsAndOutputs) {
  const te::v1::InitLayerResponse init = Init(DenseSpec(16), {2, 4, 8}, te::v1::BFLOAT16);
  const te::v1::Tensor x = MakeTensor(te::v1::BFLOAT16, {2, 4, 8}, RandomFloats(64, 8));
  te::v1::PutTensorResponse put;
  ASSERT_TRUE(Put(te::v1::BFLOAT16, {2, 4, 8}, x.inline_data(), 50, &put).ok());

  te::v1::ForwardRequest inline_forward;
  inline_forward.set_layer_id(init.layer_id());
  inline_forward.set_deterministic(true);
  *inline_forward.mutable_x() = x;
  te::v1::ForwardResponse inline_y;
  ASSERT_TRUE(Forward(inline_forward, &inline_y).ok());

  te::v1::ForwardRequest resident_forward = inline_forward;
  *resident_forward.mutable_x() = ResidentRef(put.tensor_id());
  resident_forward.set_keep_outputs(true);
  te::v1::ForwardResponse resident_y;
  ASSERT_TRUE(Forward(resident_forward, &resident_y).ok());
  ASSERT_FALSE(resident_y.y().resident_id().empty());
  EXPECT_EQ(ShapeOf(resident_y.y()), std::vector<int64_t>({2, 4, 16}));
  te::v1::TensorHeader header;
  std::string y_bytes;
  int chunks = 0;
  ASSERT_TRUE(Get(resident_y.y().resident_id(), 0, &header, &y_bytes, &chunks).ok());
  EXPECT_EQ(y_bytes, inline_y.y().inline_data());  // same input, same output
}

// ---- benchmark -------------------------------------------------------------------------

TEST_F(ServiceTest, Benchmark) {
  const te::v1::InitLayerResponse init = Init(DenseSpec(32), {4, 16}, te::v1::BFLOAT16);
  const auto before = GetAllVariables(*stub_, session_, init.layer_id());
  te::v1::BenchmarkRequest request = WithSession(te::v1::BenchmarkRequest());
  request.set_layer_id(init.layer_id());
  *request.mutable_inputs()->mutable_x() =
      MakeTensor(te::v1::BFLOAT16, {4, 16}, RandomFloats(64, 9));
  *request.mutable_inputs()->mutable_dy() =
      MakeTensor(te::v1::BFLOAT16, {4, 32}, RandomFloats(128, 10));
  request.set_deterministic(true);
  request.set_warmup_iters(1);
  request.set_timing_iters(3);
  grpc::ClientContext context;
  te::v1::BenchmarkResponse response;
  const grpc::Status status = stub_->Benchmark(&context, request, &response);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(response.steps(), 3);
  EXPECT_EQ(response.device(), DeviceName());
  EXPECT_GT(response.min_ms(), 0.0);
  EXPECT_LE(response.min_ms(), response.median_ms());
  EXPECT_LE(response.min_ms(), response.mean_ms());
  // The benchmark leaves the session's state alone.
  const auto after = GetAllVariables(*stub_, session_, init.layer_id());
  for (const auto& [name, tensor] : before) {
    EXPECT_EQ(after.at(name).inline_data(), tensor.inline_data()) << name;
  }
}

// Queued, the timed steps run back to back and only their mean is timed;
// they do the same work, so they hold the same memory as steps timed alone.
TEST_F(ServiceTest, QueuedBenchmarkTimesTheLoopAndHoldsTheSameMemory) {
  const te::v1::InitLayerResponse init = Init(DenseSpec(32), {4, 16}, te::v1::BFLOAT16);
  te::v1::BenchmarkRequest request = WithSession(te::v1::BenchmarkRequest());
  request.set_layer_id(init.layer_id());
  *request.mutable_inputs()->mutable_x() =
      MakeTensor(te::v1::BFLOAT16, {4, 16}, RandomFloats(64, 11));
  *request.mutable_inputs()->mutable_dy() =
      MakeTensor(te::v1::BFLOAT16, {4, 32}, RandomFloats(128, 12));
  request.set_warmup_iters(2);
  request.set_timing_iters(4);
  te::v1::BenchmarkResponse alone, queued;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->Benchmark(&context, request, &alone);
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  request.set_queued(true);
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->Benchmark(&context, request, &queued);
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  EXPECT_EQ(queued.steps(), 4);
  EXPECT_GT(queued.mean_ms(), 0.0);
  EXPECT_EQ(queued.median_ms(), 0.0);  // no step was timed alone
  EXPECT_EQ(queued.min_ms(), 0.0);
  EXPECT_GT(alone.median_ms(), 0.0);
  EXPECT_EQ(queued.peak_bytes_in_use(), alone.peak_bytes_in_use());
}

// ---- FP8 ---------------------------------------------------------------------------------

float MaxAbs(const std::vector<float>& values) {
  float m = 0.0f;
  for (float v : values) m = std::max(m, std::abs(v));
  return m;
}

// Under DelayedScaling (HYBRID, history 4, "max"), after each step of a
// DenseGeneral: x_scale = 448 / max|x| over the window of steps, kernel_scale =
// 448 / max|kernel|, grad_scale = 57344 / max|dy| over the window (TE's
// update, margin 0; 3 steps fit in the window).
TEST_F(ServiceTest, DelayedScalingStateMovesOverSteps) {
  te::v1::CreateSessionRequest create;
  *create.add_preferred_recipes() = DelayedScalingAutocast(4).recipe();
  const te::v1::CreateSessionResponse created = CreateSession(*stub_, create);
  ASSERT_TRUE(created.recipe().has_delayed_scaling());
  UseSession(created.session());
  te::v1::Autocast autocast;
  autocast.set_enabled(true);  // the negotiated recipe
  const te::v1::InitLayerResponse init = Init(DenseSpec(16), {4, 32}, te::v1::BFLOAT16, autocast);
  ASSERT_FALSE(init.layer_id().empty());
  int fp8_variables = 0;
  for (const auto& v : init.variables()) fp8_variables += v.collection() == "fp8_metas";
  EXPECT_EQ(fp8_variables, 6);  // x, kernel, grad: scale + amax_history each

  const auto initial = GetAllVariables(*stub_, session_, init.layer_id());
  EXPECT_EQ(ToFloats(initial.at("fp8_metas/x_scale")), std::vector<float>({1.0f}));
  const float kernel_amax = MaxAbs(ToFloats(initial.at("params/kernel")));
  float window_x_amax = 0.0f, window_dy_amax = 0.0f;  // the history holds every step
  std::vector<float> previous_x_scale;
  for (int step = 0; step < 3; ++step) {
    // Growing inputs, so each step's amax is (almost surely) a new maximum.
    const std::vector<float> x = Rounded(te::v1::BFLOAT16, RandomFloats(128, 30 + step, 1.0f + step));
    const std::vector<float> dy = Rounded(te::v1::BFLOAT16, RandomFloats(64, 40 + step, 0.01f));
    te::v1::ForwardBackwardRequest request;
    request.set_layer_id(init.layer_id());
    request.set_deterministic(true);
    *request.mutable_autocast() = autocast;
    te::v1::MicroBatch* mb = request.add_micro_batches();
    *mb->mutable_x() = MakeTensor(te::v1::BFLOAT16, {4, 32}, x);
    *mb->mutable_dy() = MakeTensor(te::v1::BFLOAT16, {4, 16}, dy);
    te::v1::ForwardBackwardResponse response;
    const grpc::Status status = ForwardBackward(request, &response);
    ASSERT_TRUE(status.ok()) << Describe(status);
    window_x_amax = std::max(window_x_amax, MaxAbs(x));
    window_dy_amax = std::max(window_dy_amax, MaxAbs(dy));

    const auto state = GetAllVariables(*stub_, session_, init.layer_id());
    const std::vector<float> x_scale = ToFloats(state.at("fp8_metas/x_scale"));
    ASSERT_EQ(x_scale.size(), 1u);
    EXPECT_NEAR(x_scale[0], 448.0f / window_x_amax, 1e-5f * x_scale[0]) << "step " << step;
    EXPECT_NEAR(ToFloats(state.at("fp8_metas/kernel_scale"))[0], 448.0f / kernel_amax,
                1e-5f * 448.0f / kernel_amax);
    const float grad_scale = ToFloats(state.at("fp8_metas/grad_scale"))[0];
    EXPECT_NEAR(grad_scale, 57344.0f / window_dy_amax, 1e-5f * grad_scale) << "step " << step;
    // The newest amax sits at the end of the rolled history.
    const std::vector<float> history = ToFloats(state.at("fp8_metas/x_amax_history"));
    ASSERT_EQ(history.size(), 4u);
    EXPECT_EQ(history.back(), MaxAbs(x));
    if (!previous_x_scale.empty()) { EXPECT_NE(x_scale, previous_x_scale); }
    previous_x_scale = x_scale;
  }
}

TEST_F(ServiceTest, Fp8OnALayerInitialisedWithoutAutocastFails) {
  const te::v1::InitLayerResponse init = Init(DenseSpec(16), {4, 32}, te::v1::BFLOAT16);
  te::v1::ForwardRequest forward;
  forward.set_layer_id(init.layer_id());
  *forward.mutable_x() = MakeTensor(te::v1::BFLOAT16, {4, 32}, RandomFloats(128, 50));
  *forward.mutable_autocast() = DelayedScalingAutocast(16);
  te::v1::ForwardResponse y;
  const grpc::Status status = Forward(forward, &y);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(status);
  EXPECT_NE(status.error_message().find("autocast"), std::string::npos) << Describe(status);
  // Current scaling has no state: it runs.
  forward.mutable_autocast()->mutable_recipe()->mutable_float8_current_scaling();
  EXPECT_TRUE(Forward(forward, &y).ok());
}

TEST_F(ServiceTest, SavedForwardsAreBounded) {
  const te::v1::InitLayerResponse init = Init(DenseSpec(8), {2, 8}, te::v1::FLOAT32);
  te::v1::ForwardRequest forward;
  forward.set_layer_id(init.layer_id());
  *forward.mutable_x() = MakeTensor(te::v1::FLOAT32, {2, 8}, RandomFloats(16, 60));
  forward.set_keep_for_backward(true);
  te::v1::ForwardResponse y;
  std::vector<std::string> kept;
  for (int i = 0; i < 4; ++i) {  // the suite's --max_saved_forwards
    ASSERT_TRUE(Forward(forward, &y).ok());
    kept.push_back(y.forward_id());
  }
  EXPECT_EQ(Forward(forward, &y).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  te::v1::BackwardRequest backward;
  backward.set_forward_id(kept[0]);
  *backward.mutable_dy() = MakeTensor(te::v1::FLOAT32, {2, 8}, RandomFloats(16, 61));
  te::v1::BackwardResponse grads;
  ASSERT_TRUE(Backward(backward, &grads).ok());
  EXPECT_TRUE(Forward(forward, &y).ok());  // room again
}

// A layer whose init takes far longer than the call's deadline (512 MiB of
// float32 params filled on the host) ends soon after the deadline, in the
// session's turn too: the session's next call starts at once and finds it
// as it was, with no layer and no memory held.
TEST_F(ServiceTest, AnInitPastItsDeadlineFreesTheSession) {
  auto info = [this](te::v1::SessionInfo* out) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    return stub_->GetSessionInfo(&context, WithSession(te::v1::GetSessionInfoRequest()), out);
  };
  te::v1::SessionInfo before;
  ASSERT_TRUE(info(&before).ok());
  te::v1::InitLayerRequest request = WithSession(te::v1::InitLayerRequest());
  *request.mutable_spec() = DenseSpec(16384);
  request.set_input_dtype(te::v1::FLOAT32);
  for (int64_t d : {2, 8192}) request.add_input_shape(d);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(100));
  te::v1::InitLayerResponse response;
  EXPECT_EQ(stub_->InitLayer(&context, request, &response).error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  // Queued behind the init in the session's order: it runs once the init
  // has stopped, well inside its own 5 s.
  const absl::Time asked = absl::Now();
  te::v1::SessionInfo after;
  const grpc::Status status = info(&after);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_LT(absl::Now() - asked, absl::Seconds(2));
  EXPECT_EQ(after.layers(), before.layers());
  EXPECT_EQ(after.memory_bytes(), before.memory_bytes());
}

TEST_F(ServiceTest, PaddingMaskReachesAttention) {
  te::v1::LayerSpec spec = SmallTransformerSpec();
  spec.mutable_transformer_layer()->set_self_attn_mask_type(te::v1::PADDING);
  const te::v1::InitLayerResponse init = Init(spec, {2, 8, 32}, te::v1::FLOAT32);
  te::v1::ForwardRequest forward;
  forward.set_layer_id(init.layer_id());
  forward.set_deterministic(true);
  *forward.mutable_x() = MakeTensor(te::v1::FLOAT32, {2, 8, 32}, RandomFloats(512, 70));
  te::v1::ForwardResponse unmasked;
  ASSERT_TRUE(Forward(forward, &unmasked).ok());
  // Batch 0 keeps all 8 positions, batch 1 only 5.
  te::v1::Tensor* mask = forward.mutable_attention_mask();
  mask->set_dtype(te::v1::BOOL);
  for (int64_t d : {2, 1, 8, 8}) mask->add_shape(d);
  std::string bits;
  for (int b = 0; b < 2; ++b) {
    const int len = b == 0 ? 8 : 5;
    for (int i = 0; i < 8; ++i) {
      for (int j = 0; j < 8; ++j) bits.push_back((i < len && j < len) ? 0 : 1);
    }
  }
  mask->set_inline_data(bits);
  te::v1::ForwardResponse masked;
  const grpc::Status status = Forward(forward, &masked);
  ASSERT_TRUE(status.ok()) << Describe(status);
  const std::vector<float> a = ToFloats(unmasked.y()), b = ToFloats(masked.y());
  // Batch 0 is unchanged; batch 1's rows see fewer keys, so they change.
  EXPECT_LT(RelativeError(std::vector<float>(b.begin(), b.begin() + 256),
                          std::vector<float>(a.begin(), a.begin() + 256)),
            kF32Tolerance);
  EXPECT_GT(RelativeError(std::vector<float>(b.begin() + 256, b.end()),
                          std::vector<float>(a.begin() + 256, a.end())),
            1e-2);
}

TEST(ServerLimitsTest, MaxSessions) {
  ServerProcess::Options options;
  options.flags = {"--max_sessions=2"};
  auto server = ServerProcess::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = (*server)->NewStub();
  CreateSession(*stub);
  CreateSession(*stub);
  grpc::ClientContext context;
  te::v1::CreateSessionResponse response;
  EXPECT_EQ(stub->CreateSession(&context, te::v1::CreateSessionRequest(), &response).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_TRUE((*server)->Stop().ok());
}

// Calls on different sessions run concurrently, and none sees another's
// state: each session's answers (every forward's y, every backward's dx, and
// the parameters and kept gradients at the end) equal, bit for bit, those of
// the same calls run by one client alone on the server, while the sessions
// have different seeds and inputs, so a mix-up would show.
TEST_F(ServiceTest, ConcurrentSessions) {
  constexpr int kSessions = 4;
  constexpr int kSteps = 5;
  struct Answers {
    grpc::Status status;
    std::vector<std::string> bytes;  // y and dx per step, then each variable
  };
  auto drive = [](int t) {
    Answers answers;
    auto stub = server_->NewStub();
    const te::v1::SessionRef session = CreateSession(*stub).session();
    te::v1::InitLayerRequest init;
    *init.mutable_session() = session;
    *init.mutable_spec() = DenseSpec(8);
    init.set_seed(100 + t);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(4);
    init.add_input_shape(8);
    grpc::ClientContext c1;
    te::v1::InitLayerResponse layer;
    answers.status = stub->InitLayer(&c1, init, &layer);
    for (int i = 0; i < kSteps && answers.status.ok(); ++i) {
      te::v1::ForwardRequest forward;
      *forward.mutable_session() = session;
      forward.set_layer_id(layer.layer_id());
      forward.set_keep_for_backward(true);
      *forward.mutable_x() =
          MakeTensor(te::v1::FLOAT32, {4, 8}, RandomFloats(32, 80 + 10 * t + i));
      grpc::ClientContext c2;
      te::v1::ForwardResponse y;
      answers.status = stub->Forward(&c2, forward, &y);
      if (!answers.status.ok()) break;
      answers.bytes.push_back(y.y().inline_data());
      te::v1::BackwardRequest backward;
      *backward.mutable_session() = session;
      backward.set_forward_id(y.forward_id());
      backward.set_keep_grads(true);
      *backward.mutable_dy() =
          MakeTensor(te::v1::FLOAT32, {4, 8}, RandomFloats(32, 500 + 10 * t + i));
      grpc::ClientContext c3;
      te::v1::BackwardResponse dx;
      answers.status = stub->Backward(&c3, backward, &dx);
      answers.bytes.push_back(dx.dx().inline_data());
    }
    if (answers.status.ok()) {
      te::v1::GetVariablesRequest get;
      *get.mutable_session() = session;
      get.set_layer_id(layer.layer_id());
      grpc::ClientContext c4;
      te::v1::GetVariablesResponse variables;
      answers.status = stub->GetVariables(&c4, get, &variables);
      for (const te::v1::Variable& v : variables.variables()) {
        answers.bytes.push_back(v.collection() + "/" + v.path() + "=" + v.value().inline_data());
      }
    }
    return answers;
  };

  std::vector<Answers> concurrent(kSessions);
  std::vector<std::thread> threads;
  for (int t = 0; t < kSessions; ++t) {
    threads.emplace_back([&, t] { concurrent[t] = drive(t); });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kSessions; ++t) {
    const Answers alone = drive(t);
    ASSERT_TRUE(concurrent[t].status.ok()) << "session " << t << ": "
                                           << Describe(concurrent[t].status);
    ASSERT_TRUE(alone.status.ok()) << Describe(alone.status);
    ASSERT_GE(alone.bytes.size(), 2 * kSteps + 2u);  // at least a param and its kept grad
    EXPECT_EQ(concurrent[t].bytes.size(), alone.bytes.size());
    for (size_t i = 0; i < alone.bytes.size() && i < concurrent[t].bytes.size(); ++i) {
      EXPECT_FALSE(alone.bytes[i].empty());
      EXPECT_EQ(concurrent[t].bytes[i], alone.bytes[i]) << "session " << t << ", answer " << i;
    }
    // Sessions with different seeds and inputs differ: the comparison above
    // could tell one session's answers from another's.
    if (t > 0) {
      EXPECT_NE(concurrent[t].bytes, concurrent[t - 1].bytes);
    }
  }
}

}  // namespace
}  // namespace te::testing
