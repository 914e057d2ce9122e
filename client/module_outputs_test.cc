// InferModuleOutputs lists every LayerSpec module: each gives its outputs'
// shapes and dtype, as the server's graph inference does.
#include "client/module_outputs.h"

#include "gtest/gtest.h"

namespace te::client {
namespace {

te::v1::LayerSpec Embed(te::v1::DType dtype, te::v1::DType param_dtype) {
  te::v1::LayerSpec spec;
  te::v1::FlaxEmbed* e = spec.mutable_flax_embed();
  e->set_num_embeddings(50);
  e->set_features(16);
  e->set_dtype(dtype);
  e->set_param_dtype(param_dtype);
  return spec;
}

// nn.Embed: ids [2, 7] -> [2, 7, features], in dtype, else param_dtype
// (float32 unset); the ids' int32 plays no part.
TEST(ModuleOutputsTest, EmbedAppendsFeaturesInItsOwnDType) {
  absl::StatusOr<ModuleOutputs> out =
      InferModuleOutputs(Embed(te::v1::DTYPE_UNSPECIFIED, te::v1::DTYPE_UNSPECIFIED), {{2, 7}}, DType::kI32);
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->shapes.size(), 1u);
  EXPECT_EQ(out->shapes[0], (Shape{2, 7, 16}));
  EXPECT_EQ(out->dtype, DType::kF32);

  out = InferModuleOutputs(Embed(te::v1::DTYPE_UNSPECIFIED, te::v1::BFLOAT16), {{2, 7}}, DType::kI32);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->dtype, DType::kBF16);

  out = InferModuleOutputs(Embed(te::v1::FLOAT16, te::v1::BFLOAT16), {{3}}, DType::kI32);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->shapes[0], (Shape{3, 16}));
  EXPECT_EQ(out->dtype, DType::kF16);
}

TEST(ModuleOutputsTest, EmbedOfFloatIdsIsRefused) {
  const absl::Status status =
      InferModuleOutputs(Embed(te::v1::DTYPE_UNSPECIFIED, te::v1::DTYPE_UNSPECIFIED), {{2, 7}}, DType::kF32)
          .status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("flax_embed"), absl::string_view::npos) << status;
}

}  // namespace
}  // namespace te::client
