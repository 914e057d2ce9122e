#include "server/session/tensor_codec.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te::session {

bool IsHostMemory(const Ops& ops) { return ops.device_name() == "cpu"; }

absl::StatusOr<Shape> ShapeFromProto(const google::protobuf::RepeatedField<int64_t>& dims,
                                     DType dtype, int64_t max_bytes, const std::string& field) {
  Shape shape(dims.begin(), dims.end());
  // Overflow-checked: a product that wraps could pass the size limit.
  int64_t bytes = static_cast<int64_t>(DTypeSize(dtype));
  bool overflow = false;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]: negative dimension ", shape[i]));
    }
    overflow = overflow || __builtin_mul_overflow(bytes, shape[i], &bytes);
  }
  // A zero dim makes any product 0, but an earlier overflow still says "huge".
  if (overflow || bytes > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": shape ", ShapeString(shape), " of ", DTypeName(dtype), " is ",
        overflow ? std::string("over 2^63") : absl::StrCat(bytes),
        " bytes, more than the limit of ", max_bytes, " bytes per tensor"));
  }
  return shape;
}

absl::StatusOr<ShmRegion*> CheckShmRef(const te::v1::SharedMemoryRef& ref, uint64_t bytes,
                                       const std::string& field, const ShmLookup& shm) {
  if (!shm) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": shared memory disabled (--enable_shm)"));
  }
  ShmRegion* region = shm(ref.region_id());
  if (region == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".region_id: no shared-memory region '", ref.region_id(),
        "' in this session (RegisterSharedMemory first; regions end with their session)"));
  }
  RETURN_IF_ERROR(region->CheckRange(ref.offset(), bytes, field));
  return region;
}

absl::StatusOr<CheckedTensor> CheckTensor(const te::v1::Tensor& proto, const std::string& field,
                                          int64_t max_tensor_bytes,
                                          const ResidentLookup& resident, const ShmLookup& shm) {
  CheckedTensor checked;
  checked.field = field;
  switch (proto.data_case()) {
    case te::v1::Tensor::kInlineData: {
      ASSIGN_OR_RETURN(checked.dtype, DTypeFromProto(proto.dtype(), field + ".dtype"));
      ASSIGN_OR_RETURN(checked.shape, ShapeFromProto(proto.shape(), checked.dtype,
                                                     max_tensor_bytes, field + ".shape"));
      const size_t expected = static_cast<size_t>(NumElements(checked.shape)) *
                              DTypeSize(checked.dtype);
      if (proto.inline_data().size() != expected) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".inline_data: ", proto.inline_data().size(), " bytes, but ",
            ShapeString(checked.shape), " ", DTypeName(checked.dtype), " needs ", expected));
      }
      checked.inline_data = &proto.inline_data();
      return checked;
    }
    case te::v1::Tensor::kResidentId: {
      const Tensor* found = resident ? resident(proto.resident_id()) : nullptr;
      if (found == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".resident_id: no resident tensor '", proto.resident_id(),
            "' in this session"));
      }
      checked.dtype = found->dtype();
      checked.shape = found->shape();
      if (proto.dtype() != te::v1::DTYPE_UNSPECIFIED) {
        ASSIGN_OR_RETURN(DType given, DTypeFromProto(proto.dtype(), field + ".dtype"));
        if (given != found->dtype()) {
          return absl::InvalidArgumentError(absl::StrCat(
              field, ".dtype: ", DTypeName(given), ", but resident tensor '",
              proto.resident_id(), "' is ", DTypeName(found->dtype())));
        }
      }
      if (proto.shape_size() > 0 &&
          Shape(proto.shape().begin(), proto.shape().end()) != found->shape()) {
        return absl::InvalidArgumentError(absl::StrCat(
            field, ".shape: ", ShapeString(Shape(proto.shape().begin(), proto.shape().end())),
            ", but resident tensor '", proto.resident_id(), "' is ",
            ShapeString(found->shape())));
      }
      checked.resident = found;
      return checked;
    }
    case te::v1::Tensor::kShm: {
      ASSIGN_OR_RETURN(checked.dtype, DTypeFromProto(proto.dtype(), field + ".dtype"));
      ASSIGN_OR_RETURN(checked.shape, ShapeFromProto(proto.shape(), checked.dtype,
                                                     max_tensor_bytes, field + ".shape"));
      const uint64_t bytes = static_cast<uint64_t>(NumElements(checked.shape)) *
                             DTypeSize(checked.dtype);
      ASSIGN_OR_RETURN(ShmRegion * region, CheckShmRef(proto.shm(), bytes, field + ".shm", shm));
      checked.shm = region;
      checked.shm_offset = proto.shm().offset();
      return checked;
    }
    case te::v1::Tensor::DATA_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": no data (set inline_data, resident_id or shm)"));
}

