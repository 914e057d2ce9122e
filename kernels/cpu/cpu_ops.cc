// The CPU reference backend: element access helpers and every op of
// kernels/ops.h except attention (attention.cc) and position encodings
// (position.cc).
//
// Numerics: inputs are read as float32; reductions (sums, means, variances)
// accumulate in double, which is at least as accurate as the float32
// accumulation ops.h promises and keeps the reference closest to the exact
// value; elementwise math runs in float32; every output element is rounded
// once to its dtype with the exact casts of kernels/fp8.h. GEMMs run in
// float32 through Eigen.
//
// NaN policy: amax reductions propagate NaN (as jnp.max does in TE JAX), so a
// NaN input shows up in the amax history and the delayed-scaling update keeps
// the old scale instead of silently scaling around it.
#include "kernels/cpu/cpu_ops.h"

#include <sys/mman.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>

#include <eigen3/Eigen/Dense>

#include "absl/strings/str_cat.h"
#include "kernels/fp8.h"
#include "kernels/op_checks.h"
#include "kernels/rng.h"
#include "kernels/status_macros.h"

namespace te {

// ---- element access ---------------------------------------------------------

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

namespace {

// Every element of t as float times `scale`, into out: the same values as
// LoadAsFloat, with the dtype switched on once per tensor, not per element.
template <typename Storage, typename Decode>
void DecodeElements(const Tensor& t, float scale, float* out, Decode decode) {
  const Storage* in = t.data_as<const Storage>();
  for (int64_t i = 0; i < t.numel(); ++i) out[i] = decode(in[i]) * scale;
}

void DecodeAll(const Tensor& t, float scale, float* out) {
  switch (t.dtype()) {
    case DType::kF32: return DecodeElements<float>(t, scale, out, [](float v) { return v; });
    case DType::kBF16: return DecodeElements<uint16_t>(t, scale, out, Bf16ToFloat);
    case DType::kF16: return DecodeElements<uint16_t>(t, scale, out, Fp16ToFloat);
    case DType::kE4M3: return DecodeElements<uint8_t>(t, scale, out, E4M3ToFloat);
    case DType::kE5M2: return DecodeElements<uint8_t>(t, scale, out, E5M2ToFloat);
    case DType::kI32:
    case DType::kBool:
      for (int64_t i = 0; i < t.numel(); ++i) out[i] = LoadAsFloat(t, i) * scale;
      return;
  }
}

}  // namespace

std::vector<float> ToFloatVector(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  DecodeAll(t, 1.0f, v.data());
  return v;
}

void FromFloatVector(const std::vector<float>& v, Tensor* t) {
  for (int64_t i = 0; i < t->numel(); ++i) StoreFromFloat(t, i, v[i]);
}

namespace {

// max |v| over values, NaN if any value is NaN.
float AbsMax(const float* v, int64_t n) {
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    if (std::isnan(a)) return NAN;
    amax = std::max(amax, a);
  }
  return amax;
}

// Writes values (float32, already computed) to y, checked by CheckOutput: a
// float y gets each value rounded once; an FP8 y gets cast(v * scale), with
// amax = max |v| (when it is recorded) and scale_inv = 1 / scale written
// (TE's fused quantize).
void WriteOutput(const std::vector<float>& values, Tensor* y, const Fp8Output* fp8) {
  if (!IsFloat8(y->dtype())) {
    FromFloatVector(values, y);
    return;
  }
  const float scale = fp8->scale.data_as<const float>()[0];
  for (int64_t i = 0; i < y->numel(); ++i) StoreFromFloat(y, i, values[i] * scale);
  if (fp8->amax.defined()) {
    fp8->amax.data_as<float>()[0] = AbsMax(values.data(), static_cast<int64_t>(values.size()));
  }
  fp8->scale_inv.data_as<float>()[0] = 1.0f / scale;
}

// ---- activations -------------------------------------------------------------

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;
constexpr float kQuickGeluAlpha = 1.702f;

float Sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
// GELU's tanh form through the logistic function (0.5 (1 + tanh(u)) =
// sigmoid(2u)), as the CUDA kernels compute it; it keeps the small negative
// tail that 1 + tanh(u) cancels to 0 below x of about -4.
float GeluLogistic(float x) { return Sigmoid(2.0f * kSqrt2OverPi * (x + kGeluCubic * x * x * x)); }

float ActivationValue(Activation act, float x) {
  switch (act) {
    case Activation::kGelu: return x * GeluLogistic(x);
    case Activation::kSilu: return x * Sigmoid(x);
    case Activation::kRelu: return x > 0.0f ? x : 0.0f;
    case Activation::kQuickGelu: return x * Sigmoid(kQuickGeluAlpha * x);
    case Activation::kSquaredRelu: return x > 0.0f ? x * x : 0.0f;
    case Activation::kLinear: return x;
  }
  return x;
}

float ActivationDerivative(Activation act, float x) {
  switch (act) {
    case Activation::kGelu: {
      const float s = GeluLogistic(x);
      const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x * x);
      return s + 2.0f * x * s * (1.0f - s) * du;
    }
    case Activation::kSilu: {
      const float s = Sigmoid(x);
      return s * (1.0f + x * (1.0f - s));
    }
    case Activation::kRelu: return x > 0.0f ? 1.0f : 0.0f;
    case Activation::kQuickGelu: {
      const float s = Sigmoid(kQuickGeluAlpha * x);
      return s + kQuickGeluAlpha * x * s * (1.0f - s);
    }
    case Activation::kSquaredRelu: return x > 0.0f ? 2.0f * x : 0.0f;
    case Activation::kLinear: return 1.0f;
  }
  return 1.0f;
}

