// kernels/broadcast.h: the merged index geometry both backends walk, and the
// argument checks' messages.
#include "kernels/broadcast.h"

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace te {
namespace {

std::vector<int64_t> Dims(const BroadcastGeometry& g) { return {g.dims, g.dims + g.rank}; }
std::vector<int64_t> Strides(const BroadcastGeometry& g, int k) {
  return {g.strides[k], g.strides[k] + g.rank};
}

TEST(BroadcastTest, NeighbouringDimsThatBroadcastAlikeMerge) {
  const Shape out = {2, 3, 4, 5}, a = {2, 3, 4, 5}, b = {4, 5};
  const absl::StatusOr<BroadcastGeometry> g = BroadcastTo("Op", out, "y", {&a, &b}, {"a", "b"});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(Dims(*g), (std::vector<int64_t>{6, 20}));
  EXPECT_EQ(Strides(*g, 0), (std::vector<int64_t>{20, 1}));
  EXPECT_EQ(Strides(*g, 1), (std::vector<int64_t>{0, 1}));
  // Every element's offsets against the unmerged rule.
  for (int64_t i = 0; i < 120; ++i) {
    int64_t off[2];
    BroadcastOffsets<2>(*g, i, off);
    EXPECT_EQ(off[0], i);
    EXPECT_EQ(off[1], i % 20);
  }
}

TEST(BroadcastTest, OutputDimsOfOneAndConstantsDrop) {
  const Shape out = {1, 3, 1, 4}, a = {3, 1, 1}, b = {1, 1, 4};
  const absl::StatusOr<BroadcastGeometry> g =
      BroadcastTo("Op", out, "y", {&a, nullptr, &b}, {"a", "s", "b"});
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(Dims(*g), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(Strides(*g, 0), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(Strides(*g, 1), (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(Strides(*g, 2), (std::vector<int64_t>{0, 1}));
}

TEST(BroadcastTest, ErrorsNameTheOperand) {
  const Shape out = {2, 3}, bad = {4, 3};
  EXPECT_EQ(BroadcastTo("Binary", out, "y", {&bad}, {"b"}).status().message(),
            "Binary: b has shape [4, 3], which does not broadcast to y [2, 3]");
  const Shape longer = {2, 2, 3};
  EXPECT_FALSE(BroadcastTo("Binary", out, "y", {&longer}, {"a"}).ok());
  // Nine dims that alternate between repeated and not cannot merge.
  const Shape nine(9, 2);
  Shape alternating;
  for (int d = 0; d < 9; ++d) alternating.push_back(d % 2 == 0 ? 2 : 1);
  const absl::Status s = BroadcastTo("Binary", nine, "y", {&alternating}, {"a"}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("more than 8 dims"), std::string::npos) << s;
}

// A float32 tensor in host memory (the checks only read shapes and dtypes).
Tensor HostTensor(const Shape& shape, DType dtype = DType::kF32) {
  auto storage = std::shared_ptr<void>(new float[NumElements(shape) + 1](),
                                       [](void* p) { delete[] static_cast<float*>(p); });
  return Tensor(storage, storage.get(), dtype, shape);
}

TEST(BroadcastTest, ReduceGeometryMergesKeptAndReducedDims) {
  const Tensor x = HostTensor({2, 3, 4, 5});
  Tensor y = HostTensor({2, 1, 1, 5});
  const absl::StatusOr<ReduceGeometry> g = CheckReduceArgs(ReduceOp::kSum, x, &y);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->out_rank, 2);
  EXPECT_EQ(g->red_rank, 1);  // dims 1 and 2 together
  EXPECT_EQ(g->red_dims[0], 12);
  EXPECT_EQ(g->red_strides[0], 5);
  EXPECT_EQ(g->outputs, 10);
  EXPECT_EQ(g->reduced, 12);
  Tensor wrong = HostTensor({2, 3, 5});
  EXPECT_EQ(CheckReduceArgs(ReduceOp::kSum, x, &wrong).status().message(),
            "Reduce: y has shape [2, 3, 5], want x's [2, 3, 4, 5] with the reduced dims 1");
}

TEST(BroadcastTest, SliceBoundsAreChecked) {
  const Tensor x = HostTensor({5, 6});
  Tensor y = HostTensor({2, 3});
  const absl::StatusOr<SliceGeometry> g = CheckSliceArgs("Slice", x, {1, 0}, {3, 2}, &y, false);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->x_offset, 6);
  EXPECT_EQ(g->x_strides[0], 18);
  EXPECT_EQ(g->x_strides[1], 2);
  // Rows 1, 4, 7: past the end.
  Tensor three = HostTensor({3, 3});
  EXPECT_EQ(CheckSliceArgs("Slice", x, {1, 0}, {3, 2}, &three, false).status().message(),
            "Slice: dim 0: 3 elements from 1 by 3 do not fit x [5, 6]");
}

}  // namespace
}  // namespace te
