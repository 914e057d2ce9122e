// Request tensors (te.v1.Tensor) <-> device tensors (te::Tensor), with the
// validation every request tensor gets before a session touches anything.
//
// Decoding is two-phase so a handler can validate a whole request before it
// changes any state: CheckTensor() validates dtype, shape, size and where the
// data is without copying anything; Materialize() then puts a checked tensor
// on the device. Every error is INVALID_ARGUMENT naming the field path (e.g.
// "micro_batches[1].dy.shape[2]"), except shared-memory data on a server
// without --enable_shm, which is FAILED_PRECONDITION. Values are not
// inspected: NaN and inf are legal inputs.
#ifndef TE_SERVER_SESSION_TENSOR_CODEC_H_
#define TE_SERVER_SESSION_TENSOR_CODEC_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "google/protobuf/repeated_field.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"
#include "proto/dtype.h"  // DTypeFromProto / DTypeToProto, shared with the C++ client
#include "server/session/shm_region.h"
#include "te/v1/tensor.pb.h"

namespace te::session {

// True when `ops`' tensors live in host memory (the CPU backend): the server
// may then read and write their bytes directly.
bool IsHostMemory(const Ops& ops);

// A shape whose dims are all >= 0, and whose byte size (for `dtype`) neither
// overflows nor exceeds `max_bytes`. `field` names the repeated field
// ("x.shape"); a bad dim is reported as "x.shape[2]".
absl::StatusOr<Shape> ShapeFromProto(const google::protobuf::RepeatedField<int64_t>& dims,
                                     DType dtype, int64_t max_bytes, const std::string& field);

// Resident tensors of the session, by id; null when there is none.
using ResidentLookup = std::function<const Tensor*(const std::string& id)>;
// Shared-memory regions of the session, by id; null when there is none. An
// empty lookup means shared memory is disabled on this server.
using ShmLookup = std::function<ShmRegion*(const std::string& region_id)>;

// A request tensor that passed CheckTensor: everything known, nothing copied.
// Points into the request and the session; valid while both are unchanged.
struct CheckedTensor {
  std::string field;
  DType dtype = DType::kF32;
  Shape shape;
  const std::string* inline_data = nullptr;  // set for inline tensors
  const Tensor* resident = nullptr;          // set for resident tensors
  const ShmRegion* shm = nullptr;            // set for shared-memory tensors,
  uint64_t shm_offset = 0;                   // whose bytes start here
};

// Validates `proto`: a known dtype; a valid shape of at most `max_tensor_bytes`;
// inline bytes of exactly the tensor's size, a resident id that exists
// (its dtype and shape must match those given, where given: DTYPE_UNSPECIFIED
// and an empty shape take the resident tensor's), or a region of this
// session that holds the tensor's bytes at the offset.
absl::StatusOr<CheckedTensor> CheckTensor(const te::v1::Tensor& proto, const std::string& field,
                                          int64_t max_tensor_bytes,
                                          const ResidentLookup& resident,
                                          const ShmLookup& shm = nullptr);

// The region `ref` names, checked to hold `bytes` at its offset (`field`
// names the reference in errors). FAILED_PRECONDITION when shared memory is
// disabled; INVALID_ARGUMENT for an unknown region or a range past its end.
absl::StatusOr<ShmRegion*> CheckShmRef(const te::v1::SharedMemoryRef& ref, uint64_t bytes,
                                       const std::string& field, const ShmLookup& shm);

// The tensor on `ops`' device: inline or shared-memory bytes copied into a
// new allocation (RESOURCE_EXHAUSTED over the memory limit; a copy, so the
// client may reuse its region at once); a resident tensor shared as is.
absl::StatusOr<Tensor> Materialize(Ops& ops, const CheckedTensor& checked);

// Copies `tensor` into `region` at `offset` (a range already checked). On the
// CPU straight from the tensor; elsewhere through host memory.
absl::Status WriteToRegion(Ops& ops, const Tensor& tensor, ShmRegion& region, uint64_t offset);

// The tensor's bytes on the host (for small control tensors such as masks).
absl::StatusOr<std::string> HostBytes(Ops& ops, const CheckedTensor& checked);

// Writes dtype, shape and the bytes (downloaded from the device) into `out`.
absl::Status EncodeInline(Ops& ops, const Tensor& tensor, te::v1::Tensor* out);
// Writes dtype, shape and `resident_id` into `out`.
void EncodeResident(const Tensor& tensor, const std::string& resident_id, te::v1::Tensor* out);

// An attention mask as TE's Flax modules take it (transformer.py,
// DotProductAttention / MultiHeadAttention / TransformerLayer: "True means
// mask out"), in bool, int32 or a float dtype, any nonzero element masked out
// (TE's tests send uint8 0/1 (tests/jax/test_layer.py); the clients send such
// a mask as bool). TE's unfused attention combines it with the logits
// [batch, heads, q_len, kv_len] by broadcasting (module.py Softmax), so the
// mask is rank 4 with each dim 1 or the logits': [batch or 1, heads or 1,
// q_len or 1, kv_len or 1]; its heads are checked by the attention module
// that reads it (the session does not know a layer's heads). Decoded once
// per request, before the layer's mask types are known: each attention module
// then reads what its type needs (server/layers/attention_core.h, SeqLens),
// and no_mask and causal modules never look at it.
struct Seqlens {
  std::vector<int32_t> q;
  std::vector<int32_t> kv;
};
struct DecodedMask {
  int64_t batch = 0, q_len = 0, kv_len = 0;
  // 1 for a mask shared over the heads (also a per-head mask whose planes
  // are all equal), else the mask's head count.
  int64_t heads = 1;
  // The heads the mask was given with (its dim 1), which the layer checks
  // against its own whatever the planes hold.
  int64_t given_heads = 1;
  // Per batch row: queries up to the last one that sees a key, keys up to the
  // last one any query (of any head) sees (TE's fused attention: the max over
  // rows). The per-batch actual lengths a padding_causal_bottom_right module
  // aligns its diagonal with.
  Seqlens extents;
  // Set (to `extents`) when the mask is exactly a padding pattern (batch b's
  // visible elements are [0, q[b]) x [0, kv[b]) in every head), or that
  // pattern with the causal triangle j > i masked too (with_causal): cuDNN's
  // fast path.
  std::optional<Seqlens> seqlens;
  bool with_causal = false;
  // The mask elementwise, bool bytes [batch, heads, q_len, kv_len] (1 =
  // masked out), broadcast over every dim it had as 1; empty when the mask
  // is exactly a padding pattern (the lengths say it all).
  std::string elementwise;
};
// INVALID_ARGUMENT naming `field` for a shape that does not broadcast to
// [batch, heads, q_len, kv_len] (".shape", with the shapes TE takes) or a
// byte count that does not fit. `batch` and `q_len` are x's, `kv_len` k's.
absl::StatusOr<DecodedMask> DecodeAttentionMask(const std::string& mask_bytes, DType dtype,
                                                const Shape& shape, int64_t batch,
                                                int64_t q_len, int64_t kv_len,
                                                const std::string& field);

// Uploads int32 lengths as an int32 [B] tensor.
absl::StatusOr<Tensor> UploadSeqlens(Ops& ops, const std::vector<int32_t>& lengths);

// A decoded mask on the device, as the layers take it (layers::LayerInputs):
// the lengths always (the extents: a padding pattern's lengths, and the
// actual lengths a bottom-right diagonal aligns with); the mask elementwise,
// bool [B, Sq, Skv] or [B, H, Sq, Skv], unless it is exactly a padding
// pattern (then undefined).
struct MaskTensors {
  Tensor q_seqlens, kv_seqlens;
  bool with_causal = false;  // exactly padding | causal of the lengths
  Tensor elementwise;
  int64_t given_heads = 1;   // DecodedMask::given_heads
};
absl::StatusOr<MaskTensors> UploadMask(Ops& ops, const DecodedMask& mask);

}  // namespace te::session

#endif  // TE_SERVER_SESSION_TENSOR_CODEC_H_
