// InitLayer and AddGraph honour the call's deadline and cancellation: a large
// layer's init ends between chunks of its variables soon after its deadline
// (DEADLINE_EXCEEDED) or a cancel (CANCELLED), and leaves the session exactly
// as it was: no layer, its memory back. On the CPU backend.
#include <cstdint>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/ops.h"
#include "server/session/session.h"
#include "te/v1/service.pb.h"

namespace te::session {
namespace {

// A DenseGeneral of 8192 x 16384 float32 params (512 MiB): its init fills
// 2^27 values on the host, far longer than the deadlines below.
constexpr int64_t kIn = 8192, kOut = 16384;
// How late past its deadline an init may end: one chunk's fill and upload
// (kInitChunkElements, 2^20 values) is milliseconds.
constexpr absl::Duration kPrompt = absl::Seconds(1);

class InitDeadlineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    device_ = *OpenCpuDevice();
    SessionConfig config;
    config.session_memory_bytes = int64_t{2} << 30;
    session_ = std::make_unique<Session>("init_deadline", device_->info(),
                                         *device_->NewOps(config.session_memory_bytes), config,
                                         te::v1::EMULATE, std::nullopt);
  }

  static te::v1::InitLayerRequest Dense(int64_t in, int64_t out) {
    te::v1::InitLayerRequest init;
    init.mutable_spec()->mutable_dense_general()->add_features(out);
    init.set_seed(1);
    init.set_input_dtype(te::v1::FLOAT32);
    init.add_input_shape(2);
    init.add_input_shape(in);
    return init;
  }

  te::v1::SessionInfo Info() const {
    te::v1::SessionInfo info;
    session_->GetSessionInfo(&info);
    return info;
  }

  void ExpectAsBefore(const te::v1::SessionInfo& before) const {
    const te::v1::SessionInfo after = Info();
    EXPECT_EQ(after.memory_bytes(), before.memory_bytes());
    EXPECT_EQ(after.layers(), before.layers());
    EXPECT_EQ(after.resident_tensors(), before.resident_tensors());
    // The id a failed init took is not a layer.
    te::v1::GetVariablesRequest get;
    get.set_layer_id("layer-2");
    te::v1::GetVariablesResponse unused;
    EXPECT_EQ(session_->GetVariables(get, &unused).code(), absl::StatusCode::kNotFound);
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Session> session_;
};

TEST_F(InitDeadlineTest, AnInitPastItsDeadlineEndsPromptlyAndLeavesNothing) {
  // A small layer first: the session is not empty when the large init fails.
  te::v1::InitLayerResponse small;
  ASSERT_TRUE(session_->InitLayer(Dense(8, 4), &small).ok());
  const te::v1::SessionInfo before = Info();
  ASSERT_EQ(before.layers(), 1);

  CallContext call;
  call.deadline = absl::Now() + absl::Milliseconds(20);
  te::v1::InitLayerResponse response;
  const absl::Status status = session_->InitLayer(Dense(kIn, kOut), &response, call);
  const absl::Time ended = absl::Now();
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  EXPECT_NE(status.message().find("InitLayer"), std::string::npos) << status;
  EXPECT_LT(ended - call.deadline, kPrompt) << "ended " << ended - call.deadline << " late";
  EXPECT_TRUE(response.layer_id().empty());
  ExpectAsBefore(before);
}

TEST_F(InitDeadlineTest, ACancelledInitStopsBetweenChunks) {
  const te::v1::SessionInfo before = Info();
  // Cancelled after a few chunks have been filled (each asks once).
  int checks = 0;
  CallContext call;
  call.cancelled = [&checks] { return ++checks > 4; };
  te::v1::InitLayerResponse response;
  const absl::Status status = session_->InitLayer(Dense(kIn, kOut), &response, call);
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_EQ(checks, 5) << "the init did not stop at the first check after the cancel";
  ExpectAsBefore(before);
}

TEST_F(InitDeadlineTest, AnInitInTimeSucceeds) {
  CallContext call;
  call.deadline = absl::Now() + absl::Seconds(60);
  te::v1::InitLayerResponse response;
  ASSERT_TRUE(session_->InitLayer(Dense(64, 32), &response, call).ok());
  EXPECT_EQ(Info().layers(), 1);
}

TEST_F(InitDeadlineTest, AnAddGraphPastItsDeadlineAddsNothing) {
  te::v1::InitLayerRequest init = Dense(8, 4);
  te::v1::InitLayerResponse layer;
  ASSERT_TRUE(session_->InitLayer(init, &layer).ok());
  // A graph of the layer's module for another batch size.
  te::v1::AddGraphRequest add;
  add.set_layer_id(layer.layer_id());
  te::v1::GraphSpec::Node* dense = add.mutable_graph()->add_nodes();
  dense->set_name("");  // the layer's one module, at the root scope
  *dense->mutable_module() = init.spec();
  dense->add_inputs("x");
  dense->add_outputs("y");
  add.mutable_graph()->add_outputs("y");
  add.set_input_dtype(te::v1::FLOAT32);
  add.add_input_shape(3);
  add.add_input_shape(8);
  CallContext late;
  late.deadline = absl::Now() - absl::Milliseconds(1);
  te::v1::AddGraphResponse response;
  const absl::Status status = session_->AddGraph(add, &response, late);
  ASSERT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded) << status;
  // In time, the same graph is the layer's graph 1: the late one took no index.
  ASSERT_TRUE(session_->AddGraph(add, &response).ok());
  EXPECT_EQ(response.graph(), 1);
}

}  // namespace
}  // namespace te::session
