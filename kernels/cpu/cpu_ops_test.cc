// The CPU device, memory accounting, copies and the elementwise ops (Fill,
// Cast, Axpby, Permute, SumRows) against float64 references; the int32
// counter add and greedy decoding's argmax against their definitions.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_ops.h"
#include "kernels/cpu/test_util.h"

namespace te {
namespace {

using testing::MakeEmpty;
using testing::MakeRandom;
using testing::MakeTensor;
using testing::RelativeError;
using testing::ShortName;
using testing::ToDoubles;
using testing::Tolerance;

const DType kFloatDTypes[] = {DType::kF32, DType::kBF16, DType::kF16};
const Shape kShapes[] = {{7, 13}, {33, 65}, {1, 1}, {4, 64}};

// ---- device and memory ---------------------------------------------------------

TEST(CpuDeviceTest, InfoDescribesTheReferenceBackend) {
  auto device = OpenCpuDevice();
  ASSERT_TRUE(device.ok()) << device.status();
  const DeviceInfo info = (*device)->info();
  EXPECT_EQ(info.name, "cpu");
  EXPECT_NE(info.description.find("CPU"), std::string::npos) << info.description;
  EXPECT_FALSE(info.fp8_native);
  EXPECT_FALSE(info.block_scaling_native);
  EXPECT_EQ(info.compute_capability, 0);
  EXPECT_TRUE((*device)->healthy());
}

TEST(CpuDeviceTest, NewOpsCarriesItsMemoryLimit) {
  auto device = OpenCpuDevice();
  ASSERT_TRUE(device.ok());
  auto ops = (*device)->NewOps(1000);
  ASSERT_TRUE(ops.ok()) << ops.status();
  EXPECT_EQ((*ops)->memory_limit(), 1000);
  EXPECT_EQ((*ops)->device_name(), "cpu");
  EXPECT_EQ((*device)->NewOps(0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuMemoryTest, AllocationsAreAlignedAndAccounted) {
  CpuOps ops;
  ops.set_memory_limit(1 << 20);
  {
    auto a = ops.Allocate(DType::kBF16, {3, 7});
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data()) % 64, 0u);
    EXPECT_EQ(ops.bytes_in_use(), 42);
    Tensor copy = *a;  // shares storage: no second charge
    EXPECT_EQ(ops.bytes_in_use(), 42);
  }
  EXPECT_EQ(ops.bytes_in_use(), 0);
}

TEST(CpuMemoryTest, OverTheLimitIsResourceExhausted) {
  CpuOps ops;
  ops.set_memory_limit(1024);
  auto held = ops.Allocate(DType::kF32, {200});  // 800 bytes
  ASSERT_TRUE(held.ok());
  EXPECT_EQ(ops.Allocate(DType::kF32, {100}).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(ops.Allocate(DType::kF32, {56}).ok());
}

TEST(CpuMemoryTest, SizesPast2To63AreRefusedNotWrapped) {
  CpuOps ops;
  ops.set_memory_limit(1 << 20);
  // 4 * 2^62 * 2^62: a product that wraps to 0 in int64.
  const absl::StatusOr<Tensor> huge =
      ops.Allocate(DType::kF32, {4, int64_t{1} << 62, int64_t{1} << 62});
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_FALSE(CheckedNumElements({4, int64_t{1} << 62, int64_t{1} << 62}).has_value());
  EXPECT_FALSE(CheckedNumBytes({int64_t{1} << 62}, DType::kF32).has_value());
  EXPECT_FALSE(CheckedNumElements({3, -1}).has_value());
  // An overflow before a zero dimension still says "out of range".
  EXPECT_FALSE(CheckedNumElements({int64_t{1} << 62, 8, 0}).has_value());
  EXPECT_EQ(CheckedNumElements({int64_t{1} << 62, 0, 8}), 0);
  EXPECT_EQ(CheckedNumBytes({3, 5}, DType::kBF16), 30);
  EXPECT_EQ(ops.bytes_in_use(), 0);
}

TEST(CpuDeviceTest, SessionsTogetherStayWithinTheDevicesMemory) {
  // Two sessions' Ops, each under its own 1 MiB limit, sharing 1 MiB of device.
  auto shared = std::make_shared<SharedMemoryAccount>(1 << 20);
  CpuOps a, b;
  for (CpuOps* ops : {&a, &b}) {
    ops->set_memory_limit(1 << 20);
    ops->set_shared_account(shared);
  }
  absl::StatusOr<Tensor> held = a.Allocate(DType::kF32, {150000});  // 600 kB
  ASSERT_TRUE(held.ok()) << held.status();
  const absl::StatusOr<Tensor> refused = b.Allocate(DType::kF32, {150000});
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("the sessions on cpu"), std::string::npos)
      << refused.status();
  EXPECT_NE(refused.status().message().find("(448576 left)"), std::string::npos)
      << refused.status();
  // What b may still take: the device's remainder, below its own limit's.
  EXPECT_EQ(b.memory_available(), (1 << 20) - 600000);
  EXPECT_EQ(a.memory_available(), (1 << 20) - 600000);
  EXPECT_EQ(b.bytes_in_use(), 0);
  EXPECT_EQ(shared->in_use.load(), 600000);
  held = absl::StatusOr<Tensor>(absl::CancelledError("freed"));  // a's tensor goes
  EXPECT_EQ(shared->in_use.load(), 0);
  EXPECT_TRUE(b.Allocate(DType::kF32, {150000}).ok());
}

// A request the device's account refuses is never charged, not even for a
// moment: while one session keeps asking for more than the device has,
// another's requests that fit all succeed (with the charge taken first and
// given back on refusal, some of them failed beside it).
TEST(CpuDeviceTest, ARefusedRequestNeverCrowdsOutOneThatFits) {
  auto shared = std::make_shared<SharedMemoryAccount>(1 << 20);
  CpuOps hog, small;
  for (CpuOps* ops : {&hog, &small}) ops->set_shared_account(shared);
  const absl::StatusOr<Tensor> held = small.Allocate(DType::kBool, {200000});
  ASSERT_TRUE(held.ok()) << held.status();  // from now on the hog never fits
  std::atomic<bool> done{false};
  std::atomic<int64_t> hog_refusals{0};
  std::thread asking([&] {
    while (!done.load()) {
      // 900 kB: fits the device alone, never beside the small session's.
      if (!hog.Allocate(DType::kBool, {900000}).ok()) ++hog_refusals;
    }
  });
  int64_t small_refusals = 0;
  for (int i = 0; i < 200000; ++i) {
    if (!small.Allocate(DType::kBool, {1000}).ok()) ++small_refusals;
  }
  done = true;
  asking.join();
  EXPECT_GT(hog_refusals.load(), 0);
  EXPECT_EQ(small_refusals, 0);
  EXPECT_EQ(shared->in_use.load(), 200000);
}

TEST(CpuDeviceTest, TheDeviceReportsTheMemoryItsSessionsShare) {
  auto device = OpenCpuDevice();
  ASSERT_TRUE(device.ok());
  EXPECT_GT((*device)->info().memory_bytes, int64_t{1} << 28);
}

// Ops::CastKept: a weight's cast made once while a memo is installed, the
// same bytes as Cast; a view of other shape, another dtype or no memo cast
// again; a tensor already in the dtype is itself.
TEST(CastKeptTest, CastsEachSourceOnceUnderAMemo) {
  CpuOps ops;
  const Tensor w = MakeRandom(ops, DType::kF32, {4, 6}, 3);
  auto plain = ops.CastKept(w, DType::kBF16);
  ASSERT_TRUE(plain.ok()) << plain.status();
  auto again = ops.CastKept(w, DType::kBF16);
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->data(), plain->data()) << "no memo: every call casts";
  ops.set_cast_memo(std::make_shared<Ops::CastMemo>());
  {
    auto first = ops.CastKept(w, DType::kBF16);
    auto second = ops.CastKept(w, DType::kBF16);
    ASSERT_TRUE(first.ok() && second.ok());
    EXPECT_EQ(second->data(), first->data());
    EXPECT_EQ(ToDoubles(*first), ToDoubles(*plain));
    // A view of another shape over the same memory is cast again, and
    // takes that memory's place in the memo for this dtype.
    auto view = ops.CastKept(w.Reshaped({24}), DType::kBF16);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(view->shape(), Shape({24}));
    EXPECT_NE(view->data(), first->data());
    auto half = ops.CastKept(w, DType::kF16);
    ASSERT_TRUE(half.ok());
    EXPECT_EQ(half->dtype(), DType::kF16);
    auto same = ops.CastKept(w, DType::kF32);
    ASSERT_TRUE(same.ok());
    EXPECT_EQ(same->data(), w.data());
    EXPECT_EQ(ops.cast_memo()->size(), 2u);
  }
  const int64_t held = ops.bytes_in_use();
  ops.set_cast_memo(nullptr);
  EXPECT_LT(ops.bytes_in_use(), held) << "the memo's copies outlived it";
}

// CastMemoScope: its memo installed while it lives and the one before back
// after; without Commit the casts kept meanwhile go, those kept before stay;
// with Commit they all stay; a null memo leaves the ops' memo alone.
TEST(CastKeptTest, AScopeKeepsItsCastsOnlyWhenCommitted) {
  CpuOps ops;
  const Tensor w = MakeRandom(ops, DType::kF32, {4, 6}, 5);
  const Tensor v = MakeRandom(ops, DType::kF32, {3, 2}, 6);
  const auto outer = std::make_shared<Ops::CastMemo>();
  const auto kept = std::make_shared<Ops::CastMemo>();
  ops.set_cast_memo(outer);
  {
    CastMemoScope scope(ops, kept);
    EXPECT_EQ(ops.cast_memo(), kept);
    ASSERT_TRUE(ops.CastKept(w, DType::kBF16).ok());
    scope.Commit();
  }
  EXPECT_EQ(ops.cast_memo(), outer);
  EXPECT_EQ(kept->size(), 1u);
  {
    CastMemoScope failed(ops, kept);
    ASSERT_TRUE(ops.CastKept(v, DType::kBF16).ok());
    ASSERT_TRUE(ops.CastKept(w, DType::kF16).ok());
    EXPECT_EQ(kept->size(), 3u);
  }
  EXPECT_EQ(ops.cast_memo(), outer);
  ASSERT_EQ(kept->size(), 1u) << "an uncommitted scope's casts stayed";
  EXPECT_NE(kept->Find(w, DType::kBF16), nullptr);
  {
    CastMemoScope none(ops, nullptr);
    EXPECT_EQ(ops.cast_memo(), outer);
    ASSERT_TRUE(ops.CastKept(v, DType::kBF16).ok());
  }
  EXPECT_EQ(ops.cast_memo(), outer);
  EXPECT_EQ(outer->size(), 1u) << "the memo installed before took the null scope's cast";
  ops.set_cast_memo(nullptr);
}

TEST(CpuCopyTest, UploadDownloadRoundTrip) {
  CpuOps ops;
  const std::vector<float> host = testing::RandomValues(91, 1);
  Tensor t = MakeEmpty(ops, DType::kF32, {7, 13});
  ASSERT_TRUE(ops.Upload(host.data(), &t).ok());
  std::vector<float> back(91);
  ASSERT_TRUE(ops.Download(t, back.data()).ok());
  EXPECT_EQ(std::memcmp(host.data(), back.data(), host.size() * 4), 0);
  EXPECT_EQ(ops.Upload(nullptr, &t).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuCopyTest, CopyChecksDTypeAndCount) {
  CpuOps ops;
  Tensor src = MakeRandom(ops, DType::kBF16, {5, 6}, 2);
  Tensor dst = MakeEmpty(ops, DType::kBF16, {30});
  ASSERT_TRUE(ops.Copy(src, &dst).ok());
  EXPECT_EQ(std::memcmp(src.data(), dst.data(), src.nbytes()), 0);
  Tensor wrong_dtype = MakeEmpty(ops, DType::kF32, {5, 6});
  EXPECT_EQ(ops.Copy(src, &wrong_dtype).code(), absl::StatusCode::kInvalidArgument);
  Tensor wrong_count = MakeEmpty(ops, DType::kBF16, {31});
  EXPECT_EQ(ops.Copy(src, &wrong_count).code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuCopyTest, CopyAllCopiesEveryPairAndNamesABadOne) {
  CpuOps ops;
  Tensor a = MakeRandom(ops, DType::kF32, {16}, 3), b = MakeRandom(ops, DType::kBF16, {2, 3}, 4);
  Tensor a2 = MakeEmpty(ops, DType::kF32, {16}), b2 = MakeEmpty(ops, DType::kBF16, {6});
  ASSERT_TRUE(ops.CopyAll({&a, &b}, {&a2, &b2}).ok());
  EXPECT_EQ(std::memcmp(a.data(), a2.data(), a.nbytes()), 0);
  EXPECT_EQ(std::memcmp(b.data(), b2.data(), b.nbytes()), 0);
  EXPECT_EQ(ops.CopyAll({&a}, {&a2, &b2}).code(), absl::StatusCode::kInvalidArgument);
  Tensor wrong = MakeEmpty(ops, DType::kF32, {6});
  const absl::Status bad = ops.CopyAll({&a, &b}, {&a2, &wrong});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("pair 1"), std::string::npos) << bad;
}

Tensor Position(Ops& ops, int32_t value) {
  Tensor t = MakeEmpty(ops, DType::kI32, {1});
  t.data_as<int32_t>()[0] = value;
  return t;
}

// dst row (b, t) holds src row (b, t - p) where 0 <= t - p < S, and what it
// held before everywhere else: out-of-range rows are skipped, not clamped.
TEST(CpuCopyTest, CopyRowsAtWritesRowsFromThePosition) {
  CpuOps ops;
  const int64_t batch = 3, length = 16;
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    for (int64_t seq : {1, 5}) {
      for (int32_t p : {0, 4, 11, 13, 15, 16, -2}) {
        const uint32_t seed = static_cast<uint32_t>(10 + p);
        const Tensor src = MakeRandom(ops, dtype, {batch, seq, 2, 8}, seed);
        Tensor dst = MakeRandom(ops, dtype, {batch, length, 2, 8}, seed + 100);
        Tensor before = MakeEmpty(ops, dtype, dst.shape());
        ASSERT_TRUE(ops.Copy(dst, &before).ok());
        ASSERT_TRUE(ops.CopyRowsAt(src, Position(ops, p), &dst).ok());
        const size_t row_bytes = 16 * DTypeSize(dtype);
        const auto* got = dst.data_as<const uint8_t>();
        for (int64_t b = 0; b < batch; ++b) {
          for (int64_t t = 0; t < length; ++t) {
            const int64_t s = t - p;
            const uint8_t* want = s >= 0 && s < seq
                                      ? src.data_as<const uint8_t>() + (b * seq + s) * row_bytes
                                      : before.data_as<const uint8_t>() +
                                            (b * length + t) * row_bytes;
            EXPECT_EQ(std::memcmp(got + (b * length + t) * row_bytes, want, row_bytes), 0)
                << ShortName(dtype) << " S=" << seq << " p=" << p << " row (" << b << ", " << t
                << ")";
          }
        }
      }
    }
  }
}

TEST(CpuCopyTest, CopyRowsAtRejectsBadArguments) {
  CpuOps ops;
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const Tensor src = MakeRandom(ops, DType::kBF16, {3, 2, 2, 8}, 7);
  Tensor dst = MakeRandom(ops, DType::kBF16, {3, 16, 2, 8}, 8);
  const Tensor position = Position(ops, 1);
  EXPECT_EQ(ops.CopyRowsAt(src, MakeTensor(ops, DType::kF32, {1}, {1.0f}), &dst).code(),
            kInvalid);
  Tensor two = MakeEmpty(ops, DType::kI32, {2});
  two.data_as<int32_t>()[0] = two.data_as<int32_t>()[1] = 1;
  EXPECT_EQ(ops.CopyRowsAt(src, two, &dst).code(), kInvalid);
  EXPECT_EQ(ops.CopyRowsAt(src, Tensor(), &dst).code(), kInvalid);
  Tensor wrong_trailing = MakeEmpty(ops, DType::kBF16, {3, 16, 2, 4});
  EXPECT_EQ(ops.CopyRowsAt(src, position, &wrong_trailing).code(), kInvalid);
  Tensor wrong_rank = MakeEmpty(ops, DType::kBF16, {3, 16, 16});
  EXPECT_EQ(ops.CopyRowsAt(src, position, &wrong_rank).code(), kInvalid);
  Tensor wrong_batch = MakeEmpty(ops, DType::kBF16, {2, 16, 2, 8});
  EXPECT_EQ(ops.CopyRowsAt(src, position, &wrong_batch).code(), kInvalid);
  Tensor wrong_dtype = MakeEmpty(ops, DType::kF32, {3, 16, 2, 8});
  EXPECT_EQ(ops.CopyRowsAt(src, position, &wrong_dtype).code(), kInvalid);
  const Tensor flat = MakeRandom(ops, DType::kBF16, {3}, 9);
  EXPECT_EQ(ops.CopyRowsAt(flat, position, &dst).code(), kInvalid);
  EXPECT_TRUE(ops.CopyRowsAt(src, position, &dst).ok());
}

// ---- AddScalarI32, ArgmaxLast ---------------------------------------------------

TEST(CpuAddScalarI32Test, AddsInPlaceAndNamesANonIntTensor) {
  CpuOps ops;
  Tensor y = MakeEmpty(ops, DType::kI32, {5});
  const int32_t start[] = {-3, 0, 7, 1 << 20, 41};
  std::memcpy(y.data(), start, sizeof(start));
  ASSERT_TRUE(ops.AddScalarI32(2, &y).ok());
  for (int i = 0; i < 5; ++i) EXPECT_EQ(y.data_as<int32_t>()[i], start[i] + 2) << i;
  Tensor f = MakeEmpty(ops, DType::kF32, {5});
  const absl::Status wrong = ops.AddScalarI32(1, &f);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(wrong.message().find("y"), std::string::npos) << wrong;
}

// jnp.argmax(x, axis=-1): the first maximum; the first NaN where there is
// one; -0 and +0 equal.
TEST(CpuArgmaxLastTest, FirstMaximumFirstNanAndEqualZeros) {
  CpuOps ops;
  const float nan = std::nanf("");
  const std::vector<float> rows = {
      1, 5, 2, 5,                 // a tie: the first
      -1, -0.5f, -7, -0.5f,       // negatives
      nan, 3, nan, 9,             // NaN first
      4, 2, nan, 8,               // a later NaN wins over larger numbers
      -0.0f, 0.0f, -1, -2,        // -0 == +0: the first
      -INFINITY, -INFINITY, -INFINITY, -INFINITY,  // all equal
  };
  const int32_t want[] = {1, 1, 0, 2, 0, 0};
  for (DType dtype : kFloatDTypes) {
    const Tensor x = MakeTensor(ops, dtype, {2, 3, 4}, rows);
    Tensor y = MakeEmpty(ops, DType::kI32, {2, 3});
    ASSERT_TRUE(ops.ArgmaxLast(x, &y).ok());
    for (int r = 0; r < 6; ++r) EXPECT_EQ(y.data_as<int32_t>()[r], want[r]) << ShortName(dtype) << r;
  }
}

TEST(CpuArgmaxLastTest, MatchesAScanOnRandomRows) {
  CpuOps ops;
  const int64_t rows = 9, vocab = 1001;
  const Tensor x = MakeRandom(ops, DType::kF32, {rows, vocab}, 21, -4.0f, 4.0f);
  Tensor y = MakeEmpty(ops, DType::kI32, {rows});
  ASSERT_TRUE(ops.ArgmaxLast(x, &y).ok());
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x.data_as<float>() + r * vocab;
    EXPECT_EQ(y.data_as<int32_t>()[r], std::max_element(row, row + vocab) - row) << r;
  }
}

