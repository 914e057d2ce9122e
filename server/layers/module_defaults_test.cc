// The server's defaults for unset te.v1 fields are TE's: for every TE module,
// a spec with its optional fields unset behaves exactly as the same spec with
// every field set to the value in tests/data/te_module_defaults.json (the
// one table of TE's defaults, read in TE's current module.py and
// transformer.py): the same variables, the same initial values, and the
// same y with dropout active (so a dropout rate default counts too). And
// every field of each module message is in the table, so none is left out.
#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "server/layers/layer.h"
#include "server/layers/testing.h"
#include "tests/module_defaults_table.h"

namespace te::layers {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using nlohmann::json;
using testing::NewCpuOps;
using testing::RandomTensor;
using testing::Values;

// Sets `field` of `m` to the table's `value` (null: leave unset, TE's None).
void Set(Message* m, const FieldDescriptor* field, const json& value) {
  if (value.is_null()) return;
  const auto* r = m->GetReflection();
  if (field->is_repeated()) {
    const json list = value.is_array() ? value : json::array({value});
    for (const json& v : list) {
      switch (field->cpp_type()) {
        case FieldDescriptor::CPPTYPE_STRING: r->AddString(m, field, v.get<std::string>()); break;
        case FieldDescriptor::CPPTYPE_INT32: r->AddInt32(m, field, v.get<int32_t>()); break;
        case FieldDescriptor::CPPTYPE_INT64: r->AddInt64(m, field, v.get<int64_t>()); break;
        default: ADD_FAILURE() << field->full_name() << ": repeated type not handled";
      }
    }
    return;
  }
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_BOOL: r->SetBool(m, field, value.get<bool>()); break;
    case FieldDescriptor::CPPTYPE_FLOAT: r->SetFloat(m, field, value.get<float>()); break;
    case FieldDescriptor::CPPTYPE_INT32: r->SetInt32(m, field, value.get<int32_t>()); break;
    case FieldDescriptor::CPPTYPE_INT64: r->SetInt64(m, field, value.get<int64_t>()); break;
    case FieldDescriptor::CPPTYPE_ENUM: {
      // TE's strings as te.v1's enum names: "causal" -> CAUSAL, dtype
      // "float32" -> PARAM_FLOAT32.
      std::string name = absl::AsciiStrToUpper(value.get<std::string>());
      if (field->name() == "dtype") name = "PARAM_" + name;
      const auto* e = field->enum_type()->FindValueByName(name);
      ASSERT_NE(e, nullptr) << field->full_name() << ": no enum value " << name;
      r->SetEnum(m, field, e);
      break;
    }
    default: ADD_FAILURE() << field->full_name() << ": type not handled";
  }
}

struct Case {
  std::string module;      // the table's name (TE's class)
  std::string spec_field;  // LayerSpec's oneof field
  te::v1::LayerSpec required;  // the fields TE requires, nothing else
  Shape x_shape;
  int extra_inputs = 0;  // DotProductAttention: k and v
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  {
    Case c{"LayerNorm", "layer_norm", {}, {2, 3, 16}};
    c.required.mutable_layer_norm();
    cases.push_back(c);
  }
  {
    Case c{"DenseGeneral", "dense_general", {}, {2, 3, 16}};
    c.required.mutable_dense_general()->add_features(8);
    cases.push_back(c);
  }
  {
    Case c{"LayerNormDenseGeneral", "layer_norm_dense_general", {}, {2, 3, 16}};
    c.required.mutable_layer_norm_dense_general()->add_features(8);
    cases.push_back(c);
  }
  {
    Case c{"LayerNormMLP", "layer_norm_mlp", {}, {2, 3, 16}};
    c.required.mutable_layer_norm_mlp();
    cases.push_back(c);
  }
  {
    Case c{"DotProductAttention", "dot_product_attention", {}, {2, 4, 2, 8}, 2};
    c.required.mutable_dot_product_attention()->set_head_dim(8);
    c.required.mutable_dot_product_attention()->set_num_attention_heads(2);
    cases.push_back(c);
  }
  {
    Case c{"MultiHeadAttention", "multi_head_attention", {}, {2, 4, 16}};
    c.required.mutable_multi_head_attention()->set_head_dim(8);
    c.required.mutable_multi_head_attention()->set_num_attention_heads(2);
    cases.push_back(c);
  }
  {
    Case c{"TransformerLayer", "transformer_layer", {}, {1, 4, 512}};  // hidden_size 512
    c.required.mutable_transformer_layer();
    cases.push_back(c);
  }
  return cases;
}

// Fields of te.v1's messages that TE's module has no default for (required).
const std::set<std::string> kRequired = {"features", "head_dim", "num_attention_heads"};

class ModuleDefaultsTest : public ::testing::TestWithParam<Case> {};

