#include "server/session/tensor_codec.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace te::session {
namespace {

constexpr int64_t kMaxBytes = 1 << 20;

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(rng() & 0xff);
  return s;
}

te::v1::Tensor InlineTensor(te::v1::DType dtype, std::vector<int64_t> shape, std::string bytes) {
  te::v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  t.set_inline_data(std::move(bytes));
  return t;
}

class TensorCodecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto device = OpenCpuDevice();
    ASSERT_TRUE(device.ok()) << device.status();
    device_ = *std::move(device);
    auto ops = device_->NewOps(64 << 20);
    ASSERT_TRUE(ops.ok()) << ops.status();
    ops_ = *std::move(ops);
  }

  ResidentLookup Lookup() {
    return [this](const std::string& id) -> const Tensor* {
      auto it = resident_.find(id);
      return it == resident_.end() ? nullptr : &it->second;
    };
  }

  // Expects INVALID_ARGUMENT whose message starts with `field`.
  void ExpectInvalid(const te::v1::Tensor& proto, const std::string& field) {
    auto checked = CheckTensor(proto, "micro_batches[1].dy", kMaxBytes, Lookup());
    ASSERT_EQ(checked.status().code(), absl::StatusCode::kInvalidArgument) << checked.status();
    EXPECT_EQ(checked.status().message().substr(0, field.size()), field) << checked.status();
  }

  std::unique_ptr<Device> device_;
  std::unique_ptr<Ops> ops_;
  std::map<std::string, Tensor> resident_;
};

TEST_F(TensorCodecTest, RoundTripsEveryDType) {
  const te::v1::DType dtypes[] = {te::v1::FLOAT32,     te::v1::BFLOAT16,    te::v1::FLOAT16,
                                  te::v1::FLOAT8_E4M3, te::v1::FLOAT8_E5M2, te::v1::INT32,
                                  te::v1::BOOL};
  uint32_t seed = 1;
  for (te::v1::DType dtype : dtypes) {
    SCOPED_TRACE(te::v1::DType_Name(dtype));
    auto dt = DTypeFromProto(dtype, "x.dtype");
    ASSERT_TRUE(dt.ok());
    const std::vector<int64_t> shape = {3, 5, 7};
    const std::string bytes = RandomBytes(3 * 5 * 7 * DTypeSize(*dt), seed++);
    const te::v1::Tensor proto = InlineTensor(dtype, shape, bytes);
    auto checked = CheckTensor(proto, "x", kMaxBytes, Lookup());
    ASSERT_TRUE(checked.ok()) << checked.status();
    auto tensor = Materialize(*ops_, *checked);
    ASSERT_TRUE(tensor.ok()) << tensor.status();
    EXPECT_EQ(tensor->shape(), Shape(shape.begin(), shape.end()));
    te::v1::Tensor back;
    ASSERT_TRUE(EncodeInline(*ops_, *tensor, &back).ok());
    EXPECT_EQ(back.dtype(), dtype);
    EXPECT_EQ(back.inline_data(), bytes);
    EXPECT_EQ(std::vector<int64_t>(back.shape().begin(), back.shape().end()), shape);
  }
}

TEST_F(TensorCodecTest, NaNAndInfAreAccepted) {
  std::vector<float> values = {1.5f, std::numeric_limits<float>::quiet_NaN(),
                               -std::numeric_limits<float>::infinity(), -2.25f};
  std::string bytes(values.size() * 4, '\0');
  std::memcpy(bytes.data(), values.data(), bytes.size());
  const te::v1::Tensor proto = InlineTensor(te::v1::FLOAT32, {2, 2}, bytes);
  auto checked = CheckTensor(proto, "x", kMaxBytes, Lookup());
  ASSERT_TRUE(checked.ok()) << checked.status();
  auto tensor = Materialize(*ops_, *checked);
  ASSERT_TRUE(tensor.ok());
  std::vector<float> back(4);
  ASSERT_TRUE(ops_->Download(*tensor, back.data()).ok());
  EXPECT_TRUE(std::isnan(back[1]));
  EXPECT_EQ(back[3], -2.25f);
}

