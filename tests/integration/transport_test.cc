// The tensor transports of te_server over real loopback sockets: PutTensor /
// GetTensor streams (reassembly from chunks of any size, streams cut short or
// too long, cancelled uploads freeing their memory) and same-host shared
// memory (--enable_shm: registration errors, tensors in and out of regions,
// regions unmapped with their session).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/integration/test_util.h"
#include "tests/integration/client_session_fixture.h"
#include "tests/server_fixture.h"

namespace te::testing {
namespace {

using te::v1::TeService;

int64_t NumElementsOf(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string bytes(n, '\0');
  for (char& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

// A client's POSIX shared-memory object, mapped on the client's side too.
class ClientShm {
 public:
  explicit ClientShm(size_t size) : size_(size) {
    static int counter = 0;
    name_ = absl::StrCat("/te_transport_test_", getpid(), "_", counter++);
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0) << name_;
    EXPECT_EQ(ftruncate(fd_, static_cast<off_t>(size)), 0);
    base_ = static_cast<char*>(mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
    EXPECT_NE(base_, MAP_FAILED);
  }
  ~ClientShm() {
    munmap(base_, size_);
    close(fd_);
    shm_unlink(name_.c_str());
  }
  const std::string& name() const { return name_; }
  char* data() { return base_; }
  int fd() const { return fd_; }

 private:
  std::string name_;
  size_t size_;
  int fd_ = -1;
  char* base_ = nullptr;
};

// Whether process `pid` has `shm_name` mapped (/proc/<pid>/maps lists
// /dev/shm/<name>).
bool Maps(pid_t pid, const std::string& shm_name) {
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::string line;
  while (std::getline(maps, line)) {
    if (absl::StrContains(line, "/dev/shm" + shm_name)) return true;
  }
  return false;
}

// One server per suite; each test gets a stub and fresh sessions.
class TransportTest : public client::testing::SuiteServerTest<> {
 protected:
  static void SetUpTestSuite() {
    StartSuiteServer({"--enable_shm", "--session_memory_bytes=268435456"});
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = server_->NewStub();
    session_ = NewSession();
  }
  void TearDown() override {
    for (const te::v1::SessionRef& session : opened_) Close(session);
  }

  te::v1::SessionRef NewSession(int64_t ttl_seconds = 0) {
    te::v1::CreateSessionRequest request;
    request.set_ttl_seconds(ttl_seconds);
    te::v1::SessionRef session = CreateSession(*stub_, request).session();
    opened_.push_back(session);
    return session;
  }
  // Device memory held by every session of the server (read without turns).
  int64_t ServerBytesInUse() {
    grpc::ClientContext context;
    te::v1::ServerInfo info;
    const grpc::Status status =
        stub_->GetServerInfo(&context, te::v1::GetServerInfoRequest(), &info);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return info.stats().bytes_in_use();
  }
  grpc::Status Close(const te::v1::SessionRef& session) {
    grpc::ClientContext context;
    te::v1::CloseSessionRequest request;
    *request.mutable_session() = session;
    te::v1::CloseSessionResponse response;
    return stub_->CloseSession(&context, request, &response);
  }
  te::v1::SessionInfo Info(const te::v1::SessionRef& session) {
    grpc::ClientContext context;
    te::v1::GetSessionInfoRequest request;
    *request.mutable_session() = session;
    te::v1::SessionInfo info;
    const grpc::Status status = stub_->GetSessionInfo(&context, request, &info);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return info;
  }

  // PutTensor of `bytes` as `shape` float32, in `chunk`-byte messages, then
  // `extra` more bytes (a chunk too many); `stop_after` bytes end it early.
  grpc::Status Put(const te::v1::SessionRef& session, const std::vector<int64_t>& shape,
                   const std::string& bytes, size_t chunk, te::v1::PutTensorResponse* response,
                   const std::string& extra = "", size_t stop_after = std::string::npos) {
    grpc::ClientContext context;
    std::unique_ptr<grpc::ClientWriter<te::v1::PutTensorChunk>> writer =
        stub_->PutTensor(&context, response);
    te::v1::PutTensorChunk message;
    *message.mutable_header()->mutable_session() = session;
    message.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    for (int64_t d : shape) message.mutable_header()->mutable_tensor()->add_shape(d);
    bool open = writer->Write(message);
    const size_t end = std::min(bytes.size(), stop_after);
    for (size_t offset = 0; open && offset < end; offset += chunk) {
      message.set_data(bytes.substr(offset, std::min(chunk, end - offset)));
      open = writer->Write(message);
    }
    if (open && !extra.empty()) {
      message.set_data(extra);
      writer->Write(message);
    }
    writer->WritesDone();
    return writer->Finish();
  }

  // GetTensor in `chunk`-byte messages; the bytes reassembled.
  grpc::Status Get(const te::v1::SessionRef& session, const std::string& id, int32_t chunk,
                   te::v1::TensorHeader* header, std::string* bytes,
                   const te::v1::SharedMemoryRef* destination = nullptr, int* messages = nullptr) {
    grpc::ClientContext context;
    te::v1::GetTensorRequest request;
    *request.mutable_session() = session;
    request.set_tensor_id(id);
    request.set_chunk_bytes(chunk);
    if (destination != nullptr) *request.mutable_destination() = *destination;
    std::unique_ptr<grpc::ClientReader<te::v1::TensorChunk>> reader =
        stub_->GetTensor(&context, request);
    te::v1::TensorChunk message;
    bytes->clear();
    int count = 0;
    while (reader->Read(&message)) {
      ++count;
      if (message.has_header()) {
        *header = message.header();
      } else {
        *bytes += message.data();
      }
    }
    if (messages != nullptr) *messages = count;
    return reader->Finish();
  }

  grpc::Status Register(const te::v1::SessionRef& session, const std::string& name, uint64_t size,
                        std::string* region_id) {
    grpc::ClientContext context;
    te::v1::RegisterSharedMemoryRequest request;
    *request.mutable_session() = session;
    request.set_name(name);
    request.set_size(size);
    te::v1::RegisterSharedMemoryResponse response;
    const grpc::Status status = stub_->RegisterSharedMemory(&context, request, &response);
    if (region_id != nullptr) *region_id = response.region_id();
    return status;
  }

  te::v1::InitLayerResponse InitDense(const te::v1::SessionRef& session, int64_t in, int64_t out,
                                      int64_t batch) {
    te::v1::InitLayerRequest request;
    *request.mutable_session() = session;
    request.mutable_spec()->mutable_dense_general()->add_features(out);
    request.set_seed(7);
    request.set_input_dtype(te::v1::FLOAT32);
    request.add_input_shape(batch);
    request.add_input_shape(in);
    grpc::ClientContext context;
    te::v1::InitLayerResponse response;
    const grpc::Status status = stub_->InitLayer(&context, request, &response);
    EXPECT_TRUE(status.ok()) << Describe(status);
    return response;
  }

  std::unique_ptr<TeService::Stub> stub_;
  te::v1::SessionRef session_;
  std::vector<te::v1::SessionRef> opened_;
};

// ---- streams ------------------------------------------------------------------------

struct Chunking {
  std::vector<int64_t> shape;
  size_t put_chunk;
  int32_t get_chunk;
};

class StreamReassemblyTest : public TransportTest,
                             public ::testing::WithParamInterface<Chunking> {};

TEST_P(StreamReassemblyTest, BytesComeBackAsSent) {
  const Chunking& c = GetParam();
  const size_t n = static_cast<size_t>(NumElementsOf(c.shape)) * 4;
  const std::string bytes = RandomBytes(n, 11);
  te::v1::PutTensorResponse put;
  const grpc::Status status = Put(session_, c.shape, bytes, c.put_chunk, &put);
  ASSERT_TRUE(status.ok()) << Describe(status);
  EXPECT_EQ(put.bytes(), static_cast<int64_t>(n));
  te::v1::TensorHeader header;
  std::string got;
  int messages = 0;
  const grpc::Status fetched =
      Get(session_, put.tensor_id(), c.get_chunk, &header, &got, nullptr, &messages);
  ASSERT_TRUE(fetched.ok()) << Describe(fetched);
  EXPECT_EQ(header.dtype(), te::v1::FLOAT32);
  EXPECT_EQ(std::vector<int64_t>(header.shape().begin(), header.shape().end()), c.shape);
  EXPECT_EQ(got, bytes);
  EXPECT_EQ(messages, 1 + static_cast<int>((n + c.get_chunk - 1) / c.get_chunk));
}

// Chunk sizes that do not divide the tensor, one byte, and the whole tensor.
INSTANTIATE_TEST_SUITE_P(
    ChunkSizes, StreamReassemblyTest,
    ::testing::Values(Chunking{{1000, 333}, 100003, 77777}, Chunking{{250}, 1, 3},
                      Chunking{{7, 11, 13}, 4001, 1 << 20}, Chunking{{1 << 20}, 1 << 20, 999999},
                      Chunking{{3 << 20}, 4 << 20, 4 << 20}, Chunking{{0, 5}, 10, 10}));

TEST_F(TransportTest, StreamCutShortIsInvalidAndFreesItsTensor) {
  const int64_t baseline = Info(session_).memory_bytes();
  const std::string bytes = RandomBytes(4 * 300000, 12);
  te::v1::PutTensorResponse put;
  const grpc::Status status = Put(session_, {300000}, bytes, 65536, &put, "", 700000);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("data: the stream's bytes add up to 700000, but "
                                        "header.tensor.shape [300000]"),
            std::string::npos)
      << Describe(status);
  const te::v1::SessionInfo info = Info(session_);
  EXPECT_EQ(info.memory_bytes(), baseline);
  EXPECT_EQ(info.resident_tensors(), 0);
}

TEST_F(TransportTest, OneChunkTooManyIsInvalidAndFreesItsTensor) {
  const int64_t baseline = Info(session_).memory_bytes();
  const std::string bytes = RandomBytes(4 * 100000, 13);
  te::v1::PutTensorResponse put;
  const grpc::Status status = Put(session_, {100000}, bytes, 30000, &put, "x");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("more than the 400000 bytes"), std::string::npos)
      << Describe(status);
  EXPECT_NE(status.error_message().find("message 16"), std::string::npos) << Describe(status);
  const te::v1::SessionInfo info = Info(session_);
  EXPECT_EQ(info.memory_bytes(), baseline);
  EXPECT_EQ(info.resident_tensors(), 0);
}

TEST_F(TransportTest, StreamWithoutHeaderOrWithTwoIsInvalid) {
  {
    grpc::ClientContext context;
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    te::v1::PutTensorChunk data;
    data.set_data("abcd");
    writer->Write(data);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("first message must be a header"), std::string::npos)
        << Describe(status);
  }
  {
    grpc::ClientContext context;
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    header.mutable_header()->mutable_tensor()->add_shape(4);
    writer->Write(header);
    writer->Write(header);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("message 2: only the first message may be a header"),
              std::string::npos)
        << Describe(status);
  }
}

