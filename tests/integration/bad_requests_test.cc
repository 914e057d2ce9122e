// A table of bad requests against the real te_server: each gets its expected
// status code and a message naming the field, and none of them changes the
// session (its variables, its kept forward, its resident tensor).
#include <grpcpp/grpcpp.h>

#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/integration/test_util.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

constexpr int64_t kBatch = 2, kIn = 8, kOut = 16;

struct BadCase {
  std::string name;
  std::function<grpc::Status()> call;
  grpc::StatusCode code;
  std::string message_part;  // the field the message must name ("" : any)
};

class BadRequestsTest : public ServerSuite {
 protected:
  void SetUp() override {
    ServerSuite::SetUp();
    if (HasFatalFailure()) return;
    te::v1::InitLayerRequest init = WithSession(te::v1::InitLayerRequest());
    init.mutable_spec()->mutable_dense_general()->add_features(kOut);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(kBatch);
    init.add_input_shape(kIn);
    init.set_seed(7);
    grpc::ClientContext c1;
    te::v1::InitLayerResponse layer;
    ASSERT_TRUE(stub_->InitLayer(&c1, init, &layer).ok());
    layer_id_ = layer.layer_id();

    te::v1::ForwardRequest forward = GoodForward();
    forward.set_keep_for_backward(true);
    grpc::ClientContext c2;
    te::v1::ForwardResponse y;
    ASSERT_TRUE(stub_->Forward(&c2, forward, &y).ok());
    forward_id_ = y.forward_id();

    grpc::ClientContext c3;
    te::v1::PutTensorResponse put;
    auto writer = stub_->PutTensor(&c3, &put);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    header.mutable_header()->mutable_tensor()->add_shape(kBatch);
    header.mutable_header()->mutable_tensor()->add_shape(kIn);
    writer->Write(header);
    resident_bytes_ = GoodX().inline_data();
    te::v1::PutTensorChunk data;
    data.set_data(resident_bytes_);
    writer->Write(data);
    writer->WritesDone();
    ASSERT_TRUE(writer->Finish().ok());
    resident_id_ = put.tensor_id();

    other_ = CreateSession(*stub_).session();
  }

  te::v1::Tensor GoodX() const {
    return MakeTensor(te::v1::FLOAT32, {kBatch, kIn}, RandomFloats(kBatch * kIn, 1));
  }
  te::v1::Tensor GoodDy() const {
    return MakeTensor(te::v1::FLOAT32, {kBatch, kOut}, RandomFloats(kBatch * kOut, 2));
  }
  te::v1::ForwardRequest GoodForward() const {
    te::v1::ForwardRequest request = WithSession(te::v1::ForwardRequest());
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    *request.mutable_x() = GoodX();
    return request;
  }
  te::v1::ForwardBackwardRequest GoodForwardBackward(int micro_batches) const {
    te::v1::ForwardBackwardRequest request = WithSession(te::v1::ForwardBackwardRequest());
    request.set_layer_id(layer_id_);
    request.set_deterministic(true);
    for (int i = 0; i < micro_batches; ++i) {
      *request.add_micro_batches()->mutable_x() = GoodX();
      *request.mutable_micro_batches(i)->mutable_dy() = GoodDy();
    }
    return request;
  }