TEST_F(TensorCodecTest, RejectsUnspecifiedAndUnknownDTypes) {
  ExpectInvalid(InlineTensor(te::v1::DTYPE_UNSPECIFIED, {2}, "12345678"),
                "micro_batches[1].dy.dtype");
  ExpectInvalid(InlineTensor(static_cast<te::v1::DType>(42), {2}, "12345678"),
                "micro_batches[1].dy.dtype");
}

TEST_F(TensorCodecTest, RejectsNegativeDims) {
  ExpectInvalid(InlineTensor(te::v1::FLOAT32, {2, -3}, ""), "micro_batches[1].dy.shape[1]");
}

TEST_F(TensorCodecTest, RejectsHugeAndOverflowingShapes) {
  // Over the per-tensor limit.
  ExpectInvalid(InlineTensor(te::v1::FLOAT32, {1024, 1024}, ""), "micro_batches[1].dy.shape");
  // A product that wraps around int64 to a small number must not pass.
  ExpectInvalid(InlineTensor(te::v1::FLOAT32, {int64_t{1} << 32, int64_t{1} << 32, 4}, ""),
                "micro_batches[1].dy.shape");
  ExpectInvalid(InlineTensor(te::v1::BOOL, {INT64_MAX, 2}, ""), "micro_batches[1].dy.shape");
}

TEST_F(TensorCodecTest, AcceptsEmptyTensors) {
  const te::v1::Tensor proto = InlineTensor(te::v1::FLOAT32, {0, 4}, "");
  auto checked = CheckTensor(proto, "x", kMaxBytes, Lookup());
  ASSERT_TRUE(checked.ok()) << checked.status();
  auto tensor = Materialize(*ops_, *checked);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  EXPECT_EQ(tensor->numel(), 0);
}

TEST_F(TensorCodecTest, RejectsInlineBytesOfTheWrongLength) {
  ExpectInvalid(InlineTensor(te::v1::BFLOAT16, {2, 3}, RandomBytes(11, 3)),
                "micro_batches[1].dy.inline_data");
  ExpectInvalid(InlineTensor(te::v1::BFLOAT16, {2, 3}, RandomBytes(13, 3)),
                "micro_batches[1].dy.inline_data");
}

TEST_F(TensorCodecTest, RejectsMissingData) {
  te::v1::Tensor t;
  t.set_dtype(te::v1::FLOAT32);
  t.add_shape(2);
  ExpectInvalid(t, "micro_batches[1].dy");
}

TEST_F(TensorCodecTest, SharedMemoryWithoutTheFlagIsFailedPrecondition) {
  te::v1::Tensor t;
  t.set_dtype(te::v1::FLOAT32);
  t.add_shape(2);
  t.mutable_shm()->set_region_id("r");
  auto checked = CheckTensor(t, "x", kMaxBytes, Lookup());
  EXPECT_EQ(checked.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(checked.status().message().find("shared memory disabled (--enable_shm)"),
            std::string::npos)
      << checked.status();
}

// A client's shm object of `size` bytes, mapped by the server side as region "region-1".
class SharedMemoryTest : public TensorCodecTest {
 protected:
  void SetUp() override {
    TensorCodecTest::SetUp();
    name_ = "/te_tensor_codec_test_" + std::to_string(getpid());
    const int fd = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, 4096), 0);
    close(fd);
    auto region = ShmRegion::Open(name_, 4096);
    ASSERT_TRUE(region.ok()) << region.status();
    region_ = *std::move(region);
  }
  void TearDown() override { shm_unlink(name_.c_str()); }
  ShmLookup Regions() {
    return [this](const std::string& id) { return id == "region-1" ? region_.get() : nullptr; };
  }
  te::v1::Tensor ShmTensor(std::vector<int64_t> shape, uint64_t offset, std::string id = "region-1") {
    te::v1::Tensor t;
    t.set_dtype(te::v1::FLOAT32);
    for (int64_t d : shape) t.add_shape(d);
    t.mutable_shm()->set_region_id(id);
    t.mutable_shm()->set_offset(offset);
    return t;
  }
  std::string name_;
  std::unique_ptr<ShmRegion> region_;
};

