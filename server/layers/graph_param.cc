// A composite's own parameter (Flax's self.param(name, init_fn, shape,
// dtype)): the param node's variable "params/<node name>", drawn at init
// from its te.v1.Initializer with the node's seed DeriveSeed(seed, node name)
// (kernels/rng.h), on the host in float32 and cast to the variable's dtype.
//
// The initializers as flax.linen.initializers / jax.nn.initializers define
// them (distributions, not JAX's bits): zeros, ones, constant(value),
// normal(stddev), uniform(scale) on [0, scale), truncated_normal(stddev) on
// [-2, 2] stddevs, and variance_scaling(scale, mode, distribution) with
// fan_in = shape[in_axis] * receptive, fan_out = shape[out_axis] * receptive
// (receptive: the product of the other dims), variance = scale / fan
// (fan_avg: the mean of both), drawn as a normal of that variance, a normal
// truncated to 2 stddevs divided by 0.87962566103423978 (JAX's), or a
// uniform on +-sqrt(3 variance). lecun_* / glorot_* / he_* are
// variance_scaling with JAX's presets.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"
#include "proto/dtype.h"
#include "server/layers/graph_internal.h"
#include "server/layers/init.h"

namespace te::layers::graph {
namespace {

using te::v1::Initializer;

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

constexpr double kTruncatedStd = 0.87962566103423978;

// variance_scaling's parameters, after the presets are resolved.
struct Scaling {
  double scale = 1.0;
  std::string mode, distribution;
};

bool IsScaling(Initializer::Kind kind) {
  return kind >= Initializer::LECUN_NORMAL && kind <= Initializer::VARIANCE_SCALING;
}

Scaling ScalingOf(const Initializer& init) {
  switch (init.kind()) {
    case Initializer::LECUN_NORMAL: return {1.0, "fan_in", "truncated_normal"};
    case Initializer::LECUN_UNIFORM: return {1.0, "fan_in", "uniform"};
    case Initializer::GLOROT_NORMAL: return {1.0, "fan_avg", "truncated_normal"};
    case Initializer::GLOROT_UNIFORM: return {1.0, "fan_avg", "uniform"};
    case Initializer::HE_NORMAL: return {2.0, "fan_in", "truncated_normal"};
    case Initializer::HE_UNIFORM: return {2.0, "fan_in", "uniform"};
    default: break;  // VARIANCE_SCALING: as given
  }
  return {init.has_scale() ? init.scale() : 1.0, init.mode(), init.distribution()};
}

// Uniform in [0, 1) with 24 random bits, a pure function of (stream, index).
float UniformAt(uint64_t stream, int64_t i) {
  return DropoutUniform(stream, static_cast<uint64_t>(i));
}

// The values of a param node's variable, chunk by chunk.
ValueFill FillOf(uint64_t seed, const Node& node) {
  const Initializer& init = node.initializer;
  const std::string name = ParamName(node);
  const uint64_t stream = DeriveSeed(seed, name);
  auto constant = [](float v) {
    return [v](int64_t begin, int64_t end, float* out) { std::fill(out, out + (end - begin), v); };
  };
  auto uniform = [stream](double lo, double hi) {
    return [stream, lo, hi](int64_t begin, int64_t end, float* out) {
      for (int64_t i = begin; i < end; ++i) {
        out[i - begin] = static_cast<float>(lo + (hi - lo) * UniformAt(stream, i));
      }
    };
  };
  auto normal = [&](double stddev, bool truncated) {
    layers::Initializer n;
    n.kind = truncated ? layers::Initializer::Kind::kTruncatedNormal
                       : layers::Initializer::Kind::kNormal;
    n.stddev = static_cast<float>(stddev);
    return InitialValueFill(seed, name, n);
  };
  switch (init.kind()) {
    case Initializer::ZEROS: return constant(0.0f);
    case Initializer::ONES: return constant(1.0f);
    case Initializer::CONSTANT: return constant(static_cast<float>(init.value()));
    case Initializer::NORMAL: return normal(init.has_stddev() ? init.stddev() : 1e-2, false);
    case Initializer::TRUNCATED_NORMAL:
      return normal(init.has_stddev() ? init.stddev() : 1e-2, true);
    case Initializer::UNIFORM: return uniform(0.0, init.has_scale() ? init.scale() : 1e-2);
    default: break;  // variance scaling (KIND_UNSPECIFIED: lecun_normal), checked by ParseParam
  }
  Initializer resolved = init;
  if (init.kind() == Initializer::KIND_UNSPECIFIED) resolved.set_kind(Initializer::LECUN_NORMAL);
  const Scaling s = ScalingOf(resolved);
  const Shape& shape = node.shape;
  const int rank = static_cast<int>(shape.size());
  const int in_axis = init.has_in_axis() ? (init.in_axis() + rank) % rank : rank - 2;
  const int out_axis = init.has_out_axis() ? (init.out_axis() + rank) % rank : rank - 1;
  const double receptive = static_cast<double>(NumElements(shape)) /
                           static_cast<double>(shape[in_axis]) /
                           static_cast<double>(shape[out_axis]);
  const double fan_in = shape[in_axis] * receptive, fan_out = shape[out_axis] * receptive;
  const double fan = s.mode == "fan_in"    ? fan_in
                     : s.mode == "fan_out" ? fan_out
                                           : (fan_in + fan_out) / 2;
  const double variance = s.scale / std::max(1.0, fan);
  if (s.distribution == "uniform") {
    const double limit = std::sqrt(3.0 * variance);
    return uniform(-limit, limit);
  }
  if (s.distribution == "normal") return normal(std::sqrt(variance), false);
  return normal(std::sqrt(variance) / kTruncatedStd, true);
}

}  // namespace

absl::Status ParseParam(const te::v1::GraphSpec::Param& spec, const std::string& where,
                        Node* node) {
  node->shape.assign(spec.shape().begin(), spec.shape().end());
  for (size_t d = 0; d < node->shape.size(); ++d) {
    if (node->shape[d] < 1) {
      return Invalid(absl::StrCat(where, ".shape[", d, "]"),
                     absl::StrCat(node->shape[d], "; want >= 1"));
    }
  }
  if (!CheckedNumElements(node->shape)) {
    return Invalid(where + ".shape",
                   absl::StrCat(ShapeString(node->shape), " has 2^63 elements or more"));
  }
  node->dtype = DType::kF32;
  if (spec.dtype() != te::v1::DTYPE_UNSPECIFIED) {
    ASSIGN_OR_RETURN(node->dtype, FloatDTypeFromProto(spec.dtype(), where + ".dtype"));
  }
  node->initializer = spec.initializer();
  const Initializer& init = spec.initializer();
  const std::string w = where + ".initializer";
  switch (init.kind()) {
    case Initializer::ZEROS:
    case Initializer::ONES: return absl::OkStatus();
    case Initializer::CONSTANT:
      if (!std::isfinite(init.value()))
        return Invalid(w + ".value", absl::StrCat(init.value(), "; want finite"));
      return absl::OkStatus();
    case Initializer::NORMAL:
    case Initializer::TRUNCATED_NORMAL:
      if (init.has_stddev() && !(init.stddev() >= 0.0 && std::isfinite(init.stddev()))) {
        return Invalid(w + ".stddev", absl::StrCat(init.stddev(), "; want finite and >= 0"));
      }
      return absl::OkStatus();
    case Initializer::UNIFORM:
      if (init.has_scale() && !std::isfinite(init.scale())) {
        return Invalid(w + ".scale", absl::StrCat(init.scale(), "; want finite"));
      }
      return absl::OkStatus();
    default: break;
  }
  if (init.kind() != Initializer::KIND_UNSPECIFIED && !IsScaling(init.kind())) {
    return Invalid(w + ".kind",
                   absl::StrCat(static_cast<int>(init.kind()), " is not an initializer kind"));
  }
  // Variance scaling: fans from two axes of a shape of rank 2 or more (JAX's _compute_fans).
  const int rank = static_cast<int>(node->shape.size());
  if (rank < 2) {
    return Invalid(w,
                   absl::StrCat("variance scaling (lecun, glorot, he) computes fans from a shape "
                                "of rank 2 or more; the param's is ",
                                ShapeString(node->shape)));
  }
  for (const auto& [has, axis, name] :
       {std::tuple<bool, int, const char*>{init.has_in_axis(), init.in_axis(), "in_axis"},
        {init.has_out_axis(), init.out_axis(), "out_axis"}}) {
    if (has && (axis < -rank || axis >= rank)) {
      return Invalid(absl::StrCat(w, ".", name),
                     absl::StrCat(axis, " is out of range for shape ", ShapeString(node->shape)));
    }
  }
  const int in_axis = init.has_in_axis() ? (init.in_axis() + rank) % rank : rank - 2;
  const int out_axis = init.has_out_axis() ? (init.out_axis() + rank) % rank : rank - 1;
  if (in_axis == out_axis) return Invalid(w, "in_axis and out_axis name the same axis");
  if (init.kind() == Initializer::VARIANCE_SCALING) {
    const Scaling s = ScalingOf(init);
    if (!(s.scale > 0.0 && std::isfinite(s.scale))) {
      return Invalid(w + ".scale", absl::StrCat(s.scale, "; want positive"));
    }
    if (s.mode != "fan_in" && s.mode != "fan_out" && s.mode != "fan_avg") {
      return Invalid(w + ".mode",
                     absl::StrCat("\"", s.mode, "\"; want fan_in, fan_out or fan_avg"));
    }
    if (s.distribution != "truncated_normal" && s.distribution != "normal" &&
        s.distribution != "uniform") {
      return Invalid(
          w + ".distribution",
          absl::StrCat("\"", s.distribution, "\"; want truncated_normal, normal or uniform"));
    }
  }
  return absl::OkStatus();
}

std::string ParamName(const Node& node) { return absl::StrCat("params/", node.name); }

VariableSpec ParamSpec(const Node& node) {
  return VariableSpec{ParamName(node), node.shape, node.dtype};
}

absl::Status InitParam(Ops& ops, uint64_t seed, const Node& node, Variables* vars) {
  const uint64_t node_seed = DeriveSeed(seed, node.name);
  return StoreVariable(ops, ParamSpec(node), FillOf(node_seed, node), vars);
}

}  // namespace te::layers::graph