// ---- FP8 block scaling (emulated) ------------------------------------------

constexpr int kMxfp8Block = kMxfp8BlockSize;
constexpr int kNvfp4Block = kNvfp4BlockSize;
// E8M0 represents 2^-127 .. 2^127.
constexpr int kE8M0MinExp = -127;
constexpr int kE8M0MaxExp = 127;

// MXFP8, one block in place, with TE's scale choice (float_to_e8m0 rounding
// up): scale 2^e with e = ceil(log2(amax / 448)), so the block max never
// saturates; values x / 2^e cast to E4M3, then multiplied back. A zero block
// stays zero; a block holding inf or NaN has no E8M0 scale (its scale would be
// the NaN code), so it becomes NaN.
void FakeQuantizeMxfp8Block(float* v, int n) {
  const float amax = AbsMax(v, n);
  if (amax == 0.0f) return;
  if (!std::isfinite(amax)) {
    for (int i = 0; i < n; ++i) v[i] = NAN;
    return;
  }
  int e2;
  // amax / 448 = f * 2^e2, f in [0.5, 1): ceil(log2) = e2, or e2 - 1 when f = 0.5.
  const double f = std::frexp(static_cast<double>(amax) / kE4M3Max, &e2);
  const int exp = std::clamp(f == 0.5 ? e2 - 1 : e2, kE8M0MinExp, kE8M0MaxExp);
  for (int i = 0; i < n; ++i) {
    const float q = E4M3ToFloat(FloatToE4M3(std::ldexp(v[i], -exp)));
    v[i] = std::ldexp(q, exp);
  }
}

// NVFP4 over a whole tensor, in place. Two levels of scale, as TE computes
// them: a global encode scale S = 448 * 6 / amax(tensor) (S = 1 where amax is
// 0 or S overflows to 0; capped at FLT_MAX), and per 16-element block a decode
// scale s = E4M3(block_amax / 6 * S). Elements: q = E2M1(x * (S / s)),
// y = q * (s / S). A block whose s rounds to zero becomes zero. NaN anywhere
// makes the whole output NaN (no scale is defined).
void FakeQuantizeNvfp4(std::vector<float>* values, int64_t cols) {
  std::vector<float>& v = *values;
  const float amax = AbsMax(v.data(), static_cast<int64_t>(v.size()));
  if (std::isnan(amax)) {
    std::fill(v.begin(), v.end(), NAN);
    return;
  }
  float global = std::min(kE4M3Max * kE2M1Max / amax, FLT_MAX);
  if (amax == 0.0f || global == 0.0f) global = 1.0f;
  const int64_t rows = cols == 0 ? 0 : static_cast<int64_t>(v.size()) / cols;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < cols; b += kNvfp4Block) {
      float* block = v.data() + r * cols + b;
      const float block_amax = AbsMax(block, kNvfp4Block);
      const float block_scale = E4M3ToFloat(FloatToE4M3(block_amax / kE2M1Max * global));
      if (block_scale == 0.0f) {
        std::fill(block, block + kNvfp4Block, 0.0f);
        continue;
      }
      const float encode = global / block_scale;
      const float decode = block_scale / global;
      for (int i = 0; i < kNvfp4Block; ++i) block[i] = RoundToE2M1(block[i] * encode) * decode;
    }
  }
}

using RowMajorMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// A GEMM operand as a float32 matrix of its stored shape, dequantized when FP8.
RowMajorMatrix OperandMatrix(const Tensor& t, const Tensor& scale_inv) {
  RowMajorMatrix m(t.dim(0), t.dim(1));
  DecodeAll(t, IsFloat8(t.dtype()) ? scale_inv.data_as<const float>()[0] : 1.0f, m.data());
  return m;
}

}  // namespace

// ---- memory and copies -------------------------------------------------------

absl::StatusOr<std::shared_ptr<void>> CpuOps::AllocateBytes(size_t bytes) {
  // Large tensors get fresh pages from the kernel on every allocation; in 2
  // MiB huge pages that costs 512x fewer page faults (on a VM, 64 MiB went
  // from ~0.1 to ~2.5 GB/s of first writes).
  constexpr size_t kHugePage = size_t{2} << 20;
  const size_t alignment = bytes >= kHugePage ? kHugePage : 64;
  const size_t rounded = (bytes + alignment - 1) / alignment * alignment;  // as aligned_alloc wants
  void* p = std::aligned_alloc(alignment, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("host allocation of ", bytes, " bytes failed"));
  }
  if (alignment == kHugePage) madvise(p, rounded, MADV_HUGEPAGE);  // advice: failure is harmless
  return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
}

absl::Status CpuOps::Upload(const void* src, Tensor* dst) {
  RETURN_IF_ERROR(CheckUploadArgs(src, dst));
  if (dst->nbytes() == 0) return absl::OkStatus();
  std::memcpy(dst->data(), src, dst->nbytes());
  return absl::OkStatus();
}

absl::Status CpuOps::Download(const Tensor& src, void* dst) {
  RETURN_IF_ERROR(CheckDownloadArgs(src, dst));
  if (src.nbytes() == 0) return absl::OkStatus();
  std::memcpy(dst, src.data(), src.nbytes());
  return absl::OkStatus();
}

absl::Status CpuOps::Copy(const Tensor& src, Tensor* dst) {
  RETURN_IF_ERROR(CheckCopyArgs(src, dst));
  if (src.nbytes() > 0) std::memmove(dst->data(), src.data(), src.nbytes());
  return absl::OkStatus();
}

absl::Status CpuOps::CopyRowsAt(const Tensor& src, const Tensor& position, Tensor* dst) {
  RETURN_IF_ERROR(CheckCopyRowsAtArgs(src, position, dst));
  const int64_t batch = src.dim(0), seq = src.dim(1), length = dst->dim(1);
  if (src.nbytes() == 0) return absl::OkStatus();
  const size_t row_bytes = src.nbytes() / static_cast<size_t>(batch * seq);
  // Host memory: the position is read here, when the op runs.
  const int64_t p = position.data_as<const int32_t>()[0];
  const auto* from = static_cast<const uint8_t*>(src.data());
  auto* to = static_cast<uint8_t*>(dst->data());
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s < seq; ++s) {
      const int64_t t = p + s;
      if (t < 0 || t >= length) continue;
      std::memmove(to + (b * length + t) * row_bytes, from + (b * seq + s) * row_bytes,
                   row_bytes);
    }
  }
  return absl::OkStatus();
}

// ---- elementwise -------------------------------------------------------------

absl::Status CpuOps::Fill(float value, Tensor* y) {
  RETURN_IF_ERROR(RequireDefined("Fill", "y", y));
  for (int64_t i = 0; i < y->numel(); ++i) StoreFromFloat(y, i, value);
  return absl::OkStatus();
}

absl::Status CpuOps::AddScalarI32(int32_t value, Tensor* y) {
  RETURN_IF_ERROR(CheckAddScalarI32Args(y));
  int32_t* v = y->data_as<int32_t>();
  for (int64_t i = 0; i < y->numel(); ++i) v[i] += value;
  return absl::OkStatus();
}