TEST_F(SharedMemoryTest, MaterializeCopiesTheRegionsBytes) {
  const std::string bytes = RandomBytes(4 * 100, 7);
  ASSERT_TRUE(region_->Write(1000, bytes.data(), bytes.size()).ok());
  const te::v1::Tensor t = ShmTensor({10, 10}, 1000);
  auto checked = CheckTensor(t, "x", kMaxBytes, Lookup(), Regions());
  ASSERT_TRUE(checked.ok()) << checked.status();
  auto tensor = Materialize(*ops_, *checked);
  ASSERT_TRUE(tensor.ok()) << tensor.status();
  std::string got(tensor->nbytes(), '\0');
  ASSERT_TRUE(ops_->Download(*tensor, got.data()).ok());
  EXPECT_EQ(got, bytes);
  // A copy: the client may reuse its region at once.
  const std::string other = RandomBytes(4 * 100, 8);
  ASSERT_TRUE(region_->Write(1000, other.data(), other.size()).ok());
  ASSERT_TRUE(ops_->Download(*tensor, got.data()).ok());
  EXPECT_EQ(got, bytes);
  auto host = HostBytes(*ops_, *checked);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(*host, other);
}

TEST_F(SharedMemoryTest, WriteToRegionPutsTheTensorAtTheOffset) {
  auto tensor = ops_->Allocate(DType::kF32, {16});
  ASSERT_TRUE(tensor.ok());
  const std::string bytes = RandomBytes(64, 9);
  ASSERT_TRUE(ops_->Upload(bytes.data(), &*tensor).ok());
  ASSERT_TRUE(WriteToRegion(*ops_, *tensor, *region_, 4032).ok());
  std::string got(64, '\0');
  ASSERT_TRUE(region_->Read(4032, got.data(), got.size()).ok());
  EXPECT_EQ(got, bytes);
}

TEST_F(SharedMemoryTest, UnknownRegionAndRangePastTheEndAreInvalid) {
  auto unknown = CheckTensor(ShmTensor({4}, 0, "region-2"), "micro_batches[0].x", kMaxBytes,
                             Lookup(), Regions());
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("micro_batches[0].x.shm.region_id"),
            std::string::npos)
      << unknown.status();
  auto past = CheckTensor(ShmTensor({4}, 4096 - 15), "x", kMaxBytes, Lookup(), Regions());
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(past.status().message().find("x.shm: 16 bytes at offset 4081"), std::string::npos)
      << past.status();
  EXPECT_TRUE(CheckTensor(ShmTensor({4}, 4096 - 16), "x", kMaxBytes, Lookup(), Regions()).ok());
  auto no_dtype = ShmTensor({4}, 0);
  no_dtype.clear_dtype();
  EXPECT_EQ(CheckTensor(no_dtype, "x", kMaxBytes, Lookup(), Regions()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(TensorCodecTest, ResidentTensors) {
  auto stored = ops_->Allocate(DType::kBF16, {4, 6});
  ASSERT_TRUE(stored.ok());
  const std::string bytes = RandomBytes(48, 7);
  ASSERT_TRUE(ops_->Upload(bytes.data(), &*stored).ok());
  resident_["tensor-1"] = *stored;

  te::v1::Tensor ref;
  ref.set_resident_id("tensor-1");
  auto checked = CheckTensor(ref, "x", kMaxBytes, Lookup());
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_EQ(checked->dtype, DType::kBF16);
  auto tensor = Materialize(*ops_, *checked);
  ASSERT_TRUE(tensor.ok());
  EXPECT_EQ(tensor->data(), stored->data());  // shared, not copied
  auto host = HostBytes(*ops_, *checked);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(*host, bytes);

  // Matching dtype and shape given explicitly.
  ref.set_dtype(te::v1::BFLOAT16);
  ref.add_shape(4);
  ref.add_shape(6);
  EXPECT_TRUE(CheckTensor(ref, "x", kMaxBytes, Lookup()).ok());

  te::v1::Tensor unknown;
  unknown.set_resident_id("tensor-2");
  ExpectInvalid(unknown, "micro_batches[1].dy.resident_id");

  te::v1::Tensor wrong_dtype = ref;
  wrong_dtype.set_dtype(te::v1::FLOAT32);
  ExpectInvalid(wrong_dtype, "micro_batches[1].dy.dtype");

  te::v1::Tensor wrong_shape = ref;
  wrong_shape.set_shape(1, 7);
  ExpectInvalid(wrong_shape, "micro_batches[1].dy.shape");
}

TEST(DTypeTest, ProtoRoundTrip) {
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16, DType::kE4M3, DType::kE5M2,
                   DType::kI32, DType::kBool}) {
    auto back = DTypeFromProto(DTypeToProto(dt), "dtype");
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, dt);
  }
}

