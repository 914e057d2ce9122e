#include "kernels/op_checks.h"

#include <cmath>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kernels/status_macros.h"

namespace te {
namespace {

std::string Describe(const Tensor& t) {
  return absl::StrCat(DTypeName(t.dtype()), " ", ShapeString(t.shape()));
}

}  // namespace

// ---- building blocks --------------------------------------------------------

bool IsComputeFloat(DType d) { return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16; }

absl::Status RequireDefined(const char* op, const char* name, const Tensor* t) {
  if (t == nullptr) return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is null"));
  if (t->numel() > 0 && t->data() == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is undefined"));
  }
  return absl::OkStatus();
}

absl::Status RequireFloat(const char* op, const char* name, const Tensor* t) {
  RETURN_IF_ERROR(RequireDefined(op, name, t));
  if (!IsComputeFloat(t->dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has dtype ",
                                                   DTypeName(t->dtype()),
                                                   ", want float32, bfloat16 or float16"));
  }
  return absl::OkStatus();
}

absl::Status RequireDType(const char* op, const char* name, const Tensor* t, DType want) {
  RETURN_IF_ERROR(RequireDefined(op, name, t));
  if (t->dtype() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", name, " has dtype ", DTypeName(t->dtype()), ", want ", DTypeName(want)));
  }
  return absl::OkStatus();
}

absl::Status RequireScalarF32(const char* op, const char* name, const Tensor* t) {
  RETURN_IF_ERROR(RequireDefined(op, name, t));
  if (t->dtype() != DType::kF32 || t->numel() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", Describe(*t), ", want float32 [1]"));
  }
  return absl::OkStatus();
}

absl::Status RequireShape(const char* op, const char* name, const Tensor& t, const Shape& want,
                          const std::string& want_text) {
  if (t.shape() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " has shape ", ShapeString(t.shape()), ", want ", want_text));
  }
  return absl::OkStatus();
}

absl::Status RequireShape(const char* op, const char* name, const Tensor& t, const Shape& want) {
  return RequireShape(op, name, t, want, ShapeString(want));
}

absl::Status RequireSameCount(const char* op, const char* name, const Tensor& t,
                              const char* other_name, const Tensor& other) {
  if (t.numel() != other.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", name, " has ", t.numel(), " elements ", ShapeString(t.shape()), ", want ",
        other.numel(), " like ", other_name, " ", ShapeString(other.shape())));
  }
  return absl::OkStatus();
}

absl::Status CheckOutput(const char* op, const Tensor* y, const Fp8Output* fp8) {
  RETURN_IF_ERROR(RequireDefined(op, "y", y));
  if (IsFloat8(y->dtype())) {
    if (fp8 == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": y has dtype ", DTypeName(y->dtype()),
                                                     " but no Fp8Output (scale, amax) is given"));
    }
    RETURN_IF_ERROR(RequireScalarF32(op, "fp8.scale", &fp8->scale));
    if (fp8->amax.defined()) RETURN_IF_ERROR(RequireScalarF32(op, "fp8.amax", &fp8->amax));
    RETURN_IF_ERROR(RequireScalarF32(op, "fp8.scale_inv", &fp8->scale_inv));
    return absl::OkStatus();
  }
  if (!IsComputeFloat(y->dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": y has dtype ", DTypeName(y->dtype()),
                                                   ", want float32, bfloat16, float16 or FP8"));
  }
  if (fp8 != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": an Fp8Output is given but y has dtype ",
                                                   DTypeName(y->dtype()), ", not FP8"));
  }
  return absl::OkStatus();
}

int64_t Rows(const Tensor& t) {
  const int64_t cols = t.rank() == 0 ? 1 : t.dim(-1);
  return cols == 0 ? 0 : t.numel() / cols;
}

bool Wanted(const Tensor* t) { return t != nullptr && t->data() != nullptr; }

absl::Status CheckDevicePosition(const char* op, const char* name, const Tensor& t) {
  RETURN_IF_ERROR(RequireDefined(op, name, &t));
  if (t.dtype() != DType::kI32 || t.numel() != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": ", name, " is ", Describe(t), ", want int32 with one element"));
  }
  return absl::OkStatus();
}

bool HasDevicePosition(const Tensor& t) { return t.defined() && t.numel() > 0; }

// ---- memory and elementwise -------------------------------------------------

absl::Status CheckUploadArgs(const void* src, const Tensor* dst) {
  RETURN_IF_ERROR(RequireDefined("Upload", "dst", dst));
  if (dst->nbytes() > 0 && src == nullptr) return absl::InvalidArgumentError("Upload: src is null");
  return absl::OkStatus();
}

absl::Status CheckDownloadArgs(const Tensor& src, const void* dst) {
  RETURN_IF_ERROR(RequireDefined("Download", "src", &src));
  if (src.nbytes() > 0 && dst == nullptr) {
    return absl::InvalidArgumentError("Download: dst is null");
  }
  return absl::OkStatus();
}

absl::Status CheckAddScalarI32Args(const Tensor* y) {
  return RequireDType("AddScalarI32", "y", y, DType::kI32);
}

absl::Status CheckCopyArgs(const Tensor& src, const Tensor* dst) {
  RETURN_IF_ERROR(RequireDefined("Copy", "src", &src));
  RETURN_IF_ERROR(RequireDefined("Copy", "dst", dst));
  RETURN_IF_ERROR(RequireDType("Copy", "dst", dst, src.dtype()));
  return RequireSameCount("Copy", "dst", *dst, "src", src);
}