TEST_P(ModuleDefaultsTest, UnsetFieldsAreTeDefaults) {
  const Case& c = GetParam();
  const json table = te::testing::ModuleDefaultsTable();
  ASSERT_TRUE(table.contains(c.module)) << c.module;
  const json& want = table[c.module];

  te::v1::LayerSpec explicit_spec = c.required;
  const auto* spec_field = te::v1::LayerSpec::descriptor()->FindFieldByName(c.spec_field);
  ASSERT_NE(spec_field, nullptr) << c.spec_field;
  Message* msg = explicit_spec.GetReflection()->MutableMessage(&explicit_spec, spec_field);
  const auto* desc = msg->GetDescriptor();
  for (int i = 0; i < desc->field_count(); ++i) {
    const FieldDescriptor* f = desc->field(i);
    if (kRequired.count(f->name()) != 0 && c.module != "TransformerLayer") continue;
    ASSERT_TRUE(want.contains(f->name()))
        << desc->full_name() << "." << f->name() << " has no TE default in the table";
    Set(msg, f, want[f->name()]);
  }
  // The table's fields te.v1 does not carry are layouts the server does not
  // take: TE's transpose_batch_sequence is [batch, seq] (false) here.
  for (const auto& [name, value] : want.items()) {
    if (desc->FindFieldByName(name) != nullptr) continue;
    EXPECT_EQ(name, "transpose_batch_sequence") << c.module << "." << name << " is not in te.v1";
  }

  auto unset = CreateLayer(c.required);
  ASSERT_TRUE(unset.ok()) << unset.status();
  auto set = CreateLayer(explicit_spec);
  ASSERT_TRUE(set.ok()) << set.status() << "\n" << explicit_spec.DebugString();

  auto ops = NewCpuOps();
  auto vars_unset = testing::InitLayer(*ops, **unset, c.x_shape, nullptr, 5);
  auto vars_set = testing::InitLayer(*ops, **set, c.x_shape, nullptr, 5);
  ASSERT_TRUE(vars_unset.ok()) << vars_unset.status();
  ASSERT_TRUE(vars_set.ok()) << vars_set.status();
  ASSERT_EQ(vars_unset->size(), vars_set->size());
  for (const auto& [name, tensor] : *vars_unset) {
    ASSERT_EQ(vars_set->count(name), 1u) << name;
    EXPECT_EQ(tensor.shape(), vars_set->at(name).shape()) << name;
    EXPECT_EQ(Values(tensor), Values(vars_set->at(name))) << name;
  }

  LayerInputs in;
  in.x = RandomTensor(*ops, c.x_shape, DType::kF32, 9);
  for (int i = 0; i < c.extra_inputs; ++i) in.extra.push_back(RandomTensor(*ops, c.x_shape, DType::kF32, 10 + i));
  ForwardOptions opts;
  opts.deterministic = false;  // dropout active: its default rates count
  opts.dropout_seed = 77;
  LayerOutputs y_unset, y_set;
  ASSERT_TRUE((*unset)->Forward(*ops, &*vars_unset, in, opts, &y_unset, nullptr).ok());
  ASSERT_TRUE((*set)->Forward(*ops, &*vars_set, in, opts, &y_set, nullptr).ok());
  EXPECT_EQ(Values(y_unset.y), Values(y_set.y));
}

// A default that differs from the table's fails: TransformerLayer with
// intermediate_dropout 0.1 (TE's default before 2.10) set explicitly
// differs from the unset spec (0.0).
TEST(ModuleDefaultsTest, TheComparisonSeesADropoutDefault) {
  te::v1::LayerSpec unset_spec;
  unset_spec.mutable_transformer_layer()->set_hidden_size(32);
  unset_spec.mutable_transformer_layer()->set_num_attention_heads(4);
  te::v1::LayerSpec other = unset_spec;
  other.mutable_transformer_layer()->set_intermediate_dropout(0.1f);
  auto a = CreateLayer(unset_spec).value();
  auto b = CreateLayer(other).value();
  auto ops = NewCpuOps();
  const Shape shape = {2, 4, 32};
  Variables va = testing::InitLayer(*ops, *a, shape, nullptr, 5).value();
  Variables vb = testing::InitLayer(*ops, *b, shape, nullptr, 5).value();
  LayerInputs in;
  in.x = RandomTensor(*ops, shape, DType::kF32, 9);
  ForwardOptions opts;
  opts.deterministic = false;
  opts.dropout_seed = 77;
  LayerOutputs ya, yb;
  ASSERT_TRUE(a->Forward(*ops, &va, in, opts, &ya, nullptr).ok());
  ASSERT_TRUE(b->Forward(*ops, &vb, in, opts, &yb, nullptr).ok());
  EXPECT_NE(Values(ya.y), Values(yb.y));
}

INSTANTIATE_TEST_SUITE_P(TeModules, ModuleDefaultsTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.module;
                         });

}  // namespace
}  // namespace te::layers