absl::Status CpuOps::Cast(const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckCastArgs(x, y));
  for (int64_t i = 0; i < x.numel(); ++i) StoreFromFloat(y, i, LoadAsFloat(x, i));
  return absl::OkStatus();
}

// A term whose coefficient is 0 is not read (BLAS's convention), so
// Axpby(alpha, a, 0, Tensor(), y) scales a, and a NaN in an unread tensor does
// not leak through 0 * NaN.
absl::Status CpuOps::Axpby(float alpha, const Tensor& a, float beta, const Tensor& b,
                           Tensor* y) {
  RETURN_IF_ERROR(CheckAxpbyArgs(alpha, a, beta, b, y));
  for (int64_t i = 0; i < y->numel(); ++i) {
    float v = 0.0f;
    if (alpha != 0.0f) v += alpha * LoadAsFloat(a, i);
    if (beta != 0.0f) v += beta * LoadAsFloat(b, i);
    StoreFromFloat(y, i, v);
  }
  return absl::OkStatus();
}

// Any dtype: elements are moved as bytes.
absl::Status CpuOps::Permute(const Tensor& x, const std::vector<int>& perm, Tensor* y) {
  RETURN_IF_ERROR(CheckPermuteArgs(x, perm, y));
  const int rank = x.rank();
  const Shape& y_dims = y->shape();  // y_dims[i] = x.dim(perm[i])

  // x_strides[d]: elements between neighbours along x's dimension d;
  // step[i]: the x stride of y's dimension i.
  std::vector<int64_t> x_strides(rank, 1);
  for (int d = rank - 2; d >= 0; --d) x_strides[d] = x_strides[d + 1] * x.dim(d + 1);
  std::vector<int64_t> step(rank);
  for (int i = 0; i < rank; ++i) step[i] = x_strides[perm[i]];

  const size_t elem = DTypeSize(x.dtype());
  const char* src = static_cast<const char*>(x.data());
  char* dst = static_cast<char*>(y->data());
  std::vector<int64_t> index(rank, 0);  // y's multi-index, odometer order
  int64_t x_offset = 0;
  for (int64_t out = 0; out < y->numel(); ++out) {
    std::memcpy(dst + out * elem, src + x_offset * elem, elem);
    for (int i = rank - 1; i >= 0; --i) {
      if (++index[i] < y_dims[i]) {
        x_offset += step[i];
        break;
      }
      x_offset -= step[i] * (y_dims[i] - 1);
      index[i] = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status CpuOps::SumRows(const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckSumRowsArgs(x, y));
  const int64_t h = x.dim(-1);
  const int64_t rows = Rows(x);
  std::vector<double> sums(h, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < h; ++c) sums[c] += LoadAsFloat(x, r * h + c);
  }
  for (int64_t c = 0; c < h; ++c) StoreFromFloat(y, c, static_cast<float>(sums[c]));
  return absl::OkStatus();
}

// ---- FP8 scaling ---------------------------------------------------------------

absl::Status CpuOps::Quantize(const Tensor& x, const Fp8Output& fp8, Tensor* y) {
  RETURN_IF_ERROR(CheckQuantizeArgs(x, fp8, y));
  WriteOutput(ToFloatVector(x), y, &fp8);
  return absl::OkStatus();
}

absl::Status CpuOps::Dequantize(const Tensor& x, const Tensor& scale_inv, Tensor* y) {
  RETURN_IF_ERROR(CheckDequantizeArgs(x, scale_inv, y));
  const float s = scale_inv.data_as<const float>()[0];
  for (int64_t i = 0; i < x.numel(); ++i) StoreFromFloat(y, i, LoadAsFloat(x, i) * s);
  return absl::OkStatus();
}

// Reads any floating dtype; FP8 values are read unscaled.
absl::Status CpuOps::Amax(const Tensor& x, Tensor* amax) {
  RETURN_IF_ERROR(CheckAmaxArgs(x, amax));
  const std::vector<float> v = ToFloatVector(x);
  amax->data_as<float>()[0] = AbsMax(v.data(), x.numel());
  return absl::OkStatus();
}

// As TE's current scaling: amax below epsilon is raised to epsilon; a scale
// that overflows is capped at FLT_MAX; where amax (after the epsilon) is 0, inf
// or NaN there is no meaningful scale and it is 1.
absl::Status CpuOps::ScaleFromAmax(const Tensor& amax, float fp8_max, float margin,
                                   float epsilon, Tensor* scale, Tensor* scale_inv) {
  RETURN_IF_ERROR(CheckScaleFromAmaxArgs(amax, fp8_max, epsilon, scale, scale_inv));
  float a = amax.data_as<const float>()[0];
  if (a < epsilon) a = epsilon;
  float s = 1.0f;
  if (std::isfinite(a) && a > 0.0f) {
    s = std::min(fp8_max * std::exp2(-margin) / a, FLT_MAX);
  }
  scale->data_as<float>()[0] = s;
  scale_inv->data_as<float>()[0] = 1.0f / s;
  return absl::OkStatus();
}

absl::Status CpuOps::DelayedScalingUpdate(const DelayedScalingArgs& args, Tensor* amax_history,
                                          Tensor* scale, Tensor* scale_inv) {
  RETURN_IF_ERROR(CheckDelayedScalingArgs(args, amax_history, scale, scale_inv));
  float* history = amax_history->data_as<float>();
  const int64_t length = amax_history->numel();

  // The amax of the window as it stands, before the roll.
  const float amax = args.most_recent ? history[0] : AbsMax(history, length);

  std::rotate(history, history + 1, history + length);  // roll(-1): history[0] goes last
  history[0] = 0.0f;

  float s = scale->data_as<const float>()[0];
  if (std::isfinite(amax) && amax > 0.0f) s = args.fp8_max * std::exp2(-args.margin) / amax;
  scale->data_as<float>()[0] = s;
  scale_inv->data_as<float>()[0] = 1.0f / s;
  return absl::OkStatus();
}

absl::Status CpuOps::FakeQuantizeBlockScaled(BlockFormat format, const Tensor& x, Tensor* y) {
  RETURN_IF_ERROR(CheckFakeQuantizeBlockScaledArgs(format, x, y));
  const int64_t cols = x.dim(-1);
  std::vector<float> v = ToFloatVector(x);
  if (format == BlockFormat::kMXFP8) {
    for (size_t b = 0; b < v.size(); b += kMxfp8Block) FakeQuantizeMxfp8Block(&v[b], kMxfp8Block);
  } else {
    FakeQuantizeNvfp4(&v, cols);
  }
  FromFloatVector(v, y);
  return absl::OkStatus();
}

// ---- GEMM ----------------------------------------------------------------------

absl::Status CpuOps::Gemm(const GemmArgs& args, Tensor* out) {
  ASSIGN_OR_RETURN(const GemmDims dims, CheckGemmArgs(args, out));
  const int64_t m = dims.m, n = dims.n;
  const bool has_bias = args.bias.data() != nullptr;

  const RowMajorMatrix a = OperandMatrix(args.a, args.a_scale_inv);
  const RowMajorMatrix b = OperandMatrix(args.b, args.b_scale_inv);
  RowMajorMatrix result(m, n);
  if (args.transpose_a && args.transpose_b) result.noalias() = a.transpose() * b.transpose();
  else if (args.transpose_a) result.noalias() = a.transpose() * b;
  else if (args.transpose_b) result.noalias() = a * b.transpose();
  else result.noalias() = a * b;

  const bool has_residual = args.residual.defined();
  const bool gelu = args.epilogue == GemmEpilogue::kGeluAux;
  Tensor aux = args.aux;  // shares the caller's memory
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = i * n + j;
      float v = result(i, j);
      if (has_bias) v += LoadAsFloat(args.bias, j);
      if (has_residual) v += LoadAsFloat(args.residual, at);
      if (args.accumulate) v += LoadAsFloat(*out, at);
      if (gelu) {
        StoreFromFloat(&aux, at, v);
        v = ActivationValue(Activation::kGelu, v);
      }
      StoreFromFloat(out, at, v);
    }
  }
  return absl::OkStatus();
}