TEST(CpuArgmaxLastTest, NamesTheWrongArgument) {
  CpuOps ops;
  const Tensor x = MakeRandom(ops, DType::kF32, {3, 4}, 5);
  Tensor wrong_count = MakeEmpty(ops, DType::kI32, {4});
  Tensor wrong_dtype = MakeEmpty(ops, DType::kF32, {3});
  const Tensor ids = MakeEmpty(ops, DType::kI32, {3, 4});
  Tensor y = MakeEmpty(ops, DType::kI32, {3});
  const absl::Status count = ops.ArgmaxLast(x, &wrong_count);
  EXPECT_EQ(count.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(count.message().find("one per row"), std::string::npos) << count;
  EXPECT_EQ(ops.ArgmaxLast(x, &wrong_dtype).code(), absl::StatusCode::kInvalidArgument);
  const absl::Status not_float = ops.ArgmaxLast(ids, &y);
  EXPECT_EQ(not_float.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(not_float.message().find("x has dtype"), std::string::npos) << not_float;
}

// ---- Fill, Cast ----------------------------------------------------------------

TEST(CpuFillTest, EveryElementRoundedOnce) {
  CpuOps ops;
  for (DType dtype : kFloatDTypes) {
    Tensor y = MakeEmpty(ops, dtype, {7, 13});
    ASSERT_TRUE(ops.Fill(0.1f, &y).ok());
    for (int64_t i = 0; i < y.numel(); ++i) {
      ASSERT_EQ(LoadAsFloat(y, i), RoundTo(dtype, 0.1f)) << ShortName(dtype) << " at " << i;
    }
  }
}

TEST(CpuCastTest, MatchesTheFormatCastsExactly) {
  CpuOps ops;
  for (DType from : kFloatDTypes) {
    for (DType to : kFloatDTypes) {
      Tensor x = MakeRandom(ops, from, {33, 65}, 3, -1e3f, 1e3f);
      Tensor y = MakeEmpty(ops, to, {33, 65});
      ASSERT_TRUE(ops.Cast(x, &y).ok());
      for (int64_t i = 0; i < x.numel(); ++i) {
        ASSERT_EQ(LoadAsFloat(y, i), RoundTo(to, LoadAsFloat(x, i)))
            << ShortName(from) << "->" << ShortName(to) << " at " << i;
      }
    }
  }
}

TEST(CpuCastTest, RejectsFp8AndCountMismatch) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {4, 4}, 4);
  Tensor fp8 = MakeEmpty(ops, DType::kE4M3, {4, 4});
  absl::Status s = ops.Cast(x, &fp8);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("y"), absl::string_view::npos) << s;
  Tensor small = MakeEmpty(ops, DType::kF32, {15});
  EXPECT_EQ(ops.Cast(x, &small).code(), absl::StatusCode::kInvalidArgument);
}

