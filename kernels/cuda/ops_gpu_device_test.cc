// The CUDA device itself: its info, out-of-range ordinals, the session memory
// limit and device out-of-memory as RESOURCE_EXHAUSTED, no cudaMalloc in
// steady state, two streams sharing the allocator's cache, downloads and
// small uploads that do not wait, and bad arguments as INVALID_ARGUMENT.
#include <chrono>

#include "kernels/cuda/ops_gpu_test.h"

namespace te {
namespace gpu_test {
namespace {

// ---- device, memory, allocator ------------------------------------------------------------

class DeviceTest : public GpuTest {};

TEST_F(DeviceTest, InfoAndBackend) {
  EXPECT_TRUE(CudaBackendBuilt());
  const DeviceInfo info = OpenBackends()->gpu_device->info();
  EXPECT_EQ(info.name, "cuda:0");
  EXPECT_FALSE(info.description.empty());
  EXPECT_GE(info.compute_capability, 70);
  EXPECT_GT(info.memory_bytes, int64_t{1} << 30);
  EXPECT_EQ(info.fp8_native, info.compute_capability >= 89);
  EXPECT_EQ(info.block_scaling_native, info.compute_capability >= 100);
  EXPECT_TRUE(OpenBackends()->gpu_device->healthy());
  EXPECT_EQ(gpu_->device_name(), "cuda:0");
}

TEST_F(DeviceTest, OrdinalOutOfRangeIsUnavailable) {
  auto device = OpenCudaDevice(1000);
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), absl::StatusCode::kUnavailable) << device.status();
}

TEST_F(DeviceTest, MemoryLimitIsResourceExhausted) {
  auto ops = OpenBackends()->gpu_device->NewOps(1 << 20);
  ASSERT_TRUE(ops.ok());
  auto small = (*ops)->Allocate(DType::kF32, {1000});
  ASSERT_TRUE(small.ok());
  auto big = (*ops)->Allocate(DType::kF32, {1 << 20});
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*ops)->bytes_in_use(), 4000);
}

TEST_F(DeviceTest, DeviceOutOfMemoryIsResourceExhausted) {
  auto ops = OpenBackends()->gpu_device->NewOps(int64_t{1} << 50);
  ASSERT_TRUE(ops.ok());
  auto huge = (*ops)->Allocate(DType::kF32, {int64_t{1} << 45});  // 128 TiB
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  // The device is still usable afterwards.
  Pair x = Random(DType::kF32, {77, 200}, 20);
  EXPECT_TRUE(gpu_->Synchronize().ok());
}

// A training-like step allocating and freeing its temporaries: after the first
// step every allocation is served from the cache.
TEST_F(DeviceTest, NoCudaMallocInSteadyState) {
  auto* cuda_ops = dynamic_cast<cuda::CudaOps*>(gpu_);
  ASSERT_NE(cuda_ops, nullptr);
  const Pair x = Random(DType::kBF16, {128, 4096}, 21);
  const Pair gamma = Random(DType::kBF16, {4096}, 22);
  const Pair beta = Random(DType::kBF16, {4096}, 23);
  auto step = [&] {
    Tensor y = NewGpu(DType::kBF16, {128, 4096});
    Tensor mu = NewGpu(DType::kF32, {128});
    Tensor rsigma = NewGpu(DType::kF32, {128});
    NormArgs args;
    ASSERT_TRUE(gpu_->NormForward(args, x.gpu, gamma.gpu, beta.gpu, &y, &mu, &rsigma, nullptr).ok());
    Tensor dx = NewGpu(DType::kBF16, {128, 4096});
    Tensor dgamma = NewGpu(DType::kBF16, {4096}), dbeta = NewGpu(DType::kBF16, {4096});
    ASSERT_TRUE(gpu_->NormBackward(args, y, x.gpu, mu, rsigma, gamma.gpu, &dx, &dgamma, &dbeta).ok());
    Tensor bias_grad = NewGpu(DType::kF32, {4096});
    ASSERT_TRUE(gpu_->SumRows(dx, &bias_grad).ok());
  };
  step();
  const int64_t mallocs = cuda_ops->context().allocator->stats().cuda_mallocs;
  for (int i = 0; i < 5; ++i) step();
  ASSERT_TRUE(gpu_->Synchronize().ok());
  EXPECT_EQ(cuda_ops->context().allocator->stats().cuda_mallocs, mallocs);
}