absl::Status CheckCopyAllArgs(const std::vector<const Tensor*>& src,
                              const std::vector<Tensor*>& dst) {
  if (src.size() != dst.size()) {
    return absl::InvalidArgumentError(absl::StrCat("CopyAll: ", src.size(), " sources but ",
                                                   dst.size(), " destinations"));
  }
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("CopyAll: src[", i, "] is null"));
    }
    absl::Status pair = CheckCopyArgs(*src[i], dst[i]);
    if (!pair.ok()) {
      return absl::Status(pair.code(), absl::StrCat("CopyAll pair ", i, ": ", pair.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckCopyRowsAtArgs(const Tensor& src, const Tensor& position, const Tensor* dst) {
  const char* op = "CopyRowsAt";
  RETURN_IF_ERROR(RequireDefined(op, "src", &src));
  RETURN_IF_ERROR(RequireDefined(op, "dst", dst));
  RETURN_IF_ERROR(CheckDevicePosition(op, "position", position));
  if (src.rank() < 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": src must be [B, S, ...], got ", Describe(src)));
  }
  RETURN_IF_ERROR(RequireDType(op, "dst", dst, src.dtype()));
  // dst: src's shape with any L in place of S.
  Shape want = src.shape();
  std::vector<std::string> want_text;
  for (int i = 0; i < src.rank(); ++i) {
    want_text.push_back(i == 1 ? "L" : absl::StrCat(src.dim(i)));
  }
  if (dst->rank() == src.rank()) want[1] = dst->dim(1);
  return RequireShape(op, "dst", *dst, want,
                      absl::StrCat("[", absl::StrJoin(want_text, ", "), "] like src ",
                                   ShapeString(src.shape())));
}

absl::Status CheckDecodeQkvRowsArgs(const Tensor& qkv, const RotaryArgs* rotary,
                                    const Tensor& position, const Tensor* q,
                                    const Tensor* key_cache, const Tensor* value_cache) {
  const char* op = "DecodeQkvRows";
  RETURN_IF_ERROR(CheckPackedQkv(op, "qkv", qkv));
  RETURN_IF_ERROR(RequireDefined(op, "q", q));
  RETURN_IF_ERROR(CheckDevicePosition(op, "position", position));
  const Shape part = {qkv.dim(0), qkv.dim(1), qkv.dim(3), qkv.dim(4)};
  RETURN_IF_ERROR(RequireDType(op, "q", q, qkv.dtype()));
  RETURN_IF_ERROR(RequireShape(op, "q", *q, part, ShapeString(part)));
  for (const auto& [name, cache] : {std::pair<const char*, const Tensor*>{"key_cache", key_cache},
                                    {"value_cache", value_cache}}) {
    RETURN_IF_ERROR(RequireDefined(op, name, cache));
    RETURN_IF_ERROR(RequireDType(op, name, cache, qkv.dtype()));
    const Shape want = {part[0], cache->rank() == 4 ? cache->dim(1) : 0, part[2], part[3]};
    RETURN_IF_ERROR(RequireShape(
        op, name, *cache, want,
        absl::StrCat("[", part[0], ", L, ", part[2], ", ", part[3], "] (qkv's B, H, D)")));
  }
  if (rotary != nullptr) RETURN_IF_ERROR(CheckRotaryArgs(*rotary, *q, q));
  return absl::OkStatus();
}

absl::Status CheckCastArgs(const Tensor& x, const Tensor* y) {
  RETURN_IF_ERROR(RequireFloat("Cast", "x", &x));
  RETURN_IF_ERROR(RequireFloat("Cast", "y", y));
  return RequireSameCount("Cast", "y", *y, "x", x);
}

absl::Status CheckAxpbyArgs(float alpha, const Tensor& a, float beta, const Tensor& b,
                            const Tensor* y) {
  RETURN_IF_ERROR(RequireFloat("Axpby", "y", y));
  if (alpha != 0.0f) {
    RETURN_IF_ERROR(RequireFloat("Axpby", "a", &a));
    RETURN_IF_ERROR(RequireSameCount("Axpby", "a", a, "y", *y));
  }
  if (beta != 0.0f) {
    RETURN_IF_ERROR(RequireFloat("Axpby", "b", &b));
    RETURN_IF_ERROR(RequireSameCount("Axpby", "b", b, "y", *y));
  }
  return absl::OkStatus();
}

// Any dtype: elements are moved as bytes.
absl::Status CheckPermuteArgs(const Tensor& x, const std::vector<int>& perm, const Tensor* y) {
  RETURN_IF_ERROR(RequireDefined("Permute", "x", &x));
  RETURN_IF_ERROR(RequireDefined("Permute", "y", y));
  RETURN_IF_ERROR(RequireDType("Permute", "y", y, x.dtype()));
  const int rank = x.rank();
  if (rank > kPermuteMaxRank) {
    return absl::InvalidArgumentError(absl::StrCat("Permute: x has rank ", rank, " (",
                                                   ShapeString(x.shape()),
                                                   "), want <= ", kPermuteMaxRank));
  }
  std::vector<bool> seen(rank, false);
  bool valid = static_cast<int>(perm.size()) == rank;
  for (size_t i = 0; valid && i < perm.size(); ++i) {
    valid = perm[i] >= 0 && perm[i] < rank && !seen[perm[i]];
    if (valid) seen[perm[i]] = true;
  }
  if (!valid) {
    return absl::InvalidArgumentError(absl::StrCat("Permute: perm [", absl::StrJoin(perm, ", "),
                                                   "] is not a permutation of x's ", rank,
                                                   " dimensions"));
  }
  Shape want(rank);
  for (int i = 0; i < rank; ++i) want[i] = x.dim(perm[i]);
  return RequireShape("Permute", "y", *y, want);
}

absl::Status CheckDotArgs(const Tensor& a, const Tensor& b, const Tensor* out) {
  RETURN_IF_ERROR(RequireFloat("Dot", "a", &a));
  RETURN_IF_ERROR(RequireFloat("Dot", "b", &b));
  RETURN_IF_ERROR(RequireDType("Dot", "b", &b, a.dtype()));
  if (a.numel() != b.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("Dot: b has ", b.numel(),
                                                   " elements, want a's ", a.numel()));
  }
  RETURN_IF_ERROR(RequireDefined("Dot", "out", out));
  RETURN_IF_ERROR(RequireDType("Dot", "out", out, DType::kF32));
  if (out->numel() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("Dot: out has shape ",
                                                   ShapeString(out->shape()),
                                                   ", want one element"));
  }
  return absl::OkStatus();
}

absl::Status CheckSumRowsArgs(const Tensor& x, const Tensor* y) {
  RETURN_IF_ERROR(RequireFloat("SumRows", "x", &x));
  RETURN_IF_ERROR(RequireFloat("SumRows", "y", y));
  if (x.rank() < 1) return absl::InvalidArgumentError("SumRows: x is a scalar, want [N, H]");
  const int64_t h = x.dim(-1);
  return RequireShape("SumRows", "y", *y, {h}, absl::StrCat("[H=", h, "]"));
}

// ---- FP8 scaling ------------------------------------------------------------

namespace {

absl::Status RequireFp8(const char* op, const char* name, const Tensor& t) {
  if (!IsFloat8(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has dtype ",
                                                   DTypeName(t.dtype()),
                                                   ", want float8_e4m3fn or float8_e5m2"));
  }
  return absl::OkStatus();
}

absl::Status RequireFp8Max(const char* op, float fp8_max) {
  if (!(fp8_max > 0.0f) || !std::isfinite(fp8_max)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": fp8_max is ", fp8_max, ", want a positive finite value"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckQuantizeArgs(const Tensor& x, const Fp8Output& fp8, const Tensor* y) {
  RETURN_IF_ERROR(RequireFloat("Quantize", "x", &x));
  RETURN_IF_ERROR(RequireDefined("Quantize", "y", y));
  RETURN_IF_ERROR(RequireFp8("Quantize", "y", *y));
  RETURN_IF_ERROR(RequireSameCount("Quantize", "y", *y, "x", x));
  return CheckOutput("Quantize", y, &fp8);
}

absl::Status CheckQuantizeTransposeArgs(const Tensor& x, const Fp8Output& fp8, const Tensor* y,
                                        const Tensor* y_t) {
  RETURN_IF_ERROR(CheckQuantizeArgs(x, fp8, y));
  RETURN_IF_ERROR(RequireDefined("QuantizeTranspose", "y_t", y_t));
  if (x.rank() != 2 || y->shape() != x.shape()) {
    return absl::InvalidArgumentError(absl::StrCat("QuantizeTranspose: x must be 2-D and y its shape; x is ",
                                                   ShapeString(x.shape()), ", y ", ShapeString(y->shape())));
  }
  const Shape want_t = {x.dim(1), x.dim(0)};
  if (y_t->shape() != want_t || y_t->dtype() != y->dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "QuantizeTranspose: y_t must be ", DTypeName(y->dtype()), " ", ShapeString(want_t), "; got ",
        DTypeName(y_t->dtype()), " ", ShapeString(y_t->shape())));
  }
  return absl::OkStatus();
}

