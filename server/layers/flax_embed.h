// nn.Embed with Flax's semantics (te.v1.FlaxEmbed): int32 token ids in, rows
// of params/embedding [num_embeddings, features] out; its gradient is a
// deterministic scatter-add into the embedding (Ops::EmbedBackward). The
// graph's attend node (nn.Embed.attend, the tied output projection) reads the
// same variable: EmbedAttend below. Const and thread-compatible, as every Layer.
#ifndef TE_SERVER_LAYERS_FLAX_EMBED_H_
#define TE_SERVER_LAYERS_FLAX_EMBED_H_

#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "server/layers/layer.h"
#include "te/v1/layers.pb.h"

namespace te::layers {

// INVALID_ARGUMENT naming "spec.flax_embed.<field>" for num_embeddings or
// features < 1 and dtypes that are not float.
absl::StatusOr<std::unique_ptr<Layer>> MakeFlaxEmbed(const te::v1::FlaxEmbed& spec);

// Int32 zeros of `shape`: the "gradient" of token ids (JAX's float0).
absl::StatusOr<Tensor> IdGradient(Ops& ops, const Shape& shape);

// nn.Embed.attend: y [..., V] = x [..., F] @ embedding [V, F]^T, in `dtype`
// or jnp.result_type(x, embedding); float32 at the call's matmul precision
// (tf32: ForwardOptions::tf32; its backward at the same).
struct AttendSaved {
  Tensor x;          // in the compute dtype
  Tensor embedding;  // in the compute dtype
  DType x_dtype = DType::kF32;
  bool tf32 = true;
  int64_t bytes() const { return static_cast<int64_t>(x.nbytes() + embedding.nbytes()); }
};
DType AttendDType(const std::optional<DType>& dtype, DType x, DType embedding);
absl::Status AttendForward(Ops& ops, const Tensor& embedding, const std::optional<DType>& dtype,
                           const Tensor& x, Tensor* y, AttendSaved* saved, bool tf32 = true);
// dy [..., V] -> *dx (x's shape and dtype) and *dembedding (the embedding's
// shape and dtype).
absl::Status AttendBackward(Ops& ops, const AttendSaved& saved, DType embedding_dtype,
                            const Tensor& dy, Tensor* dx, Tensor* dembedding);

}  // namespace te::layers

#endif  // TE_SERVER_LAYERS_FLAX_EMBED_H_