TEST_F(TransportTest, CancelledUploadFreesItsPartTensor) {
  const int64_t baseline = ServerBytesInUse();
  {
    grpc::ClientContext context;
    te::v1::PutTensorResponse response;
    auto writer = stub_->PutTensor(&context, &response);
    te::v1::PutTensorChunk message;
    *message.mutable_header()->mutable_session() = session_;
    message.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    message.mutable_header()->mutable_tensor()->add_shape(8 << 20);  // 32 MiB
    ASSERT_TRUE(writer->Write(message));
    message.set_data(RandomBytes(1 << 20, 14));
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(writer->Write(message));
    // The server holds the 32 MiB allocation now, waiting for more. (The
    // upload holds the session's turn, so this asks the server, which reads
    // the memory counters without a turn.)
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (ServerBytesInUse() < baseline + (32 << 20) && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_GE(ServerBytesInUse(), baseline + (32 << 20));
    context.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // The cleanup runs in the session's turn, before the next call on it.
  const te::v1::SessionInfo info = Info(session_);
  EXPECT_EQ(info.resident_tensors(), 0);
  EXPECT_EQ(ServerBytesInUse(), baseline);
}

TEST_F(TransportTest, GetTensorOfAnUnknownIdIsNotFound) {
  te::v1::TensorHeader header;
  std::string bytes;
  const grpc::Status status = Get(session_, "tensor-404", 0, &header, &bytes);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(status);
}

// ---- shared memory ---------------------------------------------------------------------

TEST_F(TransportTest, ForwardReadsXFromAndWritesYToSharedMemory) {
  const int64_t batch = 64, in = 96, out = 80;
  const te::v1::InitLayerResponse layer = InitDense(session_, in, out, batch);
  const std::vector<float> x = RandomFloats(batch * in, 15);
  // The reference: the same forward with x inline.
  te::v1::ForwardRequest inline_request;
  *inline_request.mutable_session() = session_;
  inline_request.set_layer_id(layer.layer_id());
  *inline_request.mutable_x() = MakeTensor(te::v1::FLOAT32, {batch, in}, x);
  inline_request.set_deterministic(true);
  te::v1::ForwardResponse want;
  {
    grpc::ClientContext context;
    ASSERT_TRUE(stub_->Forward(&context, inline_request, &want).ok());
  }
  ClientShm shm(1 << 20);
  std::string region;
  const grpc::Status registered = Register(session_, shm.name(), 1 << 20, &region);
  ASSERT_TRUE(registered.ok()) << Describe(registered);
  EXPECT_TRUE(Maps(server_->pid(), shm.name()));
  std::memcpy(shm.data() + 4096, x.data(), x.size() * 4);
  te::v1::ForwardRequest request = inline_request;
  request.mutable_x()->clear_inline_data();
  request.mutable_x()->mutable_shm()->set_region_id(region);
  request.mutable_x()->mutable_shm()->set_offset(4096);
  request.mutable_y_shm()->set_region_id(region);
  request.mutable_y_shm()->set_offset(65536);
  te::v1::ForwardResponse got;
  grpc::ClientContext context;
  const grpc::Status status = stub_->Forward(&context, request, &got);
  ASSERT_TRUE(status.ok()) << Describe(status);
  ASSERT_EQ(got.y().data_case(), te::v1::Tensor::kShm);
  EXPECT_EQ(got.y().shm().offset(), 65536u);
  EXPECT_EQ(ShapeOf(got.y()), (std::vector<int64_t>{batch, out}));
  EXPECT_EQ(std::string(shm.data() + 65536, batch * out * 4), want.y().inline_data());
}

TEST_F(TransportTest, PutAndGetThroughSharedMemory) {
  ClientShm shm(8 << 20);
  std::string region;
  ASSERT_TRUE(Register(session_, shm.name(), 8 << 20, &region).ok());
  const std::string bytes = RandomBytes(4 << 20, 16);
  std::memcpy(shm.data() + 100, bytes.data(), bytes.size());
  te::v1::PutTensorResponse put;
  {
    grpc::ClientContext context;
    auto writer = stub_->PutTensor(&context, &put);
    te::v1::PutTensorChunk header;
    *header.mutable_header()->mutable_session() = session_;
    header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
    header.mutable_header()->mutable_tensor()->add_shape(1 << 20);
    header.mutable_header()->mutable_shm()->set_region_id(region);
    header.mutable_header()->mutable_shm()->set_offset(100);
    writer->Write(header);
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    ASSERT_TRUE(status.ok()) << Describe(status);
  }
  // The server copied it: the client may reuse its region at once.
  std::memset(shm.data(), 0, 8 << 20);
  te::v1::SharedMemoryRef destination;
  destination.set_region_id(region);
  destination.set_offset(4 << 20);
  te::v1::TensorHeader header;
  std::string streamed;
  int messages = 0;
  const grpc::Status got =
      Get(session_, put.tensor_id(), 0, &header, &streamed, &destination, &messages);
  ASSERT_TRUE(got.ok()) << Describe(got);
  EXPECT_EQ(messages, 1);  // the header alone
  EXPECT_TRUE(streamed.empty());
  EXPECT_EQ(std::string(shm.data() + (4 << 20), bytes.size()), bytes);
}

TEST_F(TransportTest, RegistrationErrors) {
  ClientShm shm(4096);
  std::string region;
  // Larger than the object.
  grpc::Status status = Register(session_, shm.name(), 8192, &region);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("holds only 4096"), std::string::npos) << Describe(status);
  // Names that are paths, or not names at all.
  for (const std::string& name :
       std::vector<std::string>{"/../etc/passwd", "/dev/shm/x", "relative", "/a..b", "/",
                                "/bad name", std::string("/") + std::string(201, 'n')}) {
    status = Register(session_, name, 16, &region);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << name << ": " << Describe(status);
  }
  status = Register(session_, "/te_transport_test_no_such_object", 16, &region);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND) << Describe(status);
  EXPECT_EQ(Info(session_).shm_regions(), 0);
}