// ---- normalisation --------------------------------------------------------------

// Rows (all but the last dimension) are normalised over the last dimension.
absl::Status CpuOps::NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                                 const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                                 const Fp8Output* fp8) {
  ASSIGN_OR_RETURN(const NormDims dims, CheckNormForwardArgs(args, x, gamma, beta, y, mu,
                                                              rsigma, fp8));
  const bool layernorm = args.type == NormType::kLayerNorm;
  const int64_t h = dims.hidden;
  const int64_t rows = dims.rows;

  const std::vector<float> xs = ToFloatVector(x);
  std::vector<float> g = ToFloatVector(gamma);
  if (args.zero_centered_gamma) {
    for (float& v : g) v += 1.0f;
  }
  const std::vector<float> bias = layernorm ? ToFloatVector(beta) : std::vector<float>(h, 0.0f);
  std::vector<float> out(xs.size());
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = xs.data() + r * h;
    double mean = 0.0;
    if (layernorm) {
      for (int64_t c = 0; c < h; ++c) mean += row[c];
      mean /= static_cast<double>(h);
    }
    double second_moment = 0.0;  // variance, or mean square for RMSNorm
    for (int64_t c = 0; c < h; ++c) second_moment += (row[c] - mean) * (row[c] - mean);
    second_moment /= static_cast<double>(h);
    // y is computed from the float32 statistics that backward will read.
    const float mu_f = static_cast<float>(mean);
    const float rs_f = static_cast<float>(1.0 / std::sqrt(second_moment + args.epsilon));
    for (int64_t c = 0; c < h; ++c) out[r * h + c] = (row[c] - mu_f) * rs_f * g[c] + bias[c];
    if (layernorm && Wanted(mu)) mu->data_as<float>()[r] = mu_f;
    if (Wanted(rsigma)) rsigma->data_as<float>()[r] = rs_f;
  }
  WriteOutput(out, y, fp8);
  return absl::OkStatus();
}