absl::Status CheckDequantizeArgs(const Tensor& x, const Tensor& scale_inv, const Tensor* y) {
  RETURN_IF_ERROR(RequireDefined("Dequantize", "x", &x));
  RETURN_IF_ERROR(RequireFp8("Dequantize", "x", x));
  RETURN_IF_ERROR(RequireScalarF32("Dequantize", "scale_inv", &scale_inv));
  RETURN_IF_ERROR(RequireFloat("Dequantize", "y", y));
  return RequireSameCount("Dequantize", "y", *y, "x", x);
}

// Any floating dtype; FP8 values are read unscaled.
absl::Status CheckAmaxArgs(const Tensor& x, const Tensor* amax) {
  RETURN_IF_ERROR(RequireDefined("Amax", "x", &x));
  if (!IsFloating(x.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("Amax: x has dtype ", DTypeName(x.dtype()), ", want a floating dtype"));
  }
  return RequireScalarF32("Amax", "amax", amax);
}

absl::Status CheckScaleFromAmaxArgs(const Tensor& amax, float fp8_max, float epsilon,
                                    const Tensor* scale, const Tensor* scale_inv) {
  RETURN_IF_ERROR(RequireScalarF32("ScaleFromAmax", "amax", &amax));
  RETURN_IF_ERROR(RequireScalarF32("ScaleFromAmax", "scale", scale));
  RETURN_IF_ERROR(RequireScalarF32("ScaleFromAmax", "scale_inv", scale_inv));
  RETURN_IF_ERROR(RequireFp8Max("ScaleFromAmax", fp8_max));
  if (!(epsilon >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("ScaleFromAmax: epsilon is ", epsilon, ", want >= 0"));
  }
  return absl::OkStatus();
}

absl::Status CheckDelayedScalingArgs(const DelayedScalingArgs& args, const Tensor* amax_history,
                                     const Tensor* scale, const Tensor* scale_inv) {
  const char* op = "DelayedScalingUpdate";
  RETURN_IF_ERROR(RequireDType(op, "amax_history", amax_history, DType::kF32));
  if (amax_history->rank() != 1 || amax_history->numel() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": amax_history has shape ", ShapeString(amax_history->shape()), ", want [L], L >= 1"));
  }
  RETURN_IF_ERROR(RequireScalarF32(op, "scale", scale));
  if (scale_inv != nullptr) RETURN_IF_ERROR(RequireScalarF32(op, "scale_inv", scale_inv));
  return RequireFp8Max(op, args.fp8_max);
}

absl::Status CheckDelayedScalingUpdatesArgs(const std::vector<Ops::DelayedScalingItem>& items,
                                            const Tensor* non_finite) {
  for (const Ops::DelayedScalingItem& item : items) {
    RETURN_IF_ERROR(CheckDelayedScalingArgs(item.args, &item.amax_history, &item.scale, nullptr));
  }
  if (non_finite == nullptr) return absl::OkStatus();
  return RequireScalarF32("DelayedScalingUpdates", "non_finite", non_finite);
}

absl::Status CheckKeptQuantization(const Fp8Output& fp8, const Ops::KeptQuantization& kept) {
  const char* op = "QuantizeTransposeKept";
  // The record keeps the amax the copy was made with, so one is recorded.
  RETURN_IF_ERROR(RequireScalarF32(op, "fp8.amax", &fp8.amax));
  RETURN_IF_ERROR(RequireScalarF32(op, "kept.scale", &kept.scale));
  return RequireScalarF32(op, "kept.amax", &kept.amax);
}

absl::Status CheckQuantizeTransposeKeptManyArgs(const std::vector<Ops::KeptQuantizeItem>& items) {
  std::set<const void*> written;
  for (size_t i = 0; i < items.size(); ++i) {
    const Ops::KeptQuantizeItem& item = items[i];
    Tensor y = item.y, y_t = item.y_t;
    absl::Status status = CheckQuantizeTransposeArgs(item.x, item.fp8, &y, &y_t);
    if (status.ok()) status = CheckKeptQuantization(item.fp8, item.kept);
    for (const Tensor* t : {&item.y, &item.y_t, &item.fp8.amax, &item.fp8.scale_inv,
                            &item.kept.scale, &item.kept.amax}) {
      if (!status.ok()) break;
      if (t->defined() && !written.insert(t->data()).second) {
        status = absl::InvalidArgumentError(
            "QuantizeTransposeKeptMany: an output or record shared with an earlier item");
      }
    }
    if (!status.ok()) {
      return absl::Status(status.code(), absl::StrCat("items[", i, "]: ", status.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFakeQuantizeBlockScaledArgs(BlockFormat format, const Tensor& x,
                                              const Tensor* y) {
  const char* op = "FakeQuantizeBlockScaled";
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  RETURN_IF_ERROR(RequireFloat(op, "y", y));
  RETURN_IF_ERROR(RequireShape(op, "y", *y, x.shape()));
  if (x.rank() < 1) return absl::InvalidArgumentError(absl::StrCat(op, ": x is a scalar"));
  const bool mxfp8 = format == BlockFormat::kMXFP8;
  const int block = mxfp8 ? kMxfp8BlockSize : kNvfp4BlockSize;
  if (x.dim(-1) % block != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": x has last dimension ", x.dim(-1), ", want a multiple of the ",
                     mxfp8 ? "MXFP8" : "NVFP4", " block size ", block));
  }
  return absl::OkStatus();
}

// ---- GEMM -------------------------------------------------------------------

namespace {

absl::Status CheckGemmOperand(const char* name, const char* scale_name, const Tensor& t,
                              const Tensor& scale_inv) {
  RETURN_IF_ERROR(RequireDefined("Gemm", name, &t));
  if (t.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: ", name, " has shape ", ShapeString(t.shape()), ", want rank 2"));
  }
  if (IsFloat8(t.dtype())) {
    if (scale_inv.data() == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("Gemm: ", name, " is ", DTypeName(t.dtype()),
                                                     " but ", scale_name, " is undefined"));
    }
    return RequireScalarF32("Gemm", scale_name, &scale_inv);
  }
  RETURN_IF_ERROR(RequireFloat("Gemm", name, &t));
  if (scale_inv.data() != nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: ", scale_name, " is given but ", name,
                                                   " is ", DTypeName(t.dtype()),
                                                   "; scale_inv applies to FP8 operands only"));
  }
  return absl::OkStatus();
}

}  // namespace

namespace {

// A tensor the epilogue reads or writes alongside out: [M, N] in out's dtype.
absl::Status RequireLikeOut(const char* name, const Tensor& t, const Tensor& out) {
  RETURN_IF_ERROR(RequireShape("Gemm", name, t, out.shape()));
  if (t.dtype() != out.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: ", name, " has dtype ",
                                                   DTypeName(t.dtype()), ", want out's ",
                                                   DTypeName(out.dtype())));
  }
  return absl::OkStatus();
}