TEST_F(TransportTest, OffsetsPastTheEndAreInvalid) {
  const te::v1::InitLayerResponse layer = InitDense(session_, 16, 8, 4);
  ClientShm shm(4096);
  std::string region;
  ASSERT_TRUE(Register(session_, shm.name(), 4096, &region).ok());
  te::v1::ForwardRequest request;
  *request.mutable_session() = session_;
  request.set_layer_id(layer.layer_id());
  request.mutable_x()->set_dtype(te::v1::FLOAT32);
  request.mutable_x()->add_shape(4);
  request.mutable_x()->add_shape(16);  // 256 bytes
  request.mutable_x()->mutable_shm()->set_region_id(region);
  request.mutable_x()->mutable_shm()->set_offset(4096 - 255);
  te::v1::ForwardResponse response;
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->Forward(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
    EXPECT_NE(status.error_message().find("x.shm: 256 bytes at offset 3841"), std::string::npos)
        << Describe(status);
  }
  request.mutable_x()->mutable_shm()->set_offset(0);
  request.mutable_y_shm()->set_region_id(region);
  request.mutable_y_shm()->set_offset(4096 - 127);  // y is 4 x 8 float32: 128 bytes
  {
    grpc::ClientContext context;
    const grpc::Status status = stub_->Forward(&context, request, &response);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
    EXPECT_NE(status.error_message().find("y_shm"), std::string::npos) << Describe(status);
  }
  request.mutable_y_shm()->set_offset(4096 - 128);
  grpc::ClientContext context;
  EXPECT_TRUE(stub_->Forward(&context, request, &response).ok());
}

