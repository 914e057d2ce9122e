// Tensor views and dtype metadata.
#include "kernels/tensor.h"

#include <memory>

#include "gtest/gtest.h"

namespace te {
namespace {

TEST(DTypeTest, SizesNamesAndKinds) {
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kE4M3), 1u);
  EXPECT_EQ(DTypeSize(DType::kE5M2), 1u);
  EXPECT_EQ(DTypeSize(DType::kI32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBool), 1u);
  EXPECT_STREQ(DTypeName(DType::kBF16), "bfloat16");
  EXPECT_STREQ(DTypeName(DType::kE4M3), "float8_e4m3fn");
  EXPECT_TRUE(IsFloat8(DType::kE5M2));
  EXPECT_FALSE(IsFloat8(DType::kF16));
  EXPECT_TRUE(IsFloating(DType::kE4M3));
  EXPECT_FALSE(IsFloating(DType::kI32));
  EXPECT_FALSE(IsFloating(DType::kBool));
}

TEST(ShapeTest, CountsAndPrints) {
  EXPECT_EQ(NumElements({4, 2048, 4096}), 4 * 2048 * 4096);
  EXPECT_EQ(NumElements({}), 1);  // a scalar
  EXPECT_EQ(NumElements({3, 0, 5}), 0);
  EXPECT_EQ(ShapeString({4, 2048, 4096}), "[4, 2048, 4096]");
  EXPECT_EQ(ShapeString({}), "[]");
}

class TensorViewTest : public ::testing::Test {
 protected:
  // 2 x 3 x 4 floats 0..23.
  void SetUp() override {
    storage_ = std::shared_ptr<float>(new float[24], std::default_delete<float[]>());
    for (int i = 0; i < 24; ++i) storage_.get()[i] = static_cast<float>(i);
    tensor_ = Tensor(storage_, storage_.get(), DType::kF32, {2, 3, 4});
  }
  std::shared_ptr<float> storage_;
  Tensor tensor_;
};

TEST_F(TensorViewTest, Metadata) {
  EXPECT_TRUE(tensor_.defined());
  EXPECT_EQ(tensor_.rank(), 3);
  EXPECT_EQ(tensor_.dim(0), 2);
  EXPECT_EQ(tensor_.dim(-1), 4);
  EXPECT_EQ(tensor_.numel(), 24);
  EXPECT_EQ(tensor_.nbytes(), 96u);
  EXPECT_FALSE(Tensor().defined());
}

TEST_F(TensorViewTest, ReshapedSharesStorage) {
  Tensor flat = tensor_.Reshaped({24});
  EXPECT_EQ(flat.data(), tensor_.data());
  flat.data_as<float>()[5] = -1.0f;
  EXPECT_EQ(tensor_.data_as<float>()[5], -1.0f);
}

TEST_F(TensorViewTest, Slice0PointsAtTheRows) {
  Tensor second = tensor_.Slice0(1, 2);
  EXPECT_EQ(second.shape(), (Shape{1, 3, 4}));
  EXPECT_EQ(second.data_as<float>()[0], 12.0f);
  Tensor rows = tensor_.As2D().Slice0(2, 5);
  EXPECT_EQ(rows.shape(), (Shape{3, 4}));
  EXPECT_EQ(rows.data_as<float>()[0], 8.0f);
}

TEST_F(TensorViewTest, As2DFlattensLeadingDims) {
  EXPECT_EQ(tensor_.As2D().shape(), (Shape{6, 4}));
}

TEST_F(TensorViewTest, ViewsKeepStorageAlive) {
  std::weak_ptr<float> watch = storage_;
  Tensor view = tensor_.Slice0(1, 2);
  storage_.reset();
  tensor_ = Tensor();
  EXPECT_FALSE(watch.expired());
  EXPECT_EQ(view.data_as<float>()[1], 13.0f);
  view = Tensor();
  EXPECT_TRUE(watch.expired());
}

}  // namespace
}  // namespace te