absl::Status CheckGemmEpilogue(const Ops::GemmArgs& args, const Tensor& out) {
  const bool gelu = args.epilogue == Ops::GemmEpilogue::kGeluAux;
  if (args.residual.defined()) {
    RETURN_IF_ERROR(RequireLikeOut("residual", args.residual, out));
    if (args.accumulate || gelu) {
      return absl::InvalidArgumentError(
          "Gemm: residual is given with accumulate or an activation epilogue; it is a plain "
          "residual add after the projection");
    }
  }
  if (!gelu) {
    if (args.aux.defined()) {
      return absl::InvalidArgumentError("Gemm: aux belongs to the kGeluAux epilogue");
    }
    return absl::OkStatus();
  }
  if (args.accumulate) {
    return absl::InvalidArgumentError("Gemm: the kGeluAux epilogue excludes accumulate");
  }
  if (!args.aux.defined()) {
    return absl::InvalidArgumentError(
        "Gemm: the kGeluAux epilogue needs aux (the [M, N] pre-activation)");
  }
  return RequireLikeOut("aux", args.aux, out);
}

}  // namespace

absl::StatusOr<GemmDims> CheckGemmArgs(const Ops::GemmArgs& args, const Tensor* out) {
  RETURN_IF_ERROR(CheckGemmOperand("a", "a_scale_inv", args.a, args.a_scale_inv));
  RETURN_IF_ERROR(CheckGemmOperand("b", "b_scale_inv", args.b, args.b_scale_inv));
  if (IsFloat8(args.a.dtype()) != IsFloat8(args.b.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: a is ", DTypeName(args.a.dtype()),
                                                   " and b is ", DTypeName(args.b.dtype()),
                                                   "; operands are both float or both FP8"));
  }
  GemmDims dims;
  dims.m = args.transpose_a ? args.a.dim(1) : args.a.dim(0);
  dims.k = args.transpose_a ? args.a.dim(0) : args.a.dim(1);
  const int64_t k = dims.k;
  const Shape b_want = args.transpose_b ? Shape{args.b.dim(0), k} : Shape{k, args.b.dim(1)};
  if (args.b.shape() != b_want) {
    return absl::InvalidArgumentError(
        absl::StrCat("Gemm: b has shape ", ShapeString(args.b.shape()), ", want ",
                     args.transpose_b ? absl::StrCat("[N, K=", k, "] (transpose_b)")
                                      : absl::StrCat("[K=", k, ", N]")));
  }
  dims.n = args.transpose_b ? args.b.dim(0) : args.b.dim(1);
  RETURN_IF_ERROR(RequireFloat("Gemm", "out", out));
  RETURN_IF_ERROR(RequireShape("Gemm", "out", *out, {dims.m, dims.n},
                               absl::StrCat("[M=", dims.m, ", N=", dims.n, "]")));
  if (args.bias.data() != nullptr) {
    RETURN_IF_ERROR(RequireFloat("Gemm", "bias", &args.bias));
    RETURN_IF_ERROR(
        RequireShape("Gemm", "bias", args.bias, {dims.n}, absl::StrCat("[N=", dims.n, "]")));
    if (args.accumulate) {
      return absl::InvalidArgumentError(
          "Gemm: bias is given with accumulate; add it once, "
          "on the first GEMM that writes out");
    }
  }
  RETURN_IF_ERROR(CheckGemmEpilogue(args, *out));
  return dims;
}

// ---- normalisation ----------------------------------------------------------

namespace {

// x: float [..., H], rank >= 1.
absl::StatusOr<NormDims> CheckNormInput(const char* op, const Tensor& x) {
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  if (x.rank() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x is a scalar, want [N, H]"));
  }
  NormDims dims;
  dims.hidden = x.dim(-1);
  dims.rows = Rows(x);
  return dims;
}

// gamma, beta and their gradients: float [H].
absl::Status CheckNormParam(const char* op, const char* name, const Tensor* t,
                            const NormDims& dims) {
  RETURN_IF_ERROR(RequireFloat(op, name, t));
  return RequireShape(op, name, *t, {dims.hidden}, absl::StrCat("[H=", dims.hidden, "]"));
}

// mu and rsigma: float32 [N].
absl::Status CheckNormStatistic(const char* op, const char* name, const Tensor* t,
                                const NormDims& dims) {
  RETURN_IF_ERROR(RequireDType(op, name, t, DType::kF32));
  return RequireShape(op, name, *t, {dims.rows}, absl::StrCat("[N=", dims.rows, "]"));
}

}  // namespace

absl::StatusOr<NormDims> CheckNormForwardArgs(const NormArgs& args, const Tensor& x,
                                              const Tensor& gamma, const Tensor& beta,
                                              const Tensor* y, const Tensor* mu,
                                              const Tensor* rsigma, const Fp8Output* fp8) {
  const char* op = "NormForward";
  const bool layernorm = args.type == NormType::kLayerNorm;
  ASSIGN_OR_RETURN(const NormDims dims, CheckNormInput(op, x));
  RETURN_IF_ERROR(CheckNormParam(op, "gamma", &gamma, dims));
  if (layernorm) {
    RETURN_IF_ERROR(CheckNormParam(op, "beta", &beta, dims));
  } else if (beta.data() != nullptr) {
    return absl::InvalidArgumentError("NormForward: beta is given for RMSNorm, which has none");
  }
  RETURN_IF_ERROR(CheckOutput(op, y, fp8));
  RETURN_IF_ERROR(RequireShape(op, "y", *y, x.shape()));
  if (layernorm && Wanted(mu)) RETURN_IF_ERROR(CheckNormStatistic(op, "mu", mu, dims));
  if (Wanted(rsigma)) RETURN_IF_ERROR(CheckNormStatistic(op, "rsigma", rsigma, dims));
  if (!(args.epsilon >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("NormForward: epsilon is ", args.epsilon, ", want >= 0"));
  }
  return dims;
}

absl::Status CheckNormForwardTransposedArgs(const NormArgs& args, const Tensor& x,
                                            const Tensor& gamma, const Tensor& beta,
                                            const Fp8Output& fp8, const Tensor* y,
                                            const Tensor* y_t, const Tensor* mu,
                                            const Tensor* rsigma) {
  const char* op = "NormForwardTransposed";
  ASSIGN_OR_RETURN(const NormDims dims,
                   CheckNormForwardArgs(args, x, gamma, beta, y, mu, rsigma, &fp8));
  if (!IsFloat8(y->dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": y has dtype ", DTypeName(y->dtype()), ", want E4M3 or E5M2"));
  }
  RETURN_IF_ERROR(RequireDefined(op, "y_t", y_t));
  RETURN_IF_ERROR(RequireDType(op, "y_t", y_t, y->dtype()));
  return RequireShape(op, "y_t", *y_t, {dims.hidden, dims.rows});
}