TEST_F(DeviceTest, TwoStreamsShareTheCacheSafely) {
  auto other = OpenBackends()->gpu_device->NewOps(int64_t{1} << 30);
  ASSERT_TRUE(other.ok());
  // Memory freed on one stream and reused on the other must not be clobbered
  // while the first stream's work is still queued.
  const Pair x = Random(DType::kF32, {1024, 1024}, 24);
  for (int round = 0; round < 3; ++round) {
    Tensor expected_cpu = NewCpu(DType::kF32, {1024, 1024});
    ASSERT_TRUE(cpu_->Axpby(2.0f, x.cpu, 0.0f, Tensor(), &expected_cpu).ok());
    Tensor result;
    {
      Tensor scratch = NewGpu(DType::kF32, {1024, 1024});
      ASSERT_TRUE(gpu_->Axpby(2.0f, x.gpu, 0.0f, Tensor(), &scratch).ok());
      result = NewGpu(DType::kF32, {1024, 1024});
      ASSERT_TRUE(gpu_->Copy(scratch, &result).ok());
    }  // scratch freed with gpu_'s work possibly queued
    auto reuse = (*other)->Allocate(DType::kF32, {1024, 1024});
    ASSERT_TRUE(reuse.ok());
    ASSERT_TRUE((*other)->Fill(-7.0f, &*reuse).ok());
    ExpectMatches(Pair{expected_cpu, result}, "result after cross-stream reuse");
    ASSERT_TRUE((*other)->Synchronize().ok());
  }
}

// A download that does not wait: the copy lands behind the work queued
// before it, while the host goes on queueing more (a generation's next
// step), and Wait() returns once it has; the completion is re-armed by each
// download. An int32 counter advanced on the device between the downloads
// shows each holds its own moment.
TEST_F(DeviceTest, DownloadAsyncLandsAfterTheWorkBeforeIt) {
  Tensor counter = NewGpu(DType::kI32, {3});
  const int32_t start[] = {5, -2, 100};
  ASSERT_TRUE(gpu_->Upload(start, &counter).ok());
  auto staging = gpu_->AllocateStaging(2 * sizeof(start));
  ASSERT_TRUE(staging.ok()) << staging.status();
  int32_t* slots = static_cast<int32_t*>(staging->get());
  auto first = gpu_->NewCompletion();
  auto second = gpu_->NewCompletion();
  ASSERT_TRUE(first.ok() && second.ok());
  // Queued work ahead of the first download: a large fill.
  Tensor big = NewGpu(DType::kF32, {64 << 20});
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(gpu_->Fill(1.0f, &big).ok());
    ASSERT_TRUE(gpu_->AddScalarI32(1, &counter).ok());
    ASSERT_TRUE(gpu_->DownloadAsync(counter, slots, first->get()).ok());
    ASSERT_TRUE(gpu_->Fill(2.0f, &big).ok());
    ASSERT_TRUE(gpu_->AddScalarI32(10, &counter).ok());
    ASSERT_TRUE(gpu_->DownloadAsync(counter, slots + 3, second->get()).ok());
    ASSERT_TRUE((*first)->Wait().ok());
    ASSERT_TRUE((*second)->Wait().ok());
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(slots[i], start[i] + 11 * round + 1) << "round " << round << ", " << i;
      EXPECT_EQ(slots[3 + i], start[i] + 11 * (round + 1)) << "round " << round << ", " << i;
    }
  }
  // A completion from another backend is refused, naming it.
  Ops::Completion foreign;
  const absl::Status refused = gpu_->DownloadAsync(counter, slots, &foreign);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("done"), std::string::npos) << refused;
}