// With xhat = (x - mu) * rsigma (RMSNorm: x * rsigma) and dxhat = dy * g:
//   dx = rsigma * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
// (RMSNorm drops the mean(dxhat) term); dgamma = sum_rows dy * xhat,
// dbeta = sum_rows dy.
absl::Status CpuOps::NormBackward(const NormArgs& args, const Tensor& dy, const Tensor& x,
                                  const Tensor& mu, const Tensor& rsigma, const Tensor& gamma,
                                  Tensor* dx, Tensor* dgamma, Tensor* dbeta,
                                  const Tensor& residual_grad) {
  ASSIGN_OR_RETURN(const NormDims dims, CheckNormBackwardArgs(args, dy, x, mu, rsigma, gamma,
                                                               dx, dgamma, dbeta, residual_grad));
  const bool layernorm = args.type == NormType::kLayerNorm;
  const int64_t h = dims.hidden;
  const int64_t rows = dims.rows;

  const std::vector<float> xs = ToFloatVector(x);
  const std::vector<float> dys = ToFloatVector(dy);
  std::vector<float> g = ToFloatVector(gamma);
  if (args.zero_centered_gamma) {
    for (float& v : g) v += 1.0f;
  }
  std::vector<float> dxs(xs.size());
  std::vector<double> dgamma_sum(h, 0.0), dbeta_sum(h, 0.0);
  std::vector<float> xhat(h), dxhat(h);
  for (int64_t r = 0; r < rows; ++r) {
    const float mu_r = layernorm ? mu.data_as<const float>()[r] : 0.0f;
    const float rs_r = rsigma.data_as<const float>()[r];
    double mean_dxhat = 0.0, mean_dxhat_xhat = 0.0;
    for (int64_t c = 0; c < h; ++c) {
      const int64_t i = r * h + c;
      xhat[c] = (xs[i] - mu_r) * rs_r;
      dxhat[c] = dys[i] * g[c];
      mean_dxhat += dxhat[c];
      mean_dxhat_xhat += static_cast<double>(dxhat[c]) * xhat[c];
      dgamma_sum[c] += static_cast<double>(dys[i]) * xhat[c];
      dbeta_sum[c] += dys[i];
    }
    mean_dxhat = layernorm ? mean_dxhat / static_cast<double>(h) : 0.0;
    mean_dxhat_xhat /= static_cast<double>(h);
    for (int64_t c = 0; c < h; ++c) {
      dxs[r * h + c] = static_cast<float>(
          rs_r * (dxhat[c] - mean_dxhat - xhat[c] * mean_dxhat_xhat));
      if (residual_grad.defined()) dxs[r * h + c] += LoadAsFloat(residual_grad, r * h + c);
    }
  }
  FromFloatVector(dxs, dx);
  for (int64_t c = 0; c < h; ++c) {
    StoreFromFloat(dgamma, c, static_cast<float>(dgamma_sum[c]));
    if (layernorm) StoreFromFloat(dbeta, c, static_cast<float>(dbeta_sum[c]));
  }
  return absl::OkStatus();
}