absl::StatusOr<NormDims> CheckNormBackwardArgs(const NormArgs& args, const Tensor& dy,
                                               const Tensor& x, const Tensor& mu,
                                               const Tensor& rsigma, const Tensor& gamma,
                                               const Tensor* dx, const Tensor* dgamma,
                                               const Tensor* dbeta,
                                               const Tensor& residual_grad) {
  const char* op = "NormBackward";
  const bool layernorm = args.type == NormType::kLayerNorm;
  ASSIGN_OR_RETURN(const NormDims dims, CheckNormInput(op, x));
  RETURN_IF_ERROR(RequireFloat(op, "dy", &dy));
  RETURN_IF_ERROR(RequireShape(op, "dy", dy, x.shape()));
  if (layernorm) RETURN_IF_ERROR(CheckNormStatistic(op, "mu", &mu, dims));
  RETURN_IF_ERROR(CheckNormStatistic(op, "rsigma", &rsigma, dims));
  RETURN_IF_ERROR(CheckNormParam(op, "gamma", &gamma, dims));
  RETURN_IF_ERROR(RequireFloat(op, "dx", dx));
  RETURN_IF_ERROR(RequireShape(op, "dx", *dx, x.shape()));
  RETURN_IF_ERROR(CheckNormParam(op, "dgamma", dgamma, dims));
  if (layernorm) RETURN_IF_ERROR(CheckNormParam(op, "dbeta", dbeta, dims));
  if (residual_grad.defined()) {
    RETURN_IF_ERROR(RequireShape(op, "residual_grad", residual_grad, x.shape()));
    if (residual_grad.dtype() != dx->dtype()) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": residual_grad has dtype ",
                                                     DTypeName(residual_grad.dtype()),
                                                     ", want dx's ", DTypeName(dx->dtype())));
    }
  }
  return dims;
}

// ---- activations and dropout ------------------------------------------------

namespace {

// x [..., n * I] with n = acts.size(): returns I.
absl::StatusOr<int64_t> GatedWidth(const char* op, const std::vector<Activation>& acts,
                                   const Tensor& x) {
  if (acts.size() != 1 && acts.size() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": acts has ", acts.size(), " entries, want 1 or 2 (a gated pair)"));
  }
  if (x.rank() < 1) return absl::InvalidArgumentError(absl::StrCat(op, ": x is a scalar"));
  const int64_t n = static_cast<int64_t>(acts.size());
  if (x.dim(-1) % n != 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x has last dimension ", x.dim(-1),
                                                   ", want a multiple of ", n, " (n * I)"));
  }
  return x.dim(-1) / n;
}

absl::Status CheckDropoutRate(const char* op, float rate) {
  if (!(rate >= 0.0f && rate <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": rate is ", rate, ", want [0, 1]"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<int64_t> CheckActivationForwardArgs(const std::vector<Activation>& acts,
                                                   const Tensor& x, const Tensor* y,
                                                   const Fp8Output* fp8) {
  const char* op = "ActivationForward";
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  ASSIGN_OR_RETURN(const int64_t width, GatedWidth(op, acts, x));
  RETURN_IF_ERROR(CheckOutput(op, y, fp8));
  Shape want = x.shape();
  want.back() = width;
  RETURN_IF_ERROR(RequireShape(op, "y", *y, want));
  return width;
}

absl::StatusOr<int64_t> CheckActivationForwardTransposedArgs(const std::vector<Activation>& acts,
                                                             const Tensor& x,
                                                             const Fp8Output& fp8,
                                                             const Tensor* y, const Tensor* y_t) {
  const char* op = "ActivationForwardTransposed";
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationForwardArgs(acts, x, y, &fp8));
  if (!IsFloat8(y->dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": y must be FP8, got ", DTypeName(y->dtype())));
  }
  if (y_t == nullptr || !y_t->defined() || y_t->dtype() != y->dtype()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": y_t must be defined, of y's dtype ", DTypeName(y->dtype())));
  }
  const int64_t rows = width > 0 ? y->numel() / width : 0;
  RETURN_IF_ERROR(RequireShape(op, "y_t", *y_t, {width, rows}));
  return width;
}

absl::StatusOr<int64_t> CheckActivationBackwardArgs(const std::vector<Activation>& acts,
                                                    const Tensor& dy, const Tensor& x,
                                                    const Tensor* dx) {
  const char* op = "ActivationBackward";
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  ASSIGN_OR_RETURN(const int64_t width, GatedWidth(op, acts, x));
  RETURN_IF_ERROR(RequireFloat(op, "dy", &dy));
  Shape dy_want = x.shape();
  dy_want.back() = width;
  RETURN_IF_ERROR(RequireShape(op, "dy", dy, dy_want));
  RETURN_IF_ERROR(RequireFloat(op, "dx", dx));
  RETURN_IF_ERROR(RequireShape(op, "dx", *dx, x.shape()));
  return width;
}

absl::StatusOr<int64_t> CheckActivationBackwardQuantizeTransposeArgs(
    const std::vector<Activation>& acts, const Tensor* dy, const Tensor& x,
    const Fp8Output& fp8, const Tensor* y, const Tensor* y_t, const Tensor* dbias) {
  const char* op = "ActivationBackwardQuantizeTranspose";
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  if (x.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": x must be 2-D [N, n * I], got ", ShapeString(x.shape())));
  }
  ASSIGN_OR_RETURN(const int64_t width, GatedWidth(op, acts, x));
  RETURN_IF_ERROR(RequireFloat(op, "dy", dy));
  RETURN_IF_ERROR(RequireShape(op, "dy", *dy, {x.dim(0), width}));
  // The quantization's and the column sums' own checks, under this op's name.
  absl::Status s = CheckQuantizeTransposeArgs(x, fp8, y, y_t);
  if (s.ok() && dbias != nullptr) s = CheckSumRowsArgs(x, dbias);
  if (!s.ok()) return absl::InvalidArgumentError(absl::StrCat(op, ": ", s.message()));
  return width;
}

absl::Status CheckDropoutForwardArgs(float rate, const Tensor& x, const Tensor* y,
                                     const Tensor* mask) {
  const char* op = "DropoutForward";
  RETURN_IF_ERROR(CheckDropoutRate(op, rate));
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  RETURN_IF_ERROR(RequireFloat(op, "y", y));
  RETURN_IF_ERROR(RequireShape(op, "y", *y, x.shape()));
  if (Wanted(mask)) {
    RETURN_IF_ERROR(RequireDType(op, "mask", mask, DType::kBool));
    RETURN_IF_ERROR(RequireShape(op, "mask", *mask, x.shape()));
  }
  return absl::OkStatus();
}

absl::Status CheckDropoutBackwardArgs(float rate, const Tensor& dy, const Tensor& mask,
                                      const Tensor* dx) {
  const char* op = "DropoutBackward";
  RETURN_IF_ERROR(CheckDropoutRate(op, rate));
  RETURN_IF_ERROR(RequireFloat(op, "dy", &dy));
  RETURN_IF_ERROR(RequireDType(op, "mask", &mask, DType::kBool));
  RETURN_IF_ERROR(RequireShape(op, "mask", mask, dy.shape()));
  RETURN_IF_ERROR(RequireFloat(op, "dx", dx));
  return RequireShape(op, "dx", *dx, dy.shape());
}

// ---- attention --------------------------------------------------------------