// Small uploads do not wait for the work queued before them (a training
// step's tokens behind the step before): with a quarter second of fills
// queued, 100 uploads of 32 KiB from one host buffer, rewritten after each
// call, return long before the fills end. Then 600 more behind a shorter
// run of fills, past the stream's page-locked budget (16 MiB: 256 of these
// buffers), so the oldest copies are waited for and their buffers reused.
// Every device copy holds its own bytes; an upload over the staged size
// still lands.
TEST_F(DeviceTest, SmallUploadsDoNotWaitForTheStream) {
  Tensor big = NewGpu(DType::kF32, {64 << 20});
  ASSERT_TRUE(gpu_->Fill(0.0f, &big).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  const auto fill_start = std::chrono::steady_clock::now();
  ASSERT_TRUE(gpu_->Fill(1.0f, &big).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  const double fill_ms = std::chrono::duration<double, std::milli>(
                             std::chrono::steady_clock::now() - fill_start).count();
  const int fills = std::max(1, static_cast<int>(250.0 / std::max(fill_ms, 0.01)));

  constexpr int64_t kElements = 8192;  // 32 KiB of int32
  std::vector<int32_t> host(kElements);
  std::vector<Tensor> copies;
  auto upload = [&](int u) {
    for (int64_t e = 0; e < kElements; ++e) host[e] = static_cast<int32_t>(u * 100003 + e);
    copies.push_back(NewGpu(DType::kI32, {kElements}));
    return gpu_->Upload(host.data(), &copies.back());
  };
  for (int i = 0; i < fills; ++i) ASSERT_TRUE(gpu_->Fill(static_cast<float>(i), &big).ok());
  const auto start = std::chrono::steady_clock::now();
  for (int u = 0; u < 100; ++u) ASSERT_TRUE(upload(u).ok());
  const double upload_ms = std::chrono::duration<double, std::milli>(
                               std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(upload_ms, 100.0) << "the uploads waited for " << fills << " queued fills";
  for (int i = 0; i < fills / 10 + 1; ++i) ASSERT_TRUE(gpu_->Fill(static_cast<float>(i), &big).ok());
  for (int u = 100; u < 700; ++u) ASSERT_TRUE(upload(u).ok());
  ASSERT_TRUE(gpu_->Synchronize().ok());
  for (int u = 0; u < static_cast<int>(copies.size()); ++u) {
    std::vector<int32_t> got(kElements);
    ASSERT_TRUE(gpu_->Download(copies[u], got.data()).ok());
    for (int64_t e = 0; e < kElements; e += 997) {
      ASSERT_EQ(got[e], static_cast<int32_t>(u * 100003 + e)) << "upload " << u << ", " << e;
    }
    ASSERT_EQ(got[kElements - 1], static_cast<int32_t>(u * 100003 + kElements - 1)) << u;
  }
  std::vector<float> large(3 << 20);  // 12 MiB: not staged
  for (size_t e = 0; e < large.size(); ++e) large[e] = static_cast<float>(e % 65521) * 0.25f - 7.0f;
  Tensor large_copy = NewGpu(DType::kF32, {static_cast<int64_t>(large.size())});
  ASSERT_TRUE(gpu_->Upload(large.data(), &large_copy).ok());
  std::vector<float> back(large.size());
  ASSERT_TRUE(gpu_->Download(large_copy, back.data()).ok());
  EXPECT_EQ(back, large);
}

TEST_F(DeviceTest, BadArgumentsAreInvalidArgument) {
  Pair x = Random(DType::kF32, {4, 8}, 25);
  Pair y = Output(DType::kF32, {4, 9});
  EXPECT_EQ(gpu_->Cast(x.gpu, &y.gpu).code(), absl::StatusCode::kInvalidArgument);
  Pair q = Output(DType::kE4M3, {4, 8});
  EXPECT_EQ(gpu_->ActivationForward({Activation::kGelu}, x.gpu, &q.gpu, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->DropoutForward(1.5f, 1, x.gpu, &x.gpu, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(gpu_->Permute(x.gpu, {0, 0}, &x.gpu).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gpu_test
}  // namespace te
