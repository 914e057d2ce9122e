// Initialisers: TE's / Flax's defaults, deterministic from (seed, variable
// name) so that one seed gives the same variables on every backend and every
// run, whatever order the variables are created in.
//
//   kernels       variance_scaling(1.0, "fan_in", "truncated_normal"): a normal
//                 truncated to [-2, 2], std sqrt(1 / fan_in) / 0.87962566103423978
//                 (JAX divides by the truncated distribution's std)
//   biases        zeros
//   norm scale    ones (zeros when zero_centered_gamma)
//   embeddings    variance_scaling(1.0, "fan_in", "normal", out_axis=0): a
//                 plain normal, std sqrt(1 / features) (Flax's Embed)
//   fp8_metas     scale ones, amax_history zeros
// Values are drawn on the host in float32, in chunks of at most
// kInitChunkElements, and cast on the device to the variable's dtype: the
// variable is allocated (and so checked against the session's memory limit)
// before any value is drawn, and host memory stays bounded whatever its size.
#ifndef TE_SERVER_LAYERS_INIT_H_
#define TE_SERVER_LAYERS_INIT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "server/layers/layer.h"

namespace te::layers {

struct Initializer {
  enum class Kind { kZeros, kOnes, kTruncatedNormal, kNormal };
  Kind kind = Kind::kZeros;
  float stddev = 1.0f;  // kTruncatedNormal, kNormal: the std of the result

  static Initializer Zeros() { return {Kind::kZeros, 0.0f}; }
  static Initializer Ones() { return {Kind::kOnes, 0.0f}; }
  // variance_scaling(scale, "fan_in", "truncated_normal").
  static Initializer VarianceScalingFanIn(int64_t fan_in, float scale = 1.0f);
  // variance_scaling(scale, "fan_in", "normal"): untruncated.
  static Initializer NormalFanIn(int64_t fan_in, float scale = 1.0f);
};

// Flax's fan_in for a kernel of `shape` (in_axis -2, out_axis -1): every
// dimension but the last, so (in, 3, 4096) has fan_in = in * 3, as TE's
// DenseGeneral gets from JAX.
int64_t KernelFanIn(const Shape& shape);
// TE's default kernel_init for `shape`.
Initializer KernelInit(const Shape& shape);

// A variable and how to initialise it.
struct VariableDef {
  VariableSpec spec;
  Initializer init;
};

std::vector<VariableSpec> SpecsOf(const std::vector<VariableDef>& defs);

// What of a recipe a layer's variables depend on, as a key: its kind and
// amax history length ((-1, 0) without FP8).
std::pair<int, int64_t> Fp8StateKey(const Fp8Recipe* fp8);

// A module's variable specs, made once per FP8 state (a recipe's kind and
// amax history length: all of a recipe its variables depend on). Every
// forward and backward checks the variables it runs on against its
// module's specs, and the nested modules of a TransformerLayer check theirs
// again, so making the names each time was a large share of a step's host
// time. Thread-safe; copies share what was made (a module's copies have the
// same variables).
class SpecsMemo {
 public:
  // The specs of `defs()`, the module's definitions under `fp8`.
  const std::vector<VariableSpec>& Get(const Fp8Recipe* fp8,
                                       const std::function<std::vector<VariableDef>()>& defs) const;

 private:
  struct Made {
    std::mutex mu;
    std::map<std::pair<int, int64_t>, std::vector<VariableSpec>> specs;  // by FP8 state
  };
  std::shared_ptr<Made> made_ = std::make_shared<Made>();
};

// The float32 values of variable `name` (n elements).
std::vector<float> InitialValues(uint64_t seed, const std::string& name, const Initializer& init,
                                 int64_t n);

// Writes the float32 values of elements [begin, end) of a variable into `out`
// (end - begin values). Each value depends on its index alone, so a variable
// can be filled in any chunks.
using ValueFill = std::function<void(int64_t begin, int64_t end, float* out)>;
// The values of InitialValues, chunk by chunk.
ValueFill InitialValueFill(uint64_t seed, const std::string& name, const Initializer& init);

constexpr int64_t kInitChunkElements = int64_t{1} << 20;
// Allocates variable `spec` (RESOURCE_EXHAUSTED past the memory limit, before
// any host memory is taken), fills it from `fill` chunk by chunk, and stores it
// in *vars under spec.name (replacing a same-named one).
absl::Status StoreVariable(Ops& ops, const VariableSpec& spec, const ValueFill& fill,
                           Variables* vars);

// Creates every variable of `defs` into *vars (replacing same-named ones).
absl::Status InitVariables(Ops& ops, uint64_t seed, const std::vector<VariableDef>& defs,
                           Variables* vars);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_INIT_H_
