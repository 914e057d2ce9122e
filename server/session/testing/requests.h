// Request pieces for the session's tests: random tensors, the same for a
// seed in every test (MixBits), the FP8 recipe the step tests train under,
// and graph nodes.
#ifndef TE_SERVER_SESSION_TESTING_REQUESTS_H_
#define TE_SERVER_SESSION_TESTING_REQUESTS_H_

#include <cstdint>
#include <string>
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
// InitLayer of `spec` (the caller fills it in) with `seed`, for a float32
// input of `shape`, under autocast (the session's recipe).
te::v1::InitLayerRequest AutocastInitRequest(uint64_t seed, const std::vector<int64_t>& shape);
// AdamW for `layer_id`: a constant learning rate `lr`, weight decay `decay`.
te::v1::SetOptimizerRequest AdamWRequest(const std::string& layer_id, double lr, double decay);
// A node of `g` named `name` reading `inputs` and making `outputs`; the
// caller sets its op.
te::v1::GraphSpec::Node* AddNode(te::v1::GraphSpec* g, const std::string& name,
                                 const std::vector<std::string>& inputs,
                                 const std::vector<std::string>& outputs);
// A TransformerLayer node of `g` named `name` from `input` to `output`:
// hidden `hidden`, MLP `ffn`, 2 heads, GELU, no dropout; the caller sets the
// rest (position embeddings).
te::v1::TransformerLayer* AddTransformerLayer(te::v1::GraphSpec* g, const std::string& name,
                                              const std::string& input,
                                              const std::string& output, int64_t hidden,
                                              int64_t ffn);

}  // namespace te::session::testing

#endif  // TE_SERVER_SESSION_TESTING_REQUESTS_H_