  grpc::Status Forward(const te::v1::ForwardRequest& request) {
    grpc::ClientContext context;
    te::v1::ForwardResponse response;
    return stub_->Forward(&context, request, &response);
  }
  // A Forward whose x is `x`.
  grpc::Status ForwardX(const te::v1::Tensor& x) {
    te::v1::ForwardRequest request = GoodForward();
    *request.mutable_x() = x;
    return Forward(request);
  }
  grpc::Status ForwardAutocast(const te::v1::Autocast& autocast) {
    te::v1::ForwardRequest request = GoodForward();
    *request.mutable_autocast() = autocast;
    return Forward(request);
  }
  grpc::Status Backward(const std::string& forward_id, const te::v1::Tensor& dy) {
    te::v1::BackwardRequest request = WithSession(te::v1::BackwardRequest());
    request.set_forward_id(forward_id);
    *request.mutable_dy() = dy;
    grpc::ClientContext context;
    te::v1::BackwardResponse response;
    return stub_->Backward(&context, request, &response);
  }
  grpc::Status ForwardBackward(const te::v1::ForwardBackwardRequest& request) {
    grpc::ClientContext context;
    te::v1::ForwardBackwardResponse response;
    return stub_->ForwardBackward(&context, request, &response);
  }
  grpc::Status SetVariables(const std::vector<te::v1::Variable>& variables) {
    te::v1::SetVariablesRequest request = WithSession(te::v1::SetVariablesRequest());
    request.set_layer_id(layer_id_);
    for (const auto& v : variables) *request.add_variables() = v;
    grpc::ClientContext context;
    te::v1::SetVariablesResponse response;
    return stub_->SetVariables(&context, request, &response);
  }
  grpc::Status InitLayer(const std::function<void(te::v1::InitLayerRequest*)>& edit) {
    te::v1::InitLayerRequest request = WithSession(te::v1::InitLayerRequest());
    request.mutable_spec()->mutable_dense_general()->add_features(4);
    request.set_input_dtype(te::v1::FLOAT32);
    request.add_input_shape(2);
    request.add_input_shape(3);
    edit(&request);
    grpc::ClientContext context;
    te::v1::InitLayerResponse response;
    return stub_->InitLayer(&context, request, &response);
  }
  grpc::Status GetVariablesAs(const te::v1::SessionRef& session,
                              const std::vector<std::string>& collections) {
    te::v1::GetVariablesRequest request;
    *request.mutable_session() = session;
    request.set_layer_id(layer_id_);
    for (const auto& c : collections) request.add_collections(c);
    grpc::ClientContext context;
    te::v1::GetVariablesResponse response;
    return stub_->GetVariables(&context, request, &response);
  }
  grpc::Status CreateSessionWith(const std::function<void(te::v1::CreateSessionRequest*)>& edit) {
    te::v1::CreateSessionRequest request;
    edit(&request);
    grpc::ClientContext context;
    te::v1::CreateSessionResponse response;
    return stub_->CreateSession(&context, request, &response);
  }
  grpc::Status PutRaw(const std::vector<te::v1::PutTensorChunk>& messages) {
    grpc::ClientContext context;
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    for (const auto& m : messages) writer->Write(m);
    writer->WritesDone();
    return writer->Finish();
  }

  std::string layer_id_, forward_id_, resident_id_, resident_bytes_;
  te::v1::SessionRef other_;
};

te::v1::Tensor Inline(te::v1::DType dtype, const std::vector<int64_t>& shape, std::string bytes) {
  te::v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(std::move(bytes));
  return t;
}

te::v1::Variable Var(const std::string& collection, const std::string& path,
                     const te::v1::Tensor& value) {
  te::v1::Variable v;
  v.set_collection(collection);
  v.set_path(path);
  *v.mutable_value() = value;
  return v;
}