absl::StatusOr<Tensor> Materialize(Ops& ops, const CheckedTensor& checked) {
  if (checked.resident != nullptr) return *checked.resident;
  ASSIGN_OR_RETURN(Tensor tensor, ops.Allocate(checked.dtype, checked.shape));
  if (tensor.nbytes() == 0) return tensor;
  if (checked.shm != nullptr) {
    if (IsHostMemory(ops)) {
      RETURN_IF_ERROR(checked.shm->Read(checked.shm_offset, tensor.data(), tensor.nbytes()));
    } else {
      // A device copy must not fault on a region its client shrinks, so the
      // bytes go through host memory of the server's own (a guarded copy).
      std::string host(tensor.nbytes(), '\0');
      RETURN_IF_ERROR(checked.shm->Read(checked.shm_offset, host.data(), host.size()));
      RETURN_IF_ERROR(ops.Upload(host.data(), &tensor));
    }
    return tensor;
  }
  RETURN_IF_ERROR(ops.Upload(checked.inline_data->data(), &tensor));
  return tensor;
}

absl::Status WriteToRegion(Ops& ops, const Tensor& tensor, ShmRegion& region, uint64_t offset) {
  if (tensor.nbytes() == 0) return absl::OkStatus();
  if (IsHostMemory(ops)) return region.Write(offset, tensor.data(), tensor.nbytes());
  std::string host(tensor.nbytes(), '\0');
  RETURN_IF_ERROR(ops.Download(tensor, host.data()));
  return region.Write(offset, host.data(), host.size());
}

absl::StatusOr<std::string> HostBytes(Ops& ops, const CheckedTensor& checked) {
  if (checked.inline_data != nullptr) return *checked.inline_data;
  if (checked.shm != nullptr) {
    const size_t bytes = static_cast<size_t>(NumElements(checked.shape)) * DTypeSize(checked.dtype);
    std::string host(bytes, '\0');
    RETURN_IF_ERROR(checked.shm->Read(checked.shm_offset, host.data(), host.size()));
    return host;
  }
  std::string bytes(checked.resident->nbytes(), '\0');
  if (!bytes.empty()) RETURN_IF_ERROR(ops.Download(*checked.resident, bytes.data()));
  return bytes;
}

absl::Status EncodeInline(Ops& ops, const Tensor& tensor, te::v1::Tensor* out) {
  out->set_dtype(DTypeToProto(tensor.dtype()));
  out->mutable_shape()->Assign(tensor.shape().begin(), tensor.shape().end());
  std::string* bytes = out->mutable_inline_data();
  bytes->resize(tensor.nbytes());
  if (!bytes->empty()) RETURN_IF_ERROR(ops.Download(tensor, bytes->data()));
  return absl::OkStatus();
}

void EncodeResident(const Tensor& tensor, const std::string& resident_id, te::v1::Tensor* out) {
  out->set_dtype(DTypeToProto(tensor.dtype()));
  out->mutable_shape()->Assign(tensor.shape().begin(), tensor.shape().end());
  out->set_resident_id(resident_id);
}