// ---- activations ---------------------------------------------------------------

absl::Status CpuOps::ActivationForward(const std::vector<Activation>& acts, const Tensor& x,
                                       Tensor* y, const Fp8Output* fp8) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationForwardArgs(acts, x, y, fp8));
  const int64_t rows = Rows(x);
  const int64_t in_cols = x.dim(-1);
  std::vector<float> out(static_cast<size_t>(rows * width));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      float v = ActivationValue(acts[0], LoadAsFloat(x, r * in_cols + c));
      if (acts.size() == 2) v *= ActivationValue(acts[1], LoadAsFloat(x, r * in_cols + width + c));
      out[r * width + c] = v;
    }
  }
  WriteOutput(out, y, fp8);
  return absl::OkStatus();
}

// Gated: dx_0 = dy * act_1(x_1) * act_0'(x_0), dx_1 = dy * act_0(x_0) * act_1'(x_1).
absl::Status CpuOps::ActivationBackward(const std::vector<Activation>& acts, const Tensor& dy,
                                        const Tensor& x, Tensor* dx) {
  ASSIGN_OR_RETURN(const int64_t width, CheckActivationBackwardArgs(acts, dy, x, dx));
  const int64_t rows = Rows(x);
  const int64_t in_cols = x.dim(-1);
  std::vector<float> out(static_cast<size_t>(x.numel()));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < width; ++c) {
      const float g = LoadAsFloat(dy, r * width + c);
      const int64_t i0 = r * in_cols + c;
      const float x0 = LoadAsFloat(x, i0);
      if (acts.size() == 1) {
        out[i0] = g * ActivationDerivative(acts[0], x0);
        continue;
      }
      const int64_t i1 = i0 + width;
      const float x1 = LoadAsFloat(x, i1);
      out[i0] = g * ActivationValue(acts[1], x1) * ActivationDerivative(acts[0], x0);
      out[i1] = g * ActivationValue(acts[0], x0) * ActivationDerivative(acts[1], x1);
    }
  }
  FromFloatVector(out, dx);
  return absl::OkStatus();
}

// ---- dropout ---------------------------------------------------------------------

namespace {

// rate 1 drops everything: kept elements (none) would need an infinite scale.
float KeptScale(float rate) { return rate >= 1.0f ? 0.0f : 1.0f / (1.0f - rate); }

}  // namespace

// `mask` may be null (or undefined) when the caller needs no backward.
absl::Status CpuOps::DropoutForward(float rate, uint64_t seed, const Tensor& x, Tensor* y,
                                    Tensor* mask) {
  RETURN_IF_ERROR(CheckDropoutForwardArgs(rate, x, y, mask));
  const bool want_mask = Wanted(mask);
  const float scale = KeptScale(rate);
  for (int64_t i = 0; i < x.numel(); ++i) {
    const bool kept = DropoutUniform(seed, static_cast<uint64_t>(i)) >= rate;
    StoreFromFloat(y, i, kept ? LoadAsFloat(x, i) * scale : 0.0f);
    if (want_mask) mask->data_as<uint8_t>()[i] = kept ? 1 : 0;
  }
  return absl::OkStatus();
}

absl::Status CpuOps::DropoutBackward(float rate, const Tensor& dy, const Tensor& mask,
                                     Tensor* dx) {
  RETURN_IF_ERROR(CheckDropoutBackwardArgs(rate, dy, mask, dx));
  const float scale = KeptScale(rate);
  const uint8_t* kept = mask.data_as<const uint8_t>();
  for (int64_t i = 0; i < dy.numel(); ++i) {
    StoreFromFloat(dx, i, kept[i] ? LoadAsFloat(dy, i) * scale : 0.0f);
  }
  return absl::OkStatus();
}

}  // namespace te