// A padding mask for the given lengths: true (1) = masked out.
std::string PaddingMask(const std::vector<int>& q, const std::vector<int>& kv, int sq, int skv) {
  std::string m;
  for (size_t b = 0; b < q.size(); ++b) {
    for (int i = 0; i < sq; ++i) {
      for (int j = 0; j < skv; ++j) m.push_back((i < q[b] && j < kv[b]) ? 0 : 1);
    }
  }
  return m;
}

// The mask with the causal triangle (j > i) masked too, as TE's tests build
// a padding_causal mask (tests/jax/test_layer.py: jnp.triu(ones, k=1)).
std::string WithCausal(std::string m, int batch, int sq, int skv) {
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < sq; ++i) {
      for (int j = i + 1; j < skv; ++j) m[(b * sq + i) * skv + j] = 1;
    }
  }
  return m;
}

std::vector<int> Ints(const std::vector<int32_t>& v) { return std::vector<int>(v.begin(), v.end()); }

TEST(DecodeAttentionMaskTest, APaddingPatternBecomesLengths) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 20; ++trial) {
    const int batch = 1 + rng() % 4, sq = 1 + rng() % 9, skv = 1 + rng() % 9;
    std::vector<int> q, kv;
    for (int b = 0; b < batch; ++b) {
      q.push_back(1 + rng() % sq);
      kv.push_back(1 + rng() % skv);
    }
    auto m = DecodeAttentionMask(PaddingMask(q, kv, sq, skv), DType::kBool, {batch, 1, sq, skv},
                                 batch, sq, skv, "attention_mask");
    ASSERT_TRUE(m.ok()) << m.status();
    ASSERT_TRUE(m->seqlens.has_value());
    EXPECT_FALSE(m->with_causal);
    EXPECT_EQ(Ints(m->seqlens->q), q);
    EXPECT_EQ(Ints(m->seqlens->kv), kv);
    EXPECT_TRUE(m->elementwise.empty());  // the lengths say it all
  }
}

// TE's tests hand a causal or padding_causal layer jnp.triu(ones, k=1) as
// uint8 (tests/jax/test_layer.py, EncoderRunner.generate_inputs): accepted
// (today's server refused it as "not a padding mask"), as padding | causal
// lengths for the fast path and elementwise for a padding layer.
TEST(DecodeAttentionMaskTest, ACausalTriangleIsPaddingCausalLengthsAndElementwise) {
  const std::string triu = WithCausal(PaddingMask({4, 4}, {4, 4}, 4, 4), 2, 4, 4);
  auto m = DecodeAttentionMask(triu, DType::kBool, {2, 1, 4, 4}, 2, 4, 4, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->seqlens.has_value());
  EXPECT_TRUE(m->with_causal);
  EXPECT_EQ(Ints(m->seqlens->q), std::vector<int>({4, 4}));
  EXPECT_EQ(Ints(m->seqlens->kv), std::vector<int>({4, 4}));
  EXPECT_EQ(m->elementwise, triu);

  // Padding combined with causality (TE's padding_causal masks), per batch row.
  const std::string pc = WithCausal(PaddingMask({3, 2}, {4, 2}, 5, 6), 2, 5, 6);
  m = DecodeAttentionMask(pc, DType::kBool, {2, 1, 5, 6}, 2, 5, 6, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->seqlens.has_value());
  EXPECT_TRUE(m->with_causal);
  EXPECT_EQ(Ints(m->seqlens->q), std::vector<int>({3, 2}));
  // Keys past the last valid query's diagonal are masked in every row either way.
  EXPECT_EQ(Ints(m->seqlens->kv), std::vector<int>({3, 2}));
}

