// The device's shared memory account on a GPU: every session's Ops on one
// device draws on it, so sessions that each fit their own limit cannot
// together take more than the device has for them. The refusal is
// RESOURCE_EXHAUSTED naming the tensor and what is left, before cudaMalloc
// or any kernel; the session that holds memory keeps working bit for bit;
// the caching allocator gives its cache back under pressure. Needs a GPU.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cuda/allocator.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/gpu_test_gate.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kGiB = int64_t{1} << 30;

std::vector<float> RandomFloats(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

// One session's work on tensors it allocated up front: y = 0.75 a - 1.5 b,
// rounded to bf16, read back.
struct Work {
  Tensor a, b, y, y_bf16;

  static absl::StatusOr<Work> Make(Ops& ops, int64_t n, uint32_t seed) {
    Work w;
    ASSIGN_OR_RETURN(w.a, ops.Allocate(DType::kF32, {n}));
    ASSIGN_OR_RETURN(w.b, ops.Allocate(DType::kF32, {n}));
    ASSIGN_OR_RETURN(w.y, ops.Allocate(DType::kF32, {n}));
    ASSIGN_OR_RETURN(w.y_bf16, ops.Allocate(DType::kBF16, {n}));
    const std::vector<float> a = RandomFloats(n, seed), b = RandomFloats(n, seed + 1);
    RETURN_IF_ERROR(ops.Upload(a.data(), &w.a));
    RETURN_IF_ERROR(ops.Upload(b.data(), &w.b));
    return w;
  }

  absl::StatusOr<std::vector<uint16_t>> Run(Ops& ops) {
    RETURN_IF_ERROR(ops.Axpby(0.75f, a, -1.5f, b, &y));
    RETURN_IF_ERROR(ops.Cast(y, &y_bf16));
    std::vector<uint16_t> out(static_cast<size_t>(y_bf16.numel()));
    RETURN_IF_ERROR(ops.Download(y_bf16, out.data()));
    return out;
  }
};

TEST(MemoryAccountGpuTest, TwoSessionsShareTheDevicesAccount) {
  CudaDeviceOptions options;
  options.memory_bytes = 256 * kMiB;
  auto device = OpenCudaDevice(0, options);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  EXPECT_EQ((*device)->info().memory_bytes, 256 * kMiB);
  // Each session may hold 1 GiB on its own: only the device's account binds.
  auto a_or = (*device)->NewOps(kGiB);
  auto b_or = (*device)->NewOps(kGiB);
  ASSERT_TRUE(a_or.ok() && b_or.ok());
  Ops& a = **a_or;
  Ops& b = **b_or;

  // b holds 4 x 4 MiB and has run its work once.
  auto work = Work::Make(b, kMiB, 7);
  ASSERT_TRUE(work.ok()) << work.status();
  auto first = work->Run(b);
  ASSERT_TRUE(first.ok()) << first.status();
  const int64_t b_bytes = b.bytes_in_use();
  EXPECT_EQ(b_bytes, 14 * kMiB);  // 3 f32 + 1 bf16 tensors of 1 Mi elements

  // a fills the rest in 32 MiB tensors until the account says no.
  std::vector<Tensor> held;
  absl::Status refused;
  for (int i = 0; i < 64 && refused.ok(); ++i) {
    absl::StatusOr<Tensor> t = a.Allocate(DType::kF32, {8 * kMiB});
    if (t.ok()) {
      held.push_back(*std::move(t));
    } else {
      refused = t.status();
    }
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  const std::string message(refused.message());
  EXPECT_NE(message.find("33554432 bytes for [8388608] float32"), std::string::npos) << message;
  EXPECT_NE(message.find("the sessions on cuda:0"), std::string::npos) << message;
  const int64_t left = 256 * kMiB - b_bytes - a.bytes_in_use();
  EXPECT_GE(left, 0);
  EXPECT_LT(left, 32 * kMiB);
  EXPECT_NE(message.find(absl::StrCat("(", left, " left)")), std::string::npos) << message;
  EXPECT_EQ(a.memory_available(), left);
  EXPECT_EQ(b.memory_available(), left);
  // Nothing of the refused tensor stayed charged.
  EXPECT_EQ(a.bytes_in_use(), static_cast<int64_t>(held.size()) * 32 * kMiB);
  EXPECT_EQ(a.device_memory_stats().bytes_in_use,
            b_bytes + a.bytes_in_use());  // allocator-rounded: both are whole buckets here

  // b is refused a new tensor too, and its work runs on, bit for bit.
  const absl::Status b_refused = b.Allocate(DType::kF32, {8 * kMiB}).status();
  EXPECT_EQ(b_refused.code(), absl::StatusCode::kResourceExhausted) << b_refused;
  for (int i = 0; i < 3; ++i) {
    auto again = work->Run(b);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(std::memcmp(again->data(), first->data(), first->size() * 2), 0);
  }

  // Once a lets go, b may take it.
  held.clear();
  EXPECT_EQ(a.bytes_in_use(), 0);
  EXPECT_TRUE(b.Allocate(DType::kF32, {8 * kMiB}).ok());
}

TEST(MemoryAccountGpuTest, TheDefaultAccountRefusesBeforeTheDeviceRunsOut) {
  // Free memory at open, less the 4 GiB reserve: filling it from two
  // sessions ends with the account's refusal, never cudaMalloc's.
  auto device = OpenCudaDevice(0);
  if (!device.ok()) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU: " << device.status());
  const int64_t account = (*device)->info().memory_bytes;
  size_t free_bytes = 0, total_bytes = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_bytes, &total_bytes), cudaSuccess);
  EXPECT_GT(account, 0);
  EXPECT_LE(account, static_cast<int64_t>(free_bytes) - CudaDeviceOptions().memory_reserve_bytes);
  std::printf("cuda:0: %lld MiB for sessions of %lld MiB on the device (%lld MiB free at open)\n",
              static_cast<long long>(account >> 20), static_cast<long long>(total_bytes >> 20),
              static_cast<long long>(free_bytes >> 20));

  const int64_t limit = int64_t{1} << 40;  // no per-session bound
  auto a_or = (*device)->NewOps(limit);
  auto b_or = (*device)->NewOps(limit);
  ASSERT_TRUE(a_or.ok() && b_or.ok());
  std::vector<Tensor> held;
  absl::Status refused;
  for (int i = 0; refused.ok() && i < 4096; ++i) {
    Ops& ops = i % 2 == 0 ? **a_or : **b_or;
    absl::StatusOr<Tensor> t = ops.Allocate(DType::kBool, {4 * kGiB});
    if (t.ok()) {
      held.push_back(*std::move(t));
    } else {
      refused = t.status();
    }
  }
  ASSERT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("the sessions on cuda:0"), std::string::npos) << refused;
  EXPECT_EQ(refused.message().find("out of memory"), std::string::npos) << refused;
  EXPECT_GE(static_cast<int64_t>(held.size()) * 4 * kGiB, account - 4 * kGiB);
  // The device still has room for a library's own allocation (the reserve).
  void* library = nullptr;
  EXPECT_EQ(cudaMalloc(&library, 512 * kMiB), cudaSuccess);
  cudaFree(library);
}

