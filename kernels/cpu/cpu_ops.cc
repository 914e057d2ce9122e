// The CPU reference backend: element access helpers and the ops of
// kernels/ops.h other than attention (attention.cc) and position encodings
// (position.cc). Work in progress: ops not yet written return UNIMPLEMENTED.
#include "kernels/cpu/cpu_ops.h"

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"

namespace te {

float LoadAsFloat(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::kF32: return t.data_as<const float>()[i];
    case DType::kBF16: return Bf16ToFloat(t.data_as<const uint16_t>()[i]);
    case DType::kF16: return Fp16ToFloat(t.data_as<const uint16_t>()[i]);
    case DType::kE4M3: return E4M3ToFloat(t.data_as<const uint8_t>()[i]);
    case DType::kE5M2: return E5M2ToFloat(t.data_as<const uint8_t>()[i]);
    case DType::kI32: return static_cast<float>(t.data_as<const int32_t>()[i]);
    case DType::kBool: return t.data_as<const uint8_t>()[i] ? 1.0f : 0.0f;
  }
  return 0.0f;
}

void StoreFromFloat(Tensor* t, int64_t i, float v) {
  switch (t->dtype()) {
    case DType::kF32: t->data_as<float>()[i] = v; return;
    case DType::kBF16: t->data_as<uint16_t>()[i] = FloatToBf16(v); return;
    case DType::kF16: t->data_as<uint16_t>()[i] = FloatToFp16(v); return;
    case DType::kE4M3: t->data_as<uint8_t>()[i] = FloatToE4M3(v); return;
    case DType::kE5M2: t->data_as<uint8_t>()[i] = FloatToE5M2(v); return;
    case DType::kI32: t->data_as<int32_t>()[i] = static_cast<int32_t>(v); return;
    case DType::kBool: t->data_as<uint8_t>()[i] = v != 0.0f ? 1 : 0; return;
  }
}

std::vector<float> ToFloatVector(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = LoadAsFloat(t, i);
  return v;
}

void FromFloatVector(const std::vector<float>& v, Tensor* t) {
  for (int64_t i = 0; i < t->numel(); ++i) StoreFromFloat(t, i, v[i]);
}

namespace {
absl::Status NotYet(const char* op) {
  return absl::UnimplementedError(absl::StrCat(op, ": not yet written on the CPU backend"));
}
}  // namespace

absl::StatusOr<std::shared_ptr<void>> CpuOps::AllocateBytes(size_t bytes) {
  const size_t rounded = (bytes + 63) / 64 * 64;  // aligned_alloc wants a multiple
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("host allocation of ", bytes, " bytes failed"));
  }
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

absl::Status CpuOps::Upload(const void* src, Tensor* dst) {
  if (dst->nbytes() > 0) std::memcpy(dst->data(), src, dst->nbytes());
  return absl::OkStatus();
}
absl::Status CpuOps::Download(const Tensor& src, void* dst) {
  if (src.nbytes() > 0) std::memcpy(dst, src.data(), src.nbytes());
  return absl::OkStatus();
}
absl::Status CpuOps::Copy(const Tensor& src, Tensor* dst) {
  if (src.nbytes() > 0) std::memmove(dst->data(), src.data(), src.nbytes());
  return absl::OkStatus();
}
absl::Status CpuOps::Fill(float, Tensor*) { return NotYet("Fill"); }
absl::Status CpuOps::Cast(const Tensor&, Tensor*) { return NotYet("Cast"); }
absl::Status CpuOps::Axpby(float, const Tensor&, float, const Tensor&, Tensor*) { return NotYet("Axpby"); }
absl::Status CpuOps::Permute(const Tensor&, const std::vector<int>&, Tensor*) { return NotYet("Permute"); }
absl::Status CpuOps::SumRows(const Tensor&, Tensor*) { return NotYet("SumRows"); }
absl::Status CpuOps::Quantize(const Tensor&, const Fp8Output&, Tensor*) { return NotYet("Quantize"); }
absl::Status CpuOps::Dequantize(const Tensor&, const Tensor&, Tensor*) { return NotYet("Dequantize"); }
absl::Status CpuOps::Amax(const Tensor&, Tensor*) { return NotYet("Amax"); }
absl::Status CpuOps::ScaleFromAmax(const Tensor&, float, float, float, Tensor*, Tensor*) { return NotYet("ScaleFromAmax"); }
absl::Status CpuOps::DelayedScalingUpdate(const DelayedScalingArgs&, Tensor*, Tensor*, Tensor*) { return NotYet("DelayedScalingUpdate"); }
absl::Status CpuOps::FakeQuantizeBlockScaled(BlockFormat, const Tensor&, Tensor*) { return NotYet("FakeQuantizeBlockScaled"); }
absl::Status CpuOps::Gemm(const GemmArgs&, Tensor*) { return NotYet("Gemm"); }
absl::Status CpuOps::NormForward(const NormArgs&, const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*, Tensor*, const Fp8Output*) { return NotYet("NormForward"); }
absl::Status CpuOps::NormBackward(const NormArgs&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor*, Tensor*, Tensor*) { return NotYet("NormBackward"); }
absl::Status CpuOps::ActivationForward(const std::vector<Activation>&, const Tensor&, Tensor*, const Fp8Output*) { return NotYet("ActivationForward"); }
absl::Status CpuOps::ActivationBackward(const std::vector<Activation>&, const Tensor&, const Tensor&, Tensor*) { return NotYet("ActivationBackward"); }
absl::Status CpuOps::DropoutForward(float, uint64_t, const Tensor&, Tensor*, Tensor*) { return NotYet("DropoutForward"); }
absl::Status CpuOps::DropoutBackward(float, const Tensor&, const Tensor&, Tensor*) { return NotYet("DropoutBackward"); }

}  // namespace te