TEST(DecodeAttentionMaskTest, AnArbitraryMaskIsElementwise) {
  // TE's unfused softmax applies any mask elementwise (transformer.py,
  // _UnfusedDotProductAttention: SCALED_MASKED with the mask as given).
  std::string holed = PaddingMask({3}, {3}, 4, 4);
  holed[1 * 4 + 1] = 1;
  auto m = DecodeAttentionMask(holed, DType::kBool, {1, 1, 4, 4}, 1, 4, 4, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->seqlens.has_value());
  EXPECT_EQ(m->elementwise, holed);
}

TEST(DecodeAttentionMaskTest, AFullyMaskedBatchHasLengthZero) {
  auto m =
      DecodeAttentionMask(std::string(2 * 3 * 3, 1), DType::kBool, {2, 1, 3, 3}, 2, 3, 3, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->seqlens.has_value());
  EXPECT_EQ(m->seqlens->q, std::vector<int32_t>({0, 0}));
}

// Masks in int32 and float dtypes: nonzero = masked out, as TE reads them
// (attention.py: jnp.logical_not(mask); module.py Softmax: mask > 0). -0.0 is
// zero.
TEST(DecodeAttentionMaskTest, IntAndFloatDtypesReadNonzeroAsMasked) {
  const std::string want = PaddingMask({2}, {3}, 3, 4);
  std::string i32, f32, bf16;
  for (char c : want) {
    const int32_t iv = c ? 7 : 0;
    const float fv = c ? 1.0f : -0.0f;
    const uint16_t bv = c ? 0x3f80 : 0x8000;  // bf16 1.0, -0.0
    i32.append(reinterpret_cast<const char*>(&iv), 4);
    f32.append(reinterpret_cast<const char*>(&fv), 4);
    bf16.append(reinterpret_cast<const char*>(&bv), 2);
  }
  for (const auto& [dtype, bytes] : {std::pair<DType, std::string>{DType::kI32, i32},
                                     {DType::kF32, f32}, {DType::kBF16, bf16}}) {
    auto m = DecodeAttentionMask(bytes, dtype, {1, 1, 3, 4}, 1, 3, 4, "m");
    ASSERT_TRUE(m.ok()) << DTypeName(dtype) << ": " << m.status();
    ASSERT_TRUE(m->seqlens.has_value()) << DTypeName(dtype);
    EXPECT_EQ(Ints(m->seqlens->q), std::vector<int>({2})) << DTypeName(dtype);
    EXPECT_EQ(Ints(m->seqlens->kv), std::vector<int>({3})) << DTypeName(dtype);
  }
}

// A [1, 1, Sq, Skv] mask broadcasts over the batch, as it does against TE's
// [b, h, q, k] logits.
TEST(DecodeAttentionMaskTest, BatchOneBroadcasts) {
  std::string holed = PaddingMask({3}, {3}, 3, 3);
  holed[4] = 1;
  auto m = DecodeAttentionMask(holed, DType::kBool, {1, 1, 3, 3}, 2, 3, 3, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->elementwise, holed + holed);
}

TEST(DecodeAttentionMaskTest, RejectsWhatDoesNotBroadcastNamingTheField) {
  const std::string mask = PaddingMask({2}, {2}, 3, 3);
  // Logits [2, heads, 3, 3]: rank 3, a batch of 3, 2 queries, 0 heads.
  for (const Shape& shape : {Shape{1, 3, 3}, Shape{3, 1, 3, 3}, Shape{1, 1, 2, 3},
                             Shape{1, 0, 3, 3}, Shape{1, 1, 1, 3, 3}}) {
    auto m = DecodeAttentionMask(mask, DType::kBool, shape, 2, 3, 3,
                                 "micro_batches[0].attention_mask");
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << ShapeString(shape);
    EXPECT_EQ(m.status().message().rfind("micro_batches[0].attention_mask.shape", 0), 0u)
        << m.status();
    // The message says what TE takes.
    EXPECT_NE(m.status().message().find("[2 or 1, heads or 1, 3 or 1, 3 or 1]"),
              std::string::npos)
        << m.status();
  }
  EXPECT_EQ(DecodeAttentionMask(mask.substr(1), DType::kBool, {1, 1, 3, 3}, 1, 3, 3, "m")
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeAttentionMask(mask, DType::kI32, {1, 1, 3, 3}, 1, 3, 3, "m").status().code(),
            absl::StatusCode::kInvalidArgument);  // 9 bytes are not 9 int32
}