namespace {

// A float tensor of the given shape (q, k, v, out and their gradients).
absl::Status CheckFloatTensor(const char* op, const char* name, const Tensor* t,
                              const Shape& shape) {
  RETURN_IF_ERROR(RequireFloat(op, name, t));
  return RequireShape(op, name, *t, shape);
}

// q, k, v, and the AttentionArgs tensors.
absl::StatusOr<AttentionShape> CheckAttentionInputs(const char* op, const AttentionArgs& args,
                                                    const Tensor& q, const Tensor& k,
                                                    const Tensor& v) {
  RETURN_IF_ERROR(RequireDefined(op, "q", &q));
  RETURN_IF_ERROR(RequireDefined(op, "k", &k));
  if (q.rank() != 4 || k.rank() != 4) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": q and k must be [B, S, H, D], got q ",
                                                   ShapeString(q.shape()), " and k ",
                                                   ShapeString(k.shape())));
  }
  AttentionShape s;
  s.batch = q.dim(0);
  s.q_seq = q.dim(1);
  s.q_heads = q.dim(2);
  s.head_dim = q.dim(3);
  s.kv_seq = k.dim(1);
  s.kv_heads = k.dim(2);
  if (s.kv_heads <= 0 || s.q_heads % s.kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": q heads (", s.q_heads, ") must be a multiple of k heads (", s.kv_heads, ")"));
  }
  RETURN_IF_ERROR(CheckFloatTensor(op, "q", &q, q.shape()));
  const Shape kv_shape = {s.batch, s.kv_seq, s.kv_heads, s.head_dim};
  RETURN_IF_ERROR(CheckFloatTensor(op, "k", &k, kv_shape));
  RETURN_IF_ERROR(CheckFloatTensor(op, "v", &v, kv_shape));
  if (args.bias.defined()) {
    if (args.bias.dtype() != DType::kF32) {
      RETURN_IF_ERROR(RequireDType(op, "bias (float32 or q's dtype)", &args.bias, q.dtype()));
    }
    RETURN_IF_ERROR(RequireShape(op, "bias", args.bias, {s.q_heads, s.q_seq, s.kv_seq}));
  }
  if (args.relative_bias.defined()) {
    const AttentionArgs::RelativeBiasTable& r = args.relative_bias;
    if (args.bias.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": bias and relative_bias are two ways to give one bias; give one"));
    }
    if (r.table.dtype() != DType::kF32) {
      RETURN_IF_ERROR(
          RequireDType(op, "relative_bias.table (float32 or q's dtype)", &r.table, q.dtype()));
    }
    if (r.table.rank() != 2 || r.table.dim(0) != s.q_heads || r.table.dim(1) < 1) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": relative_bias.table is ",
                                                     Describe(r.table), ", want [", s.q_heads,
                                                     " (q heads), buckets]"));
    }
    RETURN_IF_ERROR(RequireDType(op, "relative_bias.buckets", &r.buckets, DType::kI32));
    if (r.buckets.rank() != 2 || r.buckets.dim(1) != s.kv_seq ||
        (!r.first_row.defined() && r.buckets.dim(0) != s.q_seq)) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": relative_bias.buckets is ", Describe(r.buckets), ", want [",
          r.first_row.defined() ? "rows" : std::to_string(s.q_seq), ", ", s.kv_seq, "]"));
    }
    if (r.first_row.defined()) {
      RETURN_IF_ERROR(CheckDevicePosition(op, "relative_bias.first_row", r.first_row));
    }
  }
  if (!(args.dropout_rate >= 0.0f && args.dropout_rate < 1.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": dropout_rate must be in [0, 1), got ", args.dropout_rate));
  }
  if (args.elementwise_mask.defined()) {
    RETURN_IF_ERROR(RequireDType(op, "elementwise_mask", &args.elementwise_mask, DType::kBool));
    // Shared over the heads, or one plane per query head.
    const Shape shared = {s.batch, s.q_seq, s.kv_seq};
    const Shape per_head = {s.batch, s.q_heads, s.q_seq, s.kv_seq};
    if (args.elementwise_mask.shape() != shared && args.elementwise_mask.shape() != per_head) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": elementwise_mask has shape ", ShapeString(args.elementwise_mask.shape()),
          ", want ", ShapeString(shared), " or ", ShapeString(per_head)));
    }
  }
  if (IsPaddingMask(args.mask)) {
    for (const auto& [name, lengths] :
         {std::pair<const char*, const Tensor*>{"q_seqlens", &args.q_seqlens},
          {"kv_seqlens", &args.kv_seqlens}}) {
      if (!lengths->defined() || lengths->dtype() != DType::kI32 ||
          lengths->shape() != Shape{s.batch}) {
        return absl::InvalidArgumentError(
            absl::StrCat(op, ": a padding mask needs ", name, " as int32 [", s.batch, "], got ",
                         lengths->defined() ? Describe(*lengths) : std::string("none")));
      }
    }
  }
  return s;
}

// softmax_lse: float32 [B, Hq, Sq].
absl::Status CheckSoftmaxLse(const char* op, const Tensor* lse, const AttentionShape& s) {
  RETURN_IF_ERROR(RequireDType(op, "softmax_lse", lse, DType::kF32));
  return RequireShape(op, "softmax_lse", *lse, {s.batch, s.q_heads, s.q_seq});
}

}  // namespace

absl::Status CheckPackedQkv(const char* op, const char* name, const Tensor& qkv) {
  RETURN_IF_ERROR(RequireFloat(op, name, &qkv));
  if (qkv.rank() != 5 || qkv.dim(2) != 3) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " has shape ",
                                                   ShapeString(qkv.shape()),
                                                   ", want [B, S, 3, H, D]"));
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionShape> CheckAttentionForwardArgs(const AttentionArgs& args, const Tensor& q,
                                                         const Tensor& k, const Tensor& v,
                                                         const Tensor* out,
                                                         const Tensor* softmax_lse) {
  const char* op = "AttentionForward";
  ASSIGN_OR_RETURN(const AttentionShape s, CheckAttentionInputs(op, args, q, k, v));
  RETURN_IF_ERROR(CheckFloatTensor(op, "out", out, q.shape()));
  RETURN_IF_ERROR(CheckSoftmaxLse(op, softmax_lse, s));
  return s;
}

absl::StatusOr<AttentionShape> CheckAttentionBackwardArgs(
    const AttentionArgs& args, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& dout, const Tensor& softmax_lse, const Tensor* dq, const Tensor* dk,
    const Tensor* dv, const Tensor* dbias) {
  const char* op = "AttentionBackward";
  if (args.relative_bias.defined()) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": relative_bias is forward only; a backward takes the bias made "
            "(WithRelativeBiasMade) and its table's gradient through AttentionBackwardRelative"));
  }
  ASSIGN_OR_RETURN(const AttentionShape s, CheckAttentionInputs(op, args, q, k, v));
  RETURN_IF_ERROR(CheckFloatTensor(op, "out", &out, q.shape()));
  RETURN_IF_ERROR(CheckFloatTensor(op, "dout", &dout, q.shape()));
  RETURN_IF_ERROR(CheckSoftmaxLse(op, &softmax_lse, s));
  RETURN_IF_ERROR(CheckFloatTensor(op, "dq", dq, q.shape()));
  RETURN_IF_ERROR(CheckFloatTensor(op, "dk", dk, k.shape()));
  RETURN_IF_ERROR(CheckFloatTensor(op, "dv", dv, v.shape()));
  if (args.bias.defined()) {
    RETURN_IF_ERROR(RequireDType(op, "dbias", dbias, DType::kF32));
    RETURN_IF_ERROR(RequireShape(op, "dbias", *dbias, args.bias.shape()));
  }
  return s;
}