TEST(MemoryAccountGpuTest, TheCacheGoesBackBeforeTheAllocatorPassesItsLimit) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU");
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t raw = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  std::shared_ptr<CUstream_st> stream(raw, [](cudaStream_t s) { cudaStreamDestroy(s); });
  auto allocator = std::make_shared<cuda::CachingAllocator>(0, /*reserve_limit=*/96 * kMiB);
  {
    auto first = allocator->Allocate(64 * kMiB, stream);
    ASSERT_TRUE(first.ok()) << first.status();
  }
  EXPECT_EQ(allocator->stats().bytes_reserved, 64 * kMiB);  // cached
  // 68 MiB: a miss (the cached block is smaller), and 64 + 68 > 96, so the
  // cache goes back before the cudaMalloc.
  auto second = allocator->Allocate(68 * kMiB, stream);
  ASSERT_TRUE(second.ok()) << second.status();
  const cuda::CachingAllocator::Stats stats = allocator->stats();
  EXPECT_EQ(stats.cache_releases, 1);
  EXPECT_EQ(stats.bytes_reserved, stats.bytes_in_use);  // the 64 MiB block went back
}

TEST(MemoryAccountGpuTest, PressureGivesBackOnlyWhatTheRequestNeedsLargestFirst) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) TE_SKIP_OR_FAIL_WITHOUT_GPU("no GPU");
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  cudaStream_t raw = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking), cudaSuccess);
  std::shared_ptr<CUstream_st> stream(raw, [](cudaStream_t s) { cudaStreamDestroy(s); });
  auto allocator = std::make_shared<cuda::CachingAllocator>(0, /*reserve_limit=*/96 * kMiB);
  {
    auto small = allocator->Allocate(8 * kMiB, stream);
    auto large = allocator->Allocate(40 * kMiB, stream);
    ASSERT_TRUE(small.ok() && large.ok());
  }
  ASSERT_EQ(allocator->stats().bytes_reserved, 48 * kMiB);  // both cached
  // 60 MiB misses; 48 + 60 passes 96 by 12: the 40 MiB block goes back, the
  // 8 MiB one (another session's hot block) stays cached.
  auto big = allocator->Allocate(60 * kMiB, stream);
  ASSERT_TRUE(big.ok()) << big.status();
  cuda::CachingAllocator::Stats stats = allocator->stats();
  EXPECT_EQ(stats.cache_releases, 1);
  EXPECT_EQ(stats.bytes_reserved, 68 * kMiB);
  EXPECT_EQ(stats.bytes_in_use, 60 * kMiB);
  const int64_t mallocs = stats.cuda_mallocs;
  auto again = allocator->Allocate(8 * kMiB, stream);  // served from the cache
  ASSERT_TRUE(again.ok()) << again.status();
  stats = allocator->stats();
  EXPECT_EQ(stats.cuda_mallocs, mallocs);
  EXPECT_EQ(stats.bytes_reserved, 68 * kMiB);
}

}  // namespace
}  // namespace te