namespace {

// Whether each element of a mask is nonzero (masked out). Float dtypes:
// -0.0 is zero (the sign bit is ignored); NaN is nonzero.
std::vector<uint8_t> NonzeroElements(const std::string& bytes, DType dtype, size_t count) {
  const size_t width = DTypeSize(dtype);
  const bool floating = IsFloating(dtype);
  std::vector<uint8_t> masked(count);
  for (size_t n = 0; n < count; ++n) {
    const unsigned char* e = reinterpret_cast<const unsigned char*>(bytes.data()) + n * width;
    bool nonzero = false;
    for (size_t k = 0; k < width; ++k) {
      // Little-endian: the sign bit is the top bit of the last byte.
      const unsigned char byte = floating && k + 1 == width ? (e[k] & 0x7f) : e[k];
      nonzero = nonzero || byte != 0;
    }
    masked[n] = nonzero ? 1 : 0;
  }
  return masked;
}

// The extent of one batch row's mask planes (m: `planes` planes of
// [sq, skv]): queries up to the last one that sees a key, keys up to the last
// one any query sees (TE's fused attention: the max over rows, for causal
// masks).
void Extents(const uint8_t* m, int64_t planes, int64_t sq, int64_t skv, int32_t* q_out,
             int32_t* kv_out) {
  int64_t q_len = 0, kv_len = 0;
  for (int64_t p = 0; p < planes; ++p) {
    for (int64_t i = 0; i < sq; ++i) {
      for (int64_t j = 0; j < skv; ++j) {
        if (m[(p * sq + i) * skv + j] == 0) {
          q_len = std::max(q_len, i + 1);
          kv_len = std::max(kv_len, j + 1);
        }
      }
    }
  }
  *q_out = static_cast<int32_t>(q_len);
  *kv_out = static_cast<int32_t>(kv_len);
}

// Whether one plane is exactly the padding pattern of (q_len, kv_len), with
// the causal triangle j > i masked too when `causal`.
bool IsPaddingPattern(const uint8_t* m, int64_t sq, int64_t skv, bool causal, int64_t q_len,
                      int64_t kv_len) {
  for (int64_t i = 0; i < sq; ++i) {
    for (int64_t j = 0; j < skv; ++j) {
      const bool want = i >= q_len || j >= kv_len || (causal && j > i);
      if ((m[i * skv + j] != 0) != want) return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<DecodedMask> DecodeAttentionMask(const std::string& mask_bytes, DType dtype,
                                                const Shape& shape, int64_t batch,
                                                int64_t q_len, int64_t kv_len,
                                                const std::string& field) {
  // TE combines the mask with the logits [batch, heads, q_len, kv_len] by
  // broadcasting: each dim is 1 or the logits'. Heads are the layer's to
  // check.
  const auto fits = [](int64_t dim, int64_t full) { return dim == 1 || dim == full; };
  if (shape.size() != 4 || !fits(shape[0], batch) || shape[1] < 1 || !fits(shape[2], q_len) ||
      !fits(shape[3], kv_len)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".shape: ", ShapeString(shape),
        " does not broadcast to the attention logits [batch, heads, q_len, kv_len] = [", batch,
        ", heads, ", q_len, ", ", kv_len, "]; TE takes [", batch, " or 1, heads or 1, ", q_len,
        " or 1, ", kv_len, " or 1]"));
  }
  if (q_len > INT32_MAX || kv_len > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".shape: ", ShapeString(shape),
                                                   ": sequence longer than 2^31"));
  }
  const size_t count = static_cast<size_t>(shape[0] * shape[1] * shape[2] * shape[3]);
  if (mask_bytes.size() != count * DTypeSize(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", mask_bytes.size(),
                                                   " bytes for ", DTypeName(dtype), " ",
                                                   ShapeString(shape)));
  }
  const std::vector<uint8_t> given = NonzeroElements(mask_bytes, dtype, count);
  DecodedMask out;
  out.batch = batch;
  out.q_len = q_len;
  out.kv_len = kv_len;
  const int64_t heads = shape[1];
  const int64_t plane = q_len * kv_len;

  // Broadcast to [batch, heads, q_len, kv_len].
  std::vector<uint8_t> full(static_cast<size_t>(batch * heads * plane));
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t gb = shape[0] == 1 ? 0 : b;
    for (int64_t h = 0; h < heads; ++h) {
      const uint8_t* src = given.data() + (gb * heads + h) * shape[2] * shape[3];
      uint8_t* dst = full.data() + (b * heads + h) * plane;
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t gi = shape[2] == 1 ? 0 : i;
        for (int64_t j = 0; j < kv_len; ++j) {
          dst[i * kv_len + j] = src[gi * shape[3] + (shape[3] == 1 ? 0 : j)];
        }
      }
    }
  }
  // A per-head mask whose heads are all alike is a shared one.
  bool heads_alike = true;
  for (int64_t b = 0; b < batch && heads_alike; ++b) {
    const uint8_t* first = full.data() + b * heads * plane;
    for (int64_t h = 1; h < heads && heads_alike; ++h) {
      heads_alike = std::memcmp(first, first + h * plane, static_cast<size_t>(plane)) == 0;
    }
  }
  out.heads = heads_alike ? 1 : heads;
  out.given_heads = heads;

  out.extents.q.resize(static_cast<size_t>(batch));
  out.extents.kv.resize(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    Extents(full.data() + b * heads * plane, heads, q_len, kv_len, &out.extents.q[b],
            &out.extents.kv[b]);
  }
  // A padding pattern first, else padding | causal, else elementwise.
  if (out.heads == 1) {
    for (bool causal : {false, true}) {
      bool pattern = true;
      for (int64_t b = 0; b < batch && pattern; ++b) {
        pattern = IsPaddingPattern(full.data() + b * heads * plane, q_len, kv_len, causal,
                                   out.extents.q[b], out.extents.kv[b]);
      }
      if (pattern) {
        out.seqlens = out.extents;
        out.with_causal = causal;
        break;
      }
    }
  }
  if (!out.seqlens || out.with_causal) {
    out.elementwise.resize(static_cast<size_t>(batch * out.heads * plane));
    for (int64_t b = 0; b < batch; ++b) {
      std::memcpy(&out.elementwise[b * out.heads * plane], full.data() + b * heads * plane,
                  static_cast<size_t>(out.heads * plane));
    }
  }
  return out;
}