// ---- position encodings -----------------------------------------------------

namespace {

absl::Status CheckBuckets(const char* op, const Tensor& buckets) {
  if (buckets.dtype() != DType::kI32 || buckets.rank() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": buckets must be int32 [Sq, Skv], got ", Describe(buckets)));
  }
  return RequireDefined(op, "buckets", &buckets);
}

// A table or dtable [heads, num_buckets] (TE's layout of the parameter), float.
absl::StatusOr<RelativeBiasDims> CheckTable(const char* op, const char* name, const Tensor* table) {
  RETURN_IF_ERROR(RequireDefined(op, name, table));
  if (table->rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        op, ": ", name, " must be [heads, buckets], got ", ShapeString(table->shape())));
  }
  RETURN_IF_ERROR(RequireFloat(op, name, table));
  RelativeBiasDims dims;
  dims.heads = table->dim(0);
  dims.num_buckets = table->dim(1);
  return dims;
}

// A bias [heads, Sq, Skv] in any float dtype (the attention's operands'
// saves it a cast), or a dbias in float32.
absl::Status CheckBias(const char* op, const char* name, const Tensor* bias,
                       const RelativeBiasDims& dims, const Tensor& buckets, bool float32_only) {
  RETURN_IF_ERROR(float32_only ? RequireDType(op, name, bias, DType::kF32)
                               : RequireFloat(op, name, bias));
  return RequireShape(op, name, *bias, {dims.heads, buckets.dim(0), buckets.dim(1)});
}

}  // namespace

namespace {

// RotaryArgs' angle fields.
absl::Status CheckRotaryAngles(const char* op, const RotaryArgs& args) {
  if (!(args.min_timescale > 0.0f && args.max_timescale > 0.0f)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": timescales must be positive, got [",
                                                   args.min_timescale, ", ", args.max_timescale,
                                                   "]"));
  }
  if (args.position_offset < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": position_offset must be >= 0, got ", args.position_offset));
  }
  if (HasDevicePosition(args.position)) {
    RETURN_IF_ERROR(CheckDevicePosition(op, "position", args.position));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckRotaryArgs(const RotaryArgs& args, const Tensor& x, const Tensor* y) {
  const char* op = "Rotary";
  if (x.rank() != 4 || x.dim(3) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": x must be [B, S, H, D] with D even, got ", ShapeString(x.shape())));
  }
  RETURN_IF_ERROR(CheckRotaryAngles(op, args));
  if (args.table.defined()) {
    if (HasDevicePosition(args.position)) {
      return absl::InvalidArgumentError(absl::StrCat(
          op, ": table is for host positions; give table or position, not both"));
    }
    RETURN_IF_ERROR(RequireDType(op, "table", &args.table, DType::kF32));
    RETURN_IF_ERROR(RequireShape(op, "table", args.table, {2, x.dim(1), x.dim(3) / 2}));
  }
  RETURN_IF_ERROR(RequireFloat(op, "x", &x));
  RETURN_IF_ERROR(RequireFloat(op, "y", y));
  return RequireShape(op, "y", *y, x.shape());
}

absl::Status CheckRotaryTableArgs(const RotaryArgs& args, int64_t seq, int64_t dim) {
  const char* op = "RotaryTable";
  if (seq < 0 || dim < 0 || dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": want seq >= 0 and an even dim >= 0, got ", seq, " and ", dim));
  }
  if (HasDevicePosition(args.position) || args.table.defined()) {
    return absl::InvalidArgumentError(
        absl::StrCat(op, ": args must have host positions and no table of their own"));
  }
  return CheckRotaryAngles(op, args);
}

absl::Status CheckRotaryQkArgs(const RotaryArgs& args, const Tensor& qkv) {
  if (qkv.rank() != 5 || qkv.dim(2) != 3 || qkv.dim(4) % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("RotaryQkInPlace: qkv must be [B, S, 3, H, D] with D even, got ",
                     ShapeString(qkv.shape())));
  }
  // One part's view has Rotary's shape: the same argument checks.
  const Tensor part(nullptr, qkv.data(), qkv.dtype(),
                    {qkv.dim(0), qkv.dim(1), qkv.dim(3), qkv.dim(4)});
  return CheckRotaryArgs(args, part, &part);
}

Tensor PackedQkvRows(const Tensor& qkv) {
  return qkv.Reshaped({qkv.dim(0) * qkv.dim(1), qkv.dim(2) * qkv.dim(3) * qkv.dim(4)});
}

absl::Status CheckRotaryQkQuantizeTransposeArgs(const RotaryArgs& args, const Tensor* qkv,
                                                const Fp8Output& fp8, const Tensor* y,
                                                const Tensor* y_t, const Tensor* dbias) {
  const char* op = "RotaryQkQuantizeTranspose";
  RETURN_IF_ERROR(RequireDefined(op, "qkv", qkv));
  // The parts' checks name their own ops; the message says which op called.
  auto named = [op](const absl::Status& s) {
    return s.ok() ? s : absl::Status(s.code(), absl::StrCat(op, ": ", s.message()));
  };
  RETURN_IF_ERROR(named(CheckRotaryQkArgs(args, *qkv)));
  const Tensor rows = PackedQkvRows(*qkv);
  RETURN_IF_ERROR(named(CheckQuantizeTransposeArgs(rows, fp8, y, y_t)));
  if (dbias != nullptr) RETURN_IF_ERROR(named(CheckSumRowsArgs(rows, dbias)));
  return absl::OkStatus();
}

absl::StatusOr<RelativeBiasDims> CheckRelativeBiasForwardArgs(const Tensor& table,
                                                              const Tensor& buckets,
                                                              const Tensor& first_row,
                                                              const Tensor* bias) {
  const char* op = "RelativeBiasForward";
  ASSIGN_OR_RETURN(const RelativeBiasDims dims, CheckTable(op, "table", &table));
  RETURN_IF_ERROR(CheckBuckets(op, buckets));
  if (!HasDevicePosition(first_row)) {
    RETURN_IF_ERROR(CheckBias(op, "bias", bias, dims, buckets, /*float32_only=*/false));
    return dims;
  }
  RETURN_IF_ERROR(CheckDevicePosition(op, "first_row", first_row));
  RETURN_IF_ERROR(RequireFloat(op, "bias", bias));
  const int64_t q_rows = bias->rank() == 3 ? bias->dim(1) : 0;
  RETURN_IF_ERROR(RequireShape(op, "bias", *bias, {dims.heads, q_rows, buckets.dim(1)},
                               absl::StrCat("[heads=", dims.heads, ", Sq, Skv=", buckets.dim(1),
                                            "]")));
  return dims;
}