// ---- Axpby ---------------------------------------------------------------------

class AxpbyTest : public ::testing::TestWithParam<std::tuple<DType, Shape>> {};

TEST_P(AxpbyTest, MatchesReference) {
  const auto [dtype, shape] = GetParam();
  CpuOps ops;
  Tensor a = MakeRandom(ops, dtype, shape, 5);
  Tensor b = MakeRandom(ops, dtype, shape, 6);
  Tensor y = MakeEmpty(ops, dtype, shape);
  const double alpha = 0.75, beta = -1.5;
  ASSERT_TRUE(ops.Axpby(alpha, a, beta, b, &y).ok());
  const std::vector<double> av = ToDoubles(a), bv = ToDoubles(b);
  std::vector<double> ref(av.size());
  for (size_t i = 0; i < av.size(); ++i) ref[i] = alpha * av[i] + beta * bv[i];
  EXPECT_LT(RelativeError(y, ref), Tolerance(dtype));

  // In place: y aliases a.
  ASSERT_TRUE(ops.Axpby(alpha, a, beta, b, &a).ok());
  EXPECT_LT(RelativeError(a, ref), Tolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(DTypesAndShapes, AxpbyTest,
                         ::testing::Combine(::testing::ValuesIn(kFloatDTypes),
                                            ::testing::ValuesIn(kShapes)));

TEST(CpuAxpbyTest, ZeroCoefficientTermIsNotRead) {
  CpuOps ops;
  Tensor a = MakeRandom(ops, DType::kF32, {3, 5}, 7);
  Tensor nan = MakeTensor(ops, DType::kF32, {3, 5}, std::vector<float>(15, NAN));
  Tensor y = MakeEmpty(ops, DType::kF32, {3, 5});
  ASSERT_TRUE(ops.Axpby(2.0f, a, 0.0f, nan, &y).ok());
  for (int64_t i = 0; i < 15; ++i) EXPECT_EQ(LoadAsFloat(y, i), 2.0f * LoadAsFloat(a, i));
  ASSERT_TRUE(ops.Axpby(2.0f, a, 0.0f, Tensor(), &y).ok());
  EXPECT_EQ(ops.Axpby(2.0f, a, 1.0f, Tensor(), &y).code(), absl::StatusCode::kInvalidArgument);
}

// ---- Permute -------------------------------------------------------------------

struct PermuteCase {
  Shape shape;
  std::vector<int> perm;
};

class PermuteTest : public ::testing::TestWithParam<std::tuple<DType, PermuteCase>> {};

TEST_P(PermuteTest, MovesEveryElementToItsPermutedIndex) {
  const auto [dtype, c] = GetParam();
  CpuOps ops;
  const int rank = static_cast<int>(c.shape.size());
  Tensor x = MakeRandom(ops, dtype, c.shape, 8);
  Shape y_shape(rank);
  for (int i = 0; i < rank; ++i) y_shape[i] = c.shape[c.perm[i]];
  Tensor y = MakeEmpty(ops, dtype, y_shape);
  ASSERT_TRUE(ops.Permute(x, c.perm, &y).ok());

  // Walk x's multi-index; y's index is x's, permuted: yi[i] = xi[perm[i]].
  std::vector<int64_t> xi(rank, 0);
  for (int64_t flat = 0; flat < x.numel(); ++flat) {
    int64_t rem = flat;
    for (int d = rank - 1; d >= 0; --d) {
      xi[d] = rem % c.shape[d];
      rem /= c.shape[d];
    }
    int64_t y_flat = 0;
    for (int i = 0; i < rank; ++i) y_flat = y_flat * y_shape[i] + xi[c.perm[i]];
    ASSERT_EQ(LoadAsFloat(y, y_flat), LoadAsFloat(x, flat)) << "x element " << flat;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Ranks, PermuteTest,
    ::testing::Combine(
        ::testing::Values(DType::kF32, DType::kBF16, DType::kE4M3),
        ::testing::Values(PermuteCase{{7, 13}, {1, 0}}, PermuteCase{{3, 5, 7}, {2, 0, 1}},
                          PermuteCase{{2, 3, 5, 7}, {0, 2, 1, 3}},
                          PermuteCase{{2, 3, 4, 5, 3}, {4, 2, 0, 3, 1}},
                          PermuteCase{{5}, {0}})));

TEST(CpuPermuteTest, RejectsBadPermutationAndShape) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {2, 3, 4}, 9);
  Tensor y = MakeEmpty(ops, DType::kF32, {4, 2, 3});
  EXPECT_TRUE(ops.Permute(x, {2, 0, 1}, &y).ok());
  EXPECT_EQ(ops.Permute(x, {2, 0, 0}, &y).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ops.Permute(x, {2, 0}, &y).code(), absl::StatusCode::kInvalidArgument);
  absl::Status s = ops.Permute(x, {0, 1, 2}, &y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[2, 3, 4]"), absl::string_view::npos) << s;
  Tensor x6 = MakeRandom(ops, DType::kF32, {1, 1, 1, 1, 1, 2}, 10);
  Tensor y6 = MakeEmpty(ops, DType::kF32, {1, 1, 1, 1, 1, 2});
  EXPECT_EQ(ops.Permute(x6, {0, 1, 2, 3, 4, 5}, &y6).code(), absl::StatusCode::kInvalidArgument);
}

// ---- SumRows -------------------------------------------------------------------

class SumRowsTest : public ::testing::TestWithParam<std::tuple<DType, Shape>> {};

TEST_P(SumRowsTest, MatchesReference) {
  const auto [dtype, shape] = GetParam();
  CpuOps ops;
  Tensor x = MakeRandom(ops, dtype, shape, 11);
  const int64_t n = shape[0], h = shape[1];
  Tensor y = MakeEmpty(ops, dtype, {h});
  ASSERT_TRUE(ops.SumRows(x, &y).ok());
  const std::vector<double> xv = ToDoubles(x);
  std::vector<double> ref(h, 0.0);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < h; ++c) ref[c] += xv[r * h + c];
  }
  EXPECT_LT(RelativeError(y, ref), Tolerance(dtype));
}

INSTANTIATE_TEST_SUITE_P(DTypesAndShapes, SumRowsTest,
                         ::testing::Combine(::testing::ValuesIn(kFloatDTypes),
                                            ::testing::ValuesIn(kShapes)));

TEST(CpuSumRowsTest, NamesTheWrongOutputShape) {
  CpuOps ops;
  Tensor x = MakeRandom(ops, DType::kF32, {7, 13}, 12);
  Tensor y = MakeEmpty(ops, DType::kF32, {7});
  absl::Status s = ops.SumRows(x, &y);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("[H=13]"), absl::string_view::npos) << s;
}

}  // namespace
}  // namespace te