absl::StatusOr<Tensor> UploadSeqlens(Ops& ops, const std::vector<int32_t>& lengths) {
  ASSIGN_OR_RETURN(Tensor tensor,
                   ops.Allocate(DType::kI32, {static_cast<int64_t>(lengths.size())}));
  if (!lengths.empty()) RETURN_IF_ERROR(ops.Upload(lengths.data(), &tensor));
  return tensor;
}

absl::StatusOr<MaskTensors> UploadMask(Ops& ops, const DecodedMask& mask) {
  MaskTensors out;
  ASSIGN_OR_RETURN(out.q_seqlens, UploadSeqlens(ops, mask.extents.q));
  ASSIGN_OR_RETURN(out.kv_seqlens, UploadSeqlens(ops, mask.extents.kv));
  out.with_causal = mask.seqlens.has_value() && mask.with_causal;
  out.given_heads = mask.given_heads;
  if (!mask.elementwise.empty()) {
    const Shape shape = mask.heads == 1
                            ? Shape{mask.batch, mask.q_len, mask.kv_len}
                            : Shape{mask.batch, mask.heads, mask.q_len, mask.kv_len};
    ASSIGN_OR_RETURN(out.elementwise, ops.Allocate(DType::kBool, shape));
    RETURN_IF_ERROR(ops.Upload(mask.elementwise.data(), &out.elementwise));
  }
  return out;
}

}  // namespace te::session