// TE broadcasts the mask against its logits [b, h, q, k]: a dim of 1 stands
// for all of it, the query dim too ([B, 1, 1, Skv], a key padding mask).
TEST(DecodeAttentionMaskTest, DimsOfOneBroadcast) {
  // Keys 2 and 3 masked for batch 0, key 3 for batch 1, for every query.
  const std::string keys = {0, 0, 1, 1, 0, 0, 0, 1};
  auto m = DecodeAttentionMask(keys, DType::kBool, {2, 1, 1, 4}, 2, 3, 4, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_TRUE(m->seqlens.has_value());  // exactly padding: lengths (3, 2) and (3, 3)
  EXPECT_EQ(Ints(m->seqlens->q), std::vector<int>({3, 3}));
  EXPECT_EQ(Ints(m->seqlens->kv), std::vector<int>({2, 3}));
  // A query mask [1, 1, Sq, 1]: query 1 sees nothing (an arbitrary mask).
  m = DecodeAttentionMask(std::string({0, 1, 0}), DType::kBool, {1, 1, 3, 1}, 2, 3, 2, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->seqlens.has_value());
  EXPECT_EQ(m->elementwise, std::string({0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0}));
  EXPECT_EQ(Ints(m->extents.q), std::vector<int>({3, 3}));
  EXPECT_EQ(Ints(m->extents.kv), std::vector<int>({2, 2}));
}

// A per-head mask [B, H, Sq, Skv] stays per head (TE's unfused softmax
// broadcasts it against the logits); one whose heads are all alike is a
// shared mask, and then may be a padding pattern.
TEST(DecodeAttentionMaskTest, PerHeadMasksKeepTheirHeads) {
  const std::string head0 = PaddingMask({3}, {2}, 3, 3), head1 = PaddingMask({2}, {3}, 3, 3);
  auto m = DecodeAttentionMask(head0 + head1, DType::kBool, {1, 2, 3, 3}, 2, 3, 3, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->heads, 2);
  EXPECT_FALSE(m->seqlens.has_value());
  EXPECT_EQ(m->elementwise, head0 + head1 + head0 + head1);  // [2, 2, 3, 3]
  // The extents span every head: queries 3, keys 3.
  EXPECT_EQ(Ints(m->extents.q), std::vector<int>({3, 3}));
  EXPECT_EQ(Ints(m->extents.kv), std::vector<int>({3, 3}));

  m = DecodeAttentionMask(head0 + head0 + head0, DType::kBool, {1, 3, 3, 3}, 2, 3, 3, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->heads, 1);
  EXPECT_EQ(m->given_heads, 3);  // for the layer to check against its own
  ASSERT_TRUE(m->seqlens.has_value());
  EXPECT_EQ(Ints(m->seqlens->kv), std::vector<int>({2, 2}));
  EXPECT_TRUE(m->elementwise.empty());
}

// An arbitrary mask still has extents: the actual lengths TE's
// padding_causal_bottom_right aligns its diagonal with.
TEST(DecodeAttentionMaskTest, AnArbitraryMaskHasExtents) {
  std::string holed = PaddingMask({3}, {2}, 4, 4);
  holed[0] = 1;  // query 0 loses key 0: not a padding pattern
  auto m = DecodeAttentionMask(holed, DType::kBool, {1, 1, 4, 4}, 1, 4, 4, "m");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->seqlens.has_value());
  EXPECT_EQ(Ints(m->extents.q), std::vector<int>({3}));
  EXPECT_EQ(Ints(m->extents.kv), std::vector<int>({2}));
}

}  // namespace
}  // namespace te::session