TEST_F(BadRequestsTest, EachGetsItsCodeAndLeavesTheSessionUnchanged) {
  const auto before = GetAllVariables(*stub_, session_, layer_id_);
  ASSERT_FALSE(before.empty());
  using Code = grpc::StatusCode;
  const std::string f32_8x8(kBatch * kIn * 4, '\0');
  te::v1::Autocast delayed;
  delayed.set_enabled(true);
  delayed.mutable_recipe()->mutable_delayed_scaling();
  te::v1::Autocast no_recipe;
  no_recipe.set_enabled(true);
  te::v1::Autocast mxfp8;
  mxfp8.set_enabled(true);
  mxfp8.mutable_recipe()->mutable_mxfp8_block_scaling();
  te::v1::Autocast bad_history = delayed;
  bad_history.mutable_recipe()->mutable_delayed_scaling()->set_amax_history_len(0);
  te::v1::Tensor shm_x = GoodX();
  shm_x.mutable_shm()->set_region_id("region-1");
  te::v1::Tensor nan_x = GoodX();
  {
    std::vector<float> values = ToFloats(nan_x);
    values[3] = std::numeric_limits<float>::quiet_NaN();
    nan_x = MakeTensor(te::v1::FLOAT32, {kBatch, kIn}, values);
  }
  te::v1::SessionRef wrong_token = session_;
  wrong_token.set_token("0123456789abcdef0123456789abcdef");
  te::v1::SessionRef no_token = session_;
  no_token.clear_token();
  te::v1::SessionRef others_token = session_;
  others_token.set_token(other_.token());
  te::v1::SessionRef unknown = session_;
  unknown.set_session_id("ffffffffffffffffffffffffffffffff");

  const std::vector<BadCase> cases = {
      // x: dtype, shape, bytes, where the data is.
      {"x dtype unspecified", [&] { return ForwardX(Inline(te::v1::DTYPE_UNSPECIFIED, {kBatch, kIn}, f32_8x8)); },
       Code::INVALID_ARGUMENT, "x.dtype"},
      {"x dtype unknown", [&] { return ForwardX(Inline(static_cast<te::v1::DType>(42), {kBatch, kIn}, f32_8x8)); },
       Code::INVALID_ARGUMENT, "x.dtype"},
      {"x dtype int32", [&] { return ForwardX(Inline(te::v1::INT32, {kBatch, kIn}, f32_8x8)); },
       Code::INVALID_ARGUMENT, "x.dtype"},
      {"x negative dim", [&] { return ForwardX(Inline(te::v1::FLOAT32, {kBatch, -kIn}, f32_8x8)); },
       Code::INVALID_ARGUMENT, "x.shape[1]"},
      {"x dims overflow int64", [&] { return ForwardX(Inline(te::v1::FLOAT32, {int64_t{1} << 40, int64_t{1} << 40}, "")); },
       Code::INVALID_ARGUMENT, "x.shape"},
      {"x over max_tensor_bytes", [&] { return ForwardX(Inline(te::v1::FLOAT32, {int64_t{1} << 20, int64_t{1} << 20}, "")); },
       Code::INVALID_ARGUMENT, "x.shape"},
      {"x bytes truncated", [&] { return ForwardX(Inline(te::v1::FLOAT32, {kBatch, kIn}, f32_8x8.substr(4))); },
       Code::INVALID_ARGUMENT, "x.inline_data"},
      {"x without data", [&] { te::v1::Tensor x = GoodX(); x.clear_inline_data(); return ForwardX(x); },
       Code::INVALID_ARGUMENT, "x"},
      {"x unknown resident id", [&] { return ForwardX(ResidentRef("tensor-999")); },
       Code::INVALID_ARGUMENT, "x.resident_id"},
      {"x in shared memory", [&] { return ForwardX(shm_x); },
       Code::FAILED_PRECONDITION, "shared memory disabled (--enable_shm)"},
      {"x does not fit the layer", [&] { return ForwardX(MakeTensor(te::v1::FLOAT32, {kBatch, 9}, RandomFloats(18, 3))); },
       Code::INVALID_ARGUMENT, "x.shape"},
      {"NaN in x is allowed", [&] { return ForwardX(nan_x); }, Code::OK, ""},
      // layer, autocast, mask.
      {"unknown layer", [&] { auto r = GoodForward(); r.set_layer_id("layer-999"); return Forward(r); },
       Code::NOT_FOUND, "layer_id"},
      {"FP8 on a layer initialised without it", [&] { return ForwardAutocast(delayed); },
       Code::FAILED_PRECONDITION, "autocast"},
      {"autocast without any recipe", [&] { return ForwardAutocast(no_recipe); },
       Code::FAILED_PRECONDITION, "autocast"},
      {"emulated recipe under FALLBACK", [&] { return ForwardAutocast(mxfp8); },
       Code::FAILED_PRECONDITION, "autocast.recipe"},
      {"recipe with amax_history_len 0", [&] { return ForwardAutocast(bad_history); },
       Code::INVALID_ARGUMENT, "autocast.recipe.delayed_scaling.amax_history_len"},
      // Any mask TE takes is accepted, and a mask of any shape is ignored by a
      // layer that reads none, as TE drops it; a shape that does not broadcast
      // against the logits is refused by the mask types that read it
      // (attention_mask_test). Bytes that do not fit the mask's dtype never
      // decode.
      {"mask bytes that do not fit its dtype", [&] {
         auto r = GoodForward();
         *r.mutable_attention_mask() = Inline(te::v1::INT32, {kBatch, 1, kBatch, kBatch}, std::string(31, '\0'));
         return Forward(r); },
       Code::INVALID_ARGUMENT, "attention_mask.inline_data"},
      // backward.
      {"unknown forward id", [&] { return Backward("forward-999", GoodDy()); },
       Code::NOT_FOUND, "forward_id"},
      {"dy of the wrong shape", [&] { return Backward(forward_id_, MakeTensor(te::v1::FLOAT32, {kBatch, kOut + 1}, RandomFloats(34, 4))); },
       Code::INVALID_ARGUMENT, "dy.shape"},
      {"dy of the wrong dtype", [&] { return Backward(forward_id_, MakeTensor(te::v1::BFLOAT16, {kBatch, kOut}, RandomFloats(32, 4))); },
       Code::INVALID_ARGUMENT, "dy.dtype"},
      // forward-backward: a bad later micro-batch stops the whole call before the first runs.
      {"micro-batch dy shape", [&] {
         auto r = GoodForwardBackward(3);
         *r.mutable_micro_batches(1)->mutable_dy() = MakeTensor(te::v1::FLOAT32, {kBatch, 3}, RandomFloats(6, 5));
         return ForwardBackward(r); },
       Code::INVALID_ARGUMENT, "micro_batches[1].dy.shape"},
      {"micro-batch dy negative dim", [&] {
         auto r = GoodForwardBackward(2);
         *r.mutable_micro_batches(1)->mutable_dy() = Inline(te::v1::FLOAT32, {-1, kOut}, "");
         return ForwardBackward(r); },
       Code::INVALID_ARGUMENT, "micro_batches[1].dy.shape[0]"},
      {"micro-batch x truncated", [&] {
         auto r = GoodForwardBackward(3);
         r.mutable_micro_batches(2)->mutable_x()->mutable_inline_data()->pop_back();
         return ForwardBackward(r); },
       Code::INVALID_ARGUMENT, "micro_batches[2].x.inline_data"},
      {"no micro-batches", [&] { return ForwardBackward(GoodForwardBackward(0)); },
       Code::INVALID_ARGUMENT, "micro_batches"},
      {"extra inputs for a one-input layer", [&] {
         te::v1::ForwardRequest r = GoodForward();
         for (int i = 0; i < 1000; ++i) *r.add_extra_inputs() = GoodX();
         return Forward(r); },
       Code::INVALID_ARGUMENT, "extra_inputs: DenseGeneral takes one input x"},
      {"micro-batch extra inputs", [&] {
         auto r = GoodForwardBackward(2);
         *r.mutable_micro_batches(1)->add_extra_inputs() = GoodX();
         return ForwardBackward(r); },
       Code::INVALID_ARGUMENT, "micro_batches[1]: extra_inputs"},
      // variables.
      {"set an unknown variable", [&] { return SetVariables({Var("params", "nope", GoodDy())}); },
       Code::INVALID_ARGUMENT, "variables[0]"},
      {"set a variable with the wrong shape", [&] {
         return SetVariables({Var("params", "bias", MakeTensor(te::v1::FLOAT32, {kOut + 1}, RandomFloats(kOut + 1, 6)))}); },
       Code::INVALID_ARGUMENT, "variables[0].value"},
      {"set a variable with the wrong dtype", [&] {
         return SetVariables({Var("params", "bias", MakeTensor(te::v1::BFLOAT16, {kOut}, RandomFloats(kOut, 6)))}); },
       Code::INVALID_ARGUMENT, "variables[0].value"},
      {"set one good and one bad variable", [&] {
         return SetVariables({Var("params", "bias", MakeTensor(te::v1::FLOAT32, {kOut}, RandomFloats(kOut, 7))),
                              Var("params", "kernel", MakeTensor(te::v1::FLOAT32, {kIn, kOut + 1}, RandomFloats(kIn * (kOut + 1), 8)))}); },
       Code::INVALID_ARGUMENT, "variables[1].value"},
      {"get an unknown collection", [&] { return GetVariablesAs(session_, {"params", "optimizer"}); },
       Code::INVALID_ARGUMENT, "collections[1]"},
      // init.
      {"init with a negative dim", [&] { return InitLayer([](auto* r) { r->set_input_shape(1, -3); }); },
       Code::INVALID_ARGUMENT, "input_shape[1]"},
      {"init with a zero dim", [&] { return InitLayer([](auto* r) { r->set_input_shape(0, 0); }); },
       Code::INVALID_ARGUMENT, "input_shape[0]"},
      {"init without a module", [&] { return InitLayer([](auto* r) { r->clear_spec(); }); },
       Code::INVALID_ARGUMENT, "spec"},
      {"init with int32 input", [&] { return InitLayer([](auto* r) { r->set_input_dtype(te::v1::INT32); }); },
       Code::INVALID_ARGUMENT, "input_dtype"},
      {"init DenseGeneral without features", [&] {
         return InitLayer([](auto* r) { r->mutable_spec()->mutable_dense_general()->clear_features(); }); },
       Code::INVALID_ARGUMENT, "spec.dense_general"},
      // sessions.
      {"wrong token", [&] { return GetVariablesAs(wrong_token, {}); }, Code::UNAUTHENTICATED, "token"},
      {"missing token", [&] { return GetVariablesAs(no_token, {}); }, Code::UNAUTHENTICATED, "token"},
      {"another session's token", [&] { return GetVariablesAs(others_token, {}); },
       Code::PERMISSION_DENIED, "another session"},
      {"unknown session", [&] { return GetVariablesAs(unknown, {}); }, Code::NOT_FOUND, "not found"},
      {"STRICT with an emulated first choice", [&] {
         return CreateSessionWith([](auto* r) {
           r->set_policy(te::v1::STRICT);
           r->add_preferred_recipes()->mutable_mxfp8_block_scaling(); }); },
       Code::FAILED_PRECONDITION, "MXFP8BlockScaling"},
      {"a device this server does not have", [&] { return CreateSessionWith([](auto* r) { r->set_device("cuda:7"); }); },
       Code::INVALID_ARGUMENT, "device"},
      {"negative ttl", [&] { return CreateSessionWith([](auto* r) { r->set_ttl_seconds(-5); }); },
       Code::INVALID_ARGUMENT, "ttl_seconds"},
      {"an empty preferred recipe", [&] { return CreateSessionWith([](auto* r) { r->add_preferred_recipes(); }); },
       Code::INVALID_ARGUMENT, "preferred_recipes[0]"},
      // resident tensors.
      {"get an unknown tensor", [&] {
         te::v1::GetTensorRequest r = WithSession(te::v1::GetTensorRequest());
         r.set_tensor_id("tensor-999");
         grpc::ClientContext context;
         auto reader = stub_->GetTensor(&context, r);
         te::v1::TensorChunk chunk;
         while (reader->Read(&chunk)) {}
         return reader->Finish(); },
       Code::NOT_FOUND, "tensor_id"},
      {"get with a negative chunk size", [&] {
         te::v1::GetTensorRequest r = WithSession(te::v1::GetTensorRequest());
         r.set_tensor_id(resident_id_);
         r.set_chunk_bytes(-1);
         grpc::ClientContext context;
         auto reader = stub_->GetTensor(&context, r);
         te::v1::TensorChunk chunk;
         while (reader->Read(&chunk)) {}
         return reader->Finish(); },
       Code::INVALID_ARGUMENT, "chunk_bytes"},
      {"delete an unknown tensor", [&] {
         te::v1::DeleteTensorRequest r = WithSession(te::v1::DeleteTensorRequest());
         r.set_tensor_id("tensor-999");
         grpc::ClientContext context;
         te::v1::DeleteTensorResponse response;
         return stub_->DeleteTensor(&context, r, &response); },
       Code::NOT_FOUND, "tensor_id"},
      {"put without a header", [&] {
         te::v1::PutTensorChunk data;
         data.set_data("abcd");
         return PutRaw({data}); },
       Code::INVALID_ARGUMENT, "header"},
      {"put with an unspecified dtype", [&] {
         te::v1::PutTensorChunk header;
         *header.mutable_header()->mutable_session() = session_;
         header.mutable_header()->mutable_tensor()->add_shape(1);
         te::v1::PutTensorChunk data;
         data.set_data("abcd");
         return PutRaw({header, data}); },
       Code::INVALID_ARGUMENT, "header.tensor.dtype"},
      // benchmark.
      {"benchmark with negative warmup", [&] {
         te::v1::BenchmarkRequest r = WithSession(te::v1::BenchmarkRequest());
         r.set_layer_id(layer_id_);
         *r.mutable_inputs()->mutable_x() = GoodX();
         *r.mutable_inputs()->mutable_dy() = GoodDy();
         r.set_warmup_iters(-1);
         grpc::ClientContext context;
         te::v1::BenchmarkResponse response;
         return stub_->Benchmark(&context, r, &response); },
       Code::INVALID_ARGUMENT, "warmup_iters"},
      {"benchmark without dy", [&] {
         te::v1::BenchmarkRequest r = WithSession(te::v1::BenchmarkRequest());
         r.set_layer_id(layer_id_);
         *r.mutable_inputs()->mutable_x() = GoodX();
         grpc::ClientContext context;
         te::v1::BenchmarkResponse response;
         return stub_->Benchmark(&context, r, &response); },
       Code::INVALID_ARGUMENT, "inputs.dy"},
  };

  for (const BadCase& c : cases) {
    SCOPED_TRACE(c.name);
    const grpc::Status status = c.call();
    EXPECT_EQ(status.error_code(), c.code) << Describe(status);
    if (!c.message_part.empty()) {
      EXPECT_NE(status.error_message().find(c.message_part), std::string::npos)
          << Describe(status);
    }
  }

  // Nothing changed: variables byte for byte, no gradients kept, the resident
  // tensor intact, and the kept forward still there for its backward.
  const auto after = GetAllVariables(*stub_, session_, layer_id_);
  ASSERT_EQ(after.size(), before.size());
  for (const auto& [name, tensor] : before) {
    EXPECT_EQ(after.at(name).inline_data(), tensor.inline_data()) << name;
  }
  grpc::ClientContext context;
  te::v1::GetTensorRequest get = WithSession(te::v1::GetTensorRequest());
  get.set_tensor_id(resident_id_);
  auto reader = stub_->GetTensor(&context, get);
  te::v1::TensorChunk chunk;
  std::string bytes;
  while (reader->Read(&chunk)) bytes += chunk.data();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(bytes, resident_bytes_);
  EXPECT_TRUE(Backward(forward_id_, GoodDy()).ok());
}

}  // namespace
}  // namespace te::testing
