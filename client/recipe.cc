#include "client/recipe.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace te::client {
namespace {

thread_local AutocastState current_autocast;
thread_local MatmulPrecision current_matmul_precision = MatmulPrecision::kDefault;

te::v1::Fp8Format FormatToProto(Format format) {
  switch (format) {
    case Format::kE4M3: return te::v1::E4M3;
    case Format::kE5M2: return te::v1::E5M2;
    case Format::kHybrid: return te::v1::HYBRID;
  }
  return te::v1::FP8_FORMAT_UNSPECIFIED;
}

// FP8_FORMAT_UNSPECIFIED means the recipe's own default.
Format FormatFromProto(te::v1::Fp8Format format, Format recipe_default) {
  switch (format) {
    case te::v1::E4M3: return Format::kE4M3;
    case te::v1::E5M2: return Format::kE5M2;
    case te::v1::HYBRID: return Format::kHybrid;
    default: return recipe_default;
  }
}

const char* FormatName(Format format) {
  switch (format) {
    case Format::kE4M3: return "E4M3";
    case Format::kE5M2: return "E5M2";
    case Format::kHybrid: return "HYBRID";
  }
  return "?";
}

// std::visit with one lambda per alternative.
template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

}  // namespace

te::v1::Recipe ToProto(const Recipe& recipe) {
  te::v1::Recipe proto;
  std::visit(Overloaded{
                 [&](const DelayedScaling& r) {
                   te::v1::DelayedScaling* p = proto.mutable_delayed_scaling();
                   p->set_margin(r.margin);
                   p->set_fp8_format(FormatToProto(r.fp8_format));
                   p->set_amax_history_len(r.amax_history_len);
                   p->set_amax_compute_algo(r.amax_compute_algo);
                 },
                 [&](const Float8CurrentScaling& r) {
                   te::v1::Float8CurrentScaling* p = proto.mutable_float8_current_scaling();
                   p->set_fp8_format(FormatToProto(r.fp8_format));
                   p->set_amax_epsilon(r.amax_epsilon);
                 },
                 [&](const MXFP8BlockScaling& r) {
                   proto.mutable_mxfp8_block_scaling()->set_fp8_format(FormatToProto(r.fp8_format));
                 },
                 [&](const NVFP4BlockScaling&) { proto.mutable_nvfp4_block_scaling(); },
             },
             recipe);
  return proto;
}

absl::StatusOr<Recipe> FromProto(const te::v1::Recipe& proto) {
  switch (proto.kind_case()) {
    case te::v1::Recipe::kDelayedScaling: {
      const te::v1::DelayedScaling& p = proto.delayed_scaling();
      DelayedScaling r;
      if (p.has_margin()) r.margin = p.margin();
      r.fp8_format = FormatFromProto(p.fp8_format(), r.fp8_format);
      if (p.has_amax_history_len()) r.amax_history_len = p.amax_history_len();
      if (p.has_amax_compute_algo()) r.amax_compute_algo = p.amax_compute_algo();
      return r;
    }
    case te::v1::Recipe::kFloat8CurrentScaling: {
      const te::v1::Float8CurrentScaling& p = proto.float8_current_scaling();
      Float8CurrentScaling r;
      r.fp8_format = FormatFromProto(p.fp8_format(), r.fp8_format);
      if (p.has_amax_epsilon()) r.amax_epsilon = p.amax_epsilon();
      return r;
    }
    case te::v1::Recipe::kMxfp8BlockScaling: {
      MXFP8BlockScaling r;
      r.fp8_format = FormatFromProto(proto.mxfp8_block_scaling().fp8_format(), r.fp8_format);
      return r;
    }
    case te::v1::Recipe::kNvfp4BlockScaling: return NVFP4BlockScaling{};
    default: break;
  }
  return absl::InvalidArgumentError("recipe: no recipe kind is set");
}

std::string RecipeString(const Recipe& recipe) {
  return std::visit(
      Overloaded{
          [](const DelayedScaling& r) {
            return absl::StrCat("DelayedScaling(margin=", r.margin, ", fp8_format=", FormatName(r.fp8_format),
                                ", amax_history_len=", r.amax_history_len,
                                ", amax_compute_algo=", r.amax_compute_algo, ")");
          },
          [](const Float8CurrentScaling& r) {
            return absl::StrCat("Float8CurrentScaling(fp8_format=", FormatName(r.fp8_format),
                                ", amax_epsilon=", r.amax_epsilon, ")");
          },
          [](const MXFP8BlockScaling& r) {
            return absl::StrCat("MXFP8BlockScaling(fp8_format=", FormatName(r.fp8_format), ")");
          },
          [](const NVFP4BlockScaling&) { return std::string("NVFP4BlockScaling()"); },
      },
      recipe);
}

te::v1::Autocast ToProto(const AutocastState& state) {
  te::v1::Autocast proto;
  proto.set_enabled(state.enabled);
  if (state.enabled && state.recipe.has_value()) *proto.mutable_recipe() = ToProto(*state.recipe);
  return proto;
}

Autocast::Autocast(bool enabled) : previous_(current_autocast) {
  current_autocast = AutocastState{enabled, std::nullopt};
}

Autocast::Autocast(bool enabled, Recipe recipe) : previous_(current_autocast) {
  current_autocast = AutocastState{enabled, std::move(recipe)};
}

Autocast::~Autocast() { current_autocast = std::move(previous_); }

const AutocastState& Autocast::Current() { return current_autocast; }

te::v1::Precision ToProto(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::kDefault:
      return te::v1::PRECISION_DEFAULT;
    case MatmulPrecision::kHighest:
      return te::v1::PRECISION_HIGHEST;
  }
  return te::v1::PRECISION_DEFAULT;
}

DefaultMatmulPrecision::DefaultMatmulPrecision(MatmulPrecision precision)
    : previous_(current_matmul_precision) {
  current_matmul_precision = precision;
}

DefaultMatmulPrecision::~DefaultMatmulPrecision() { current_matmul_precision = previous_; }

MatmulPrecision DefaultMatmulPrecision::Current() { return current_matmul_precision; }

}  // namespace te::client