TEST_F(TransportTest, AnotherSessionsRegionIsUnknown) {
  ClientShm shm(4096);
  std::string region;
  ASSERT_TRUE(Register(session_, shm.name(), 4096, &region).ok());
  const te::v1::SessionRef other = NewSession();
  te::v1::PutTensorResponse put;
  grpc::ClientContext context;
  auto writer = stub_->PutTensor(&context, &put);
  te::v1::PutTensorChunk header;
  *header.mutable_header()->mutable_session() = other;
  header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
  header.mutable_header()->mutable_tensor()->add_shape(4);
  header.mutable_header()->mutable_shm()->set_region_id(region);
  writer->Write(header);
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
  EXPECT_NE(status.error_message().find("header.shm.region_id: no shared-memory region"),
            std::string::npos)
      << Describe(status);
}

TEST_F(TransportTest, RegionsGoWithTheirSessionAndOnUnregister) {
  ClientShm first(4096), second(4096);
  std::string region;
  const te::v1::SessionRef session = NewSession();
  ASSERT_TRUE(Register(session, first.name(), 4096, &region).ok());
  std::string kept;
  ASSERT_TRUE(Register(session, second.name(), 4096, &kept).ok());
  EXPECT_TRUE(Maps(server_->pid(), first.name()));
  {
    grpc::ClientContext context;
    te::v1::UnregisterSharedMemoryRequest request;
    *request.mutable_session() = session;
    request.set_region_id(region);
    te::v1::UnregisterSharedMemoryResponse response;
    ASSERT_TRUE(stub_->UnregisterSharedMemory(&context, request, &response).ok());
    grpc::ClientContext again;
    EXPECT_EQ(stub_->UnregisterSharedMemory(&again, request, &response).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_FALSE(Maps(server_->pid(), first.name()));
  EXPECT_TRUE(Maps(server_->pid(), second.name()));
  ASSERT_TRUE(Close(session).ok());
  EXPECT_FALSE(Maps(server_->pid(), second.name()));
  // A closed session's region id means nothing in a new session.
  te::v1::GetTensorRequest request;
  *request.mutable_session() = session_;
  te::v1::PutTensorResponse put;
  ASSERT_TRUE(Put(session_, {4}, RandomBytes(16, 17), 16, &put).ok());
  te::v1::SharedMemoryRef destination;
  destination.set_region_id(kept);
  te::v1::TensorHeader header;
  std::string bytes;
  const grpc::Status status = Get(session_, put.tensor_id(), 0, &header, &bytes, &destination);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << Describe(status);
}

TEST_F(TransportTest, RegionsGoWhenTheirSessionExpires) {
  ClientShm shm(4096);
  const te::v1::SessionRef session = NewSession(/*ttl_seconds=*/1);
  std::string region;
  ASSERT_TRUE(Register(session, shm.name(), 4096, &region).ok());
  ASSERT_TRUE(Maps(server_->pid(), shm.name()));
  // The server sweeps idle sessions every second.
  const absl::Time give_up = absl::Now() + absl::Seconds(15);
  while (Maps(server_->pid(), shm.name()) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_FALSE(Maps(server_->pid(), shm.name()));
}

TEST_F(TransportTest, ShrunkRegionFailsTheCallNotTheServer) {
  const te::v1::InitLayerResponse layer = InitDense(session_, 1024, 8, 256);
  ClientShm shm(1 << 20);
  std::string region;
  ASSERT_TRUE(Register(session_, shm.name(), 1 << 20, &region).ok());
  ASSERT_EQ(ftruncate(shm.fd(), 0), 0);
  te::v1::ForwardRequest request;
  *request.mutable_session() = session_;
  request.set_layer_id(layer.layer_id());
  request.mutable_x()->set_dtype(te::v1::FLOAT32);
  request.mutable_x()->add_shape(256);
  request.mutable_x()->add_shape(1024);
  request.mutable_x()->mutable_shm()->set_region_id(region);
  te::v1::ForwardResponse response;
  grpc::ClientContext context;
  const grpc::Status status = stub_->Forward(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(status);
  EXPECT_NE(status.error_message().find("shrank"), std::string::npos) << Describe(status);
  EXPECT_EQ(Info(session_).layers(), 1);  // still serving
}

TEST(SharedMemoryDisabledTest, RegistrationIsFailedPrecondition) {
  auto server = ServerProcess::Start();
  ASSERT_TRUE(server.ok()) << server.status();
  std::unique_ptr<TeService::Stub> stub = (*server)->NewStub();
  const te::v1::SessionRef session = CreateSession(*stub).session();
  ClientShm shm(4096);
  grpc::ClientContext context;
  te::v1::RegisterSharedMemoryRequest request;
  *request.mutable_session() = session;
  request.set_name(shm.name());
  request.set_size(4096);
  te::v1::RegisterSharedMemoryResponse response;
  const grpc::Status status = stub->RegisterSharedMemory(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << Describe(status);
  EXPECT_EQ(status.error_message(), "shared memory disabled (--enable_shm)");
  EXPECT_FALSE(Maps((*server)->pid(), shm.name()));
  stub.reset();  // an open channel would hold the graceful shutdown to its grace period
  EXPECT_TRUE((*server)->Stop().ok());
}

}  // namespace
}  // namespace te::testing
