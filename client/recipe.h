// FP8 recipes as TE spells them (transformer_engine.common.recipe), and the
// scoped guards that stand in for `with te.autocast(...)` (Autocast) and
// `with jax.default_matmul_precision(...)` (DefaultMatmulPrecision).
//
// Recipes are plain values with TE's defaults. A guard sets the calling
// thread's current setting until it is destroyed; Module::Init, Apply,
// ValueAndGrad and Speedometer read it at call time. Guards nest: the inner
// one wins and its destructor restores the outer one. Other threads are not
// affected (each thread has its own current settings).
#ifndef TE_CLIENT_RECIPE_H_
#define TE_CLIENT_RECIPE_H_

#include <optional>
#include <string>
#include <variant>

#include "absl/status/statusor.h"
#include "te/v1/layers.pb.h"
#include "te/v1/recipe.pb.h"

namespace te::client {

// transformer_engine.common.recipe.Format.
enum class Format {
  kE4M3,    // E4M3 forward and backward
  kE5M2,    // E5M2 forward and backward
  kHybrid,  // E4M3 forward, E5M2 for gradients
};

struct DelayedScaling {
  float margin = 0.0f;
  Format fp8_format = Format::kHybrid;
  int amax_history_len = 1024;
  std::string amax_compute_algo = "max";  // "max" | "most_recent"
};

struct Float8CurrentScaling {
  Format fp8_format = Format::kHybrid;
  float amax_epsilon = 0.0f;
};

// Blackwell block scalings: native on sm100, emulated elsewhere (sessions
// accept them only when the negotiation policy allows emulation).
struct MXFP8BlockScaling {
  Format fp8_format = Format::kE4M3;
};

struct NVFP4BlockScaling {};

using Recipe = std::variant<DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling>;

// Every field is written (TE's defaults included), so the server never has
// to guess what the client meant.
te::v1::Recipe ToProto(const Recipe& recipe);
// Unset proto fields take TE's defaults. INVALID_ARGUMENT when no kind is set.
absl::StatusOr<Recipe> FromProto(const te::v1::Recipe& recipe);
// "DelayedScaling(margin=0, fp8_format=HYBRID, amax_history_len=16, amax_compute_algo=max)".
std::string RecipeString(const Recipe& recipe);

// What an Autocast guard sets: FP8 on or off, and the recipe. With enabled
// and no recipe, the session's negotiated recipe is used (as te.autocast
// falls back to its default recipe).
struct AutocastState {
  bool enabled = false;
  std::optional<Recipe> recipe;
};

te::v1::Autocast ToProto(const AutocastState& state);

// `Autocast autocast(true, DelayedScaling{...});` for the rest of the scope.
// Not copyable or movable: it restores on destruction, in reverse order of
// construction, on the thread that made it.
class Autocast {
 public:
  explicit Autocast(bool enabled);
  Autocast(bool enabled, Recipe recipe);
  ~Autocast();

  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

  // The calling thread's current autocast (disabled outside any guard).
  static const AutocastState& Current();

 private:
  AutocastState previous_;
};

// jax.default_matmul_precision for the float32 GEMMs of every module (TE's
// and Flax's; a Flax module's own highest_precision wins): kDefault, JAX's
// default, runs them with TensorFloat-32 products on a GPU server (operands
// rounded to 10 mantissa bits, float32 accumulation); kHighest runs exact
// float32. A CPU server computes exact float32 either way. No effect on
// bfloat16, float16 or FP8 GEMMs.
enum class MatmulPrecision { kDefault, kHighest };

te::v1::Precision ToProto(MatmulPrecision precision);

// `DefaultMatmulPrecision highest(MatmulPrecision::kHighest);` for the rest
// of the scope; outside any guard the precision is kDefault. Not copyable or
// movable, restored on destruction as Autocast is.
class DefaultMatmulPrecision {
 public:
  explicit DefaultMatmulPrecision(MatmulPrecision precision);
  ~DefaultMatmulPrecision();

  DefaultMatmulPrecision(const DefaultMatmulPrecision&) = delete;
  DefaultMatmulPrecision& operator=(const DefaultMatmulPrecision&) = delete;

  // The calling thread's current precision.
  static MatmulPrecision Current();

 private:
  MatmulPrecision previous_;
};

}  // namespace te::client

#endif  // TE_CLIENT_RECIPE_H_