absl::StatusOr<RelativeBiasDims> CheckRelativeBiasBackwardArgs(const Tensor& dbias,
                                                               const Tensor& buckets,
                                                               const Tensor* dtable) {
  const char* op = "RelativeBiasBackward";
  ASSIGN_OR_RETURN(const RelativeBiasDims dims, CheckTable(op, "dtable", dtable));
  RETURN_IF_ERROR(CheckBuckets(op, buckets));
  RETURN_IF_ERROR(CheckBias(op, "dbias", &dbias, dims, buckets, /*float32_only=*/true));
  return dims;
}

// ---- language-model ops ------------------------------------------------------

namespace {

absl::Status CheckIds(const char* op, const char* name, const Tensor& ids, int rank) {
  RETURN_IF_ERROR(RequireDType(op, name, &ids, DType::kI32));
  if (ids.rank() != rank) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " must be int32 of rank ", rank,
                                                   ", got ", Describe(ids)));
  }
  return absl::OkStatus();
}

absl::StatusOr<LmDims> CheckEmbedArgs(const char* op, const char* table_name, const Tensor* table,
                                      const Tensor& ids, const char* rows_name, const Tensor* rows) {
  RETURN_IF_ERROR(RequireFloat(op, table_name, table));
  RETURN_IF_ERROR(RequireFloat(op, rows_name, rows));
  if (table->rank() != 2) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", table_name, " must be [V, F], got ",
                                                   ShapeString(table->shape())));
  }
  RETURN_IF_ERROR(CheckIds(op, "ids", ids, 1));
  LmDims dims{ids.dim(0), table->dim(1), table->dim(0)};
  RETURN_IF_ERROR(RequireShape(op, rows_name, *rows, {dims.rows, dims.width}));
  return dims;
}

}  // namespace

absl::StatusOr<LmDims> CheckEmbedForwardArgs(const Tensor& table, const Tensor& ids,
                                             const Tensor* y) {
  return CheckEmbedArgs("EmbedForward", "table", &table, ids, "y", y);
}

absl::StatusOr<LmDims> CheckEmbedBackwardArgs(const Tensor& dy, const Tensor& ids,
                                              const Tensor* dtable) {
  return CheckEmbedArgs("EmbedBackward", "dtable", dtable, ids, "dy", &dy);
}

absl::StatusOr<LmDims> CheckSoftmaxCrossEntropyArgs(const char* op, const Tensor& logits,
                                                    const Tensor& labels, const Tensor* lse) {
  RETURN_IF_ERROR(RequireFloat(op, "logits", &logits));
  if (logits.rank() != 2 || logits.dim(0) < 1 || logits.dim(1) < 1) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": logits must be [N, V] with N, V >= 1, got ",
                                                   ShapeString(logits.shape())));
  }
  RETURN_IF_ERROR(CheckIds(op, "labels", labels, 1));
  LmDims dims{logits.dim(0), logits.dim(1), logits.dim(1)};
  RETURN_IF_ERROR(RequireShape(op, "labels", labels, {dims.rows}));
  RETURN_IF_ERROR(RequireDType(op, "lse", lse, DType::kF32));
  RETURN_IF_ERROR(RequireShape(op, "lse", *lse, {dims.rows}));
  return dims;
}

absl::StatusOr<LmDims> CheckSoftmaxCrossEntropyForwardArgs(const Tensor& logits,
                                                           const Tensor& labels, const Tensor* loss,
                                                           const Tensor* lse) {
  constexpr const char* kOp = "SoftmaxCrossEntropyForward";
  ASSIGN_OR_RETURN(const LmDims d, CheckSoftmaxCrossEntropyArgs(kOp, logits, labels, lse));
  RETURN_IF_ERROR(RequireScalarF32(kOp, "loss", loss));
  return d;
}

absl::StatusOr<LmDims> CheckSoftmaxCrossEntropyBackwardArgs(const Tensor& logits,
                                                            const Tensor& labels,
                                                            const Tensor& lse,
                                                            const Tensor& dloss,
                                                            const Tensor* dlogits) {
  constexpr const char* kOp = "SoftmaxCrossEntropyBackward";
  ASSIGN_OR_RETURN(const LmDims d, CheckSoftmaxCrossEntropyArgs(kOp, logits, labels, &lse));
  RETURN_IF_ERROR(RequireScalarF32(kOp, "dloss", &dloss));
  RETURN_IF_ERROR(RequireFloat(kOp, "dlogits", dlogits));
  RETURN_IF_ERROR(RequireShape(kOp, "dlogits", *dlogits, logits.shape()));
  return d;
}

absl::StatusOr<LmDims> CheckArgmaxLastArgs(const Tensor& x, const Tensor* y) {
  constexpr const char* kOp = "ArgmaxLast";
  RETURN_IF_ERROR(RequireFloat(kOp, "x", &x));
  if (x.rank() < 1 || x.dim(x.rank() - 1) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x is ", Describe(x), ", want [..., V] with V >= 1"));
  }
  if (x.dim(x.rank() - 1) > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(kOp, ": x is ", Describe(x), "; its last dim must fit an int32 index"));
  }
  RETURN_IF_ERROR(RequireDType(kOp, "y", y, DType::kI32));
  LmDims d;
  d.width = x.dim(x.rank() - 1);
  d.rows = x.numel() / d.width;
  d.vocab = d.width;
  if (y->numel() != d.rows) {
    return absl::InvalidArgumentError(absl::StrCat(kOp, ": y is ", Describe(*y), ", want ",
                                                   d.rows, " elements (one per row of x)"));
  }
  return d;
}

// ---- optimizers ---------------------------------------------------------------

absl::Status CheckOptimizerUpdateArgs(const OptimizerUpdateArgs& args, const Tensor& grad,
                                      const Tensor& grad_norm_sq, const Tensor* param,
                                      const Tensor* mu, const Tensor* nu) {
  const char* op = "OptimizerUpdate";
  RETURN_IF_ERROR(RequireFloat(op, "param", param));
  RETURN_IF_ERROR(RequireFloat(op, "grad", &grad));
  RETURN_IF_ERROR(RequireSameCount(op, "grad", grad, "param", *param));
  RETURN_IF_ERROR(RequireScalarF32(op, "grad_norm_sq", &grad_norm_sq));
  const bool adam = args.rule == OptimizerUpdateArgs::Rule::kAdam;
  for (const auto& [name, moment, needed] :
       {std::tuple<const char*, const Tensor*, bool>{"mu", mu, adam},
        std::tuple<const char*, const Tensor*, bool>{"nu", nu, adam}}) {
    if (!Wanted(moment)) {
      if (needed) {
        return absl::InvalidArgumentError(absl::StrCat(op, ": ", name, " is missing; adam needs it"));
      }
      continue;
    }
    if (!adam && moment == nu) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": nu is given; sgd keeps no nu"));
    }
    RETURN_IF_ERROR(RequireDType(op, name, moment, param->dtype()));
    RETURN_IF_ERROR(RequireSameCount(op, name, *moment, "param", *param));
  }
  return absl::OkStatus();
}

}  // namespace te
