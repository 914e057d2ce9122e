// Request tensors for the session's tests: random values, the same for a
// seed in every test (MixBits), and the FP8 recipe the step tests train under.
#ifndef TE_SERVER_SESSION_TESTING_RANDOM_TENSORS_H_
#define TE_SERVER_SESSION_TESTING_RANDOM_TENSORS_H_

#include <cstdint>
#include <vector>

#include "te/v1/service.pb.h"

namespace te::session::testing {

// Uniform in [-scale, scale), float32 or bfloat16 (rounded from float32).
te::v1::Tensor RandomFloats(const std::vector<int64_t>& shape, uint64_t seed, float scale = 1.0f,
                            te::v1::DType dtype = te::v1::FLOAT32);
// int32 token ids in [0, vocab).
te::v1::Tensor RandomIds(const std::vector<int64_t>& shape, uint64_t seed, int64_t vocab);
// DelayedScaling: HYBRID, an amax history of 4, "max".
te::v1::Recipe DelayedScalingRecipe();

}  // namespace te::session::testing

#endif  // TE_SERVER_SESSION_TESTING_RANDOM_TENSORS_H_
