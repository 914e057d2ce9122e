// CudaOps::AttentionForward / AttentionBackward: argument checks, then cuDNN's
// fused SDPA (attention_cudnn.cc) where it takes the call, else the unfused
// kernels (attention_fallback.cu). The first fallback of each configuration
// is logged once on stderr with cuDNN's reason.
//
// With dropout, forward and backward must draw the same mask, and cuDNN's
// Philox stream is not kernels/rng.h's: such a call goes to cuDNN only when
// cuDNN takes both its forward and its backward (decided identically in both
// directions), else both run unfused.
#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/attention_internal.h"
#include "kernels/cuda/check.h"
#include "kernels/cuda/cuda_ops.h"
#include "kernels/op_checks.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace {

std::atomic<int> attention_path{static_cast<int>(AttentionPath::kAuto)};

__global__ void WriteDropoutSeedKernel(int64_t* dst, uint64_t seed) {
  dst[0] = static_cast<int64_t>(seed);
  dst[1] = 0;
}

const char* MaskName(MaskType mask) {
  switch (mask) {
    case MaskType::kNoMask: return "no_mask";
    case MaskType::kPadding: return "padding";
    case MaskType::kCausal: return "causal";
    case MaskType::kPaddingCausal: return "padding_causal";
  }
  return "?";
}

bool HasPadding(MaskType mask) {
  return mask == MaskType::kPadding || mask == MaskType::kPaddingCausal;
}

// The configuration as the fallback log names it.
std::string Describe(const char* direction, const AttentionArgs& args, const AttentionShape& s,
                     DType dtype) {
  return absl::StrCat(direction, " ", DTypeName(dtype), " q [", s.batch, ", ", s.q_seq, ", ",
                      s.q_heads, ", ", s.head_dim, "] kv [", s.batch, ", ", s.kv_seq, ", ",
                      s.kv_heads, ", ", s.head_dim, "] mask ", MaskName(args.mask), " dropout ",
                      args.dropout_rate, args.bias.defined() ? " bias" : "");
}

void LogFallbackOnce(const std::string& config, const absl::Status& reason) {
  static std::mutex mu;
  static std::set<std::string>* logged = new std::set<std::string>();
  std::lock_guard<std::mutex> lock(mu);
  if (!logged->insert(config).second) return;
  std::fprintf(stderr, "te_server: attention %s runs unfused (cuDNN fused attention declined: %s)\n",
               config.c_str(), std::string(reason.message()).c_str());
}

AttentionProblem MakeProblem(const AttentionArgs& args, const AttentionShape& shape,
                             const Tensor& q, const Tensor& k, const Tensor& v) {
  AttentionProblem p;
  p.shape = shape;
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.q_dtype = q.dtype();
  p.k_dtype = k.dtype();
  p.v_dtype = v.dtype();
  p.bias = args.bias.data_as<const float>();  // null when absent
  if (HasPadding(args.mask)) {
    p.q_seqlens = args.q_seqlens.data_as<const int32_t>();
    p.kv_seqlens = args.kv_seqlens.data_as<const int32_t>();
  }
  p.causal = args.mask == MaskType::kCausal || args.mask == MaskType::kPaddingCausal;
  p.scale = args.scale;
  p.dropout_rate = args.dropout_rate;
  p.dropout_seed = args.dropout_seed;
  return p;
}

}  // namespace

absl::Status WriteDropoutSeed(int64_t* dst, uint64_t seed, cudaStream_t stream) {
  WriteDropoutSeedKernel<<<1, 1, 0, stream>>>(dst, seed);
  CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

void SetAttentionPath(AttentionPath path) { attention_path.store(static_cast<int>(path)); }
AttentionPath GetAttentionPath() { return static_cast<AttentionPath>(attention_path.load()); }

absl::Status CudaOps::AttentionForward(const AttentionArgs& args, const Tensor& q,
                                       const Tensor& k, const Tensor& v, Tensor* out,
                                       Tensor* softmax_lse) {
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionForwardArgs(args, q, k, v, out, softmax_lse));
  if (out->numel() == 0) return absl::OkStatus();

  if (GetAttentionPath() == AttentionPath::kAuto) {
    const absl::Status fused = CudnnAttentionForward(this, args, shape, q, k, v, out, softmax_lse);
    if (!absl::IsUnimplemented(fused)) return fused;
    LogFallbackOnce(Describe("forward", args, shape, q.dtype()), fused);
  }
  return FallbackAttentionForward(MakeProblem(args, shape, q, k, v), out->data(), out->dtype(),
                                  softmax_lse->data_as<float>(), stream());
}

absl::Status CudaOps::AttentionBackward(const AttentionArgs& args, const Tensor& q,
                                        const Tensor& k, const Tensor& v, const Tensor& out,
                                        const Tensor& dout, const Tensor& softmax_lse,
                                        Tensor* dq, Tensor* dk, Tensor* dv, Tensor* dbias) {
  RETURN_IF_ERROR(Enter());
  ASSIGN_OR_RETURN(const AttentionShape shape,
                   CheckAttentionBackwardArgs(args, q, k, v, out, dout, softmax_lse, dq, dk, dv,
                                              dbias));
  const bool with_bias = args.bias.data() != nullptr;
  if (q.numel() == 0 && k.numel() == 0) return absl::OkStatus();

  if (GetAttentionPath() == AttentionPath::kAuto) {
    const absl::Status fused = CudnnAttentionBackward(this, args, shape, q, k, v, out, dout,
                                                      softmax_lse, dq, dk, dv, dbias);
    if (!absl::IsUnimplemented(fused)) return fused;
    LogFallbackOnce(Describe("backward", args, shape, q.dtype()), fused);
  }
  const size_t rows = static_cast<size_t>(shape.batch * shape.q_heads * shape.q_seq);
  ASSIGN_OR_RETURN(void* row_dot, Workspace(rows * sizeof(float)));
  return FallbackAttentionBackward(MakeProblem(args, shape, q, k, v), dout.data(), dout.dtype(),
                                   softmax_lse.data_as<float>(), dq->data(), dq->dtype(),
                                   dk->data(), dk->dtype(), dv->data(), dv->dtype(),
                                   with_bias ? dbias->data_as<float>() : nullptr,
                                   static_cast<float*>(row_dot), stream());
}

// Not yet in place: the defaults (split and stack with Permute).
absl::Status CudaOps::AttentionForwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                             Tensor* out, Tensor* softmax_lse) {
  return Ops::AttentionForwardPacked(args, qkv, out, softmax_lse);
}

absl::Status CudaOps::AttentionBackwardPacked(const AttentionArgs& args, const Tensor& qkv,
                                              const Tensor& out, const Tensor& dout,
                                              const Tensor& softmax_lse, Tensor* dqkv,
                                              Tensor* dbias) {
  return Ops::AttentionBackwardPacked(args, qkv, out, dout, softmax_lse, dqkv, dbias);
}

}  // namespace cuda
}  // namespace te
