// The cuDNN graph toolkit of attention_cudnn_graph.h.
#include "kernels/cuda/attention_cudnn_graph.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/check.h"
#include "kernels/status_macros.h"

namespace te {
namespace cuda {
namespace cudnn_graph {

absl::Status Declined(const std::string& what, cudnnStatus_t status) {
  if (status == CUDNN_STATUS_ALLOC_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": cuDNN is out of memory"));
  }
  return absl::UnimplementedError(absl::StrCat(what, ": ", cudnnGetErrorString(status)));
}

DescriptorSet::~DescriptorSet() {
  for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) {
    (void)cudnnBackendDestroyDescriptor(*it);
  }
}

absl::StatusOr<cudnnBackendDescriptor_t> DescriptorSet::Make(cudnnBackendDescriptorType_t type) {
  cudnnBackendDescriptor_t d = nullptr;
  const cudnnStatus_t status = cudnnBackendCreateDescriptor(type, &d);
  if (status != CUDNN_STATUS_SUCCESS) {
    return Declined(absl::StrCat("creating backend descriptor type ", static_cast<int>(type)),
                    status);
  }
  owned_.push_back(d);
  return d;
}

void DescriptorSet::Destroy(cudnnBackendDescriptor_t d) {
  for (auto it = owned_.begin(); it != owned_.end(); ++it) {
    if (*it == d) {
      (void)cudnnBackendDestroyDescriptor(d);
      owned_.erase(it);
      return;
    }
  }
}

absl::Status Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                 cudnnBackendAttributeType_t type, int64_t count, const void* values,
                 const char* what) {
  const cudnnStatus_t status = cudnnBackendSetAttribute(d, name, type, count, values);
  if (status != CUDNN_STATUS_SUCCESS) {
    return Declined(absl::StrCat(what, ": setting attribute ", static_cast<int>(name)), status);
  }
  return absl::OkStatus();
}

absl::Status SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                     cudnnBackendDescriptor_t value, const char* what) {
  return Set(d, name, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &value, what);
}

absl::Status Finalize(cudnnBackendDescriptor_t d, const char* what) {
  const cudnnStatus_t status = cudnnBackendFinalize(d);
  if (status != CUDNN_STATUS_SUCCESS)
    return Declined(absl::StrCat(what, " did not finalize"), status);
  return absl::OkStatus();
}

absl::StatusOr<cudnnBackendDescriptor_t> GraphBuilder::Tensor(int64_t uid, cudnnDataType_t type,
                                                              const Dims& dims, const Dims& strides,
                                                              bool is_virtual, bool by_value) {
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t t, set_.Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR));
  const char* what = "tensor";
  const int64_t rank = static_cast<int64_t>(dims.size());
  RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, what));
  RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, rank, dims.data(), what));
  RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, rank, strides.data(), what));
  RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid, what));
  RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &kAlignment, what));
  RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual, what));
  if (by_value) {
    RETURN_IF_ERROR(Set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, what));
  }
  RETURN_IF_ERROR(Finalize(t, "tensor"));
  return t;
}

absl::StatusOr<cudnnBackendDescriptor_t> GraphBuilder::Virtual(cudnnDataType_t type,
                                                               const Dims& dims,
                                                               const Dims& strides) {
  return Tensor(next_virtual_uid_++, type, dims, strides, /*is_virtual=*/true);
}

// A scalar passed by value from host memory at execution.
absl::StatusOr<cudnnBackendDescriptor_t> GraphBuilder::Scalar(int64_t uid, cudnnDataType_t type) {
  return Tensor(uid, type, {1, 1, 1, 1}, {1, 1, 1, 1}, /*is_virtual=*/false,
                /*by_value=*/true);
}

// y = mode(x, b) (or mode(x) when b is null; BINARY_SELECT: t ? x : b).
absl::Status GraphBuilder::Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math,
                                     cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                                     cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                                     int64_t axis) {
  const char* what = "pointwise";
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t pw, set_.Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR));
  RETURN_IF_ERROR(Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, what));
  RETURN_IF_ERROR(Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, what));
  if (axis >= 0) {
    RETURN_IF_ERROR(Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, what));
  }
  RETURN_IF_ERROR(Finalize(pw, what));
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                   set_.Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x, what));
  if (b != nullptr) RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b, what));
  if (t != nullptr) RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y, what));
  RETURN_IF_ERROR(Finalize(op, "pointwise operation"));
  ops_.push_back(op);
  return absl::OkStatus();
}

// c = a @ b (batched over the leading dims, f32 accumulation); the
// overrides (int32 [B,1,1,1]) bound M, N, K per batch for padding masks.
absl::Status GraphBuilder::Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                                  cudnnBackendDescriptor_t c, cudnnBackendDescriptor_t m_override,
                                  cudnnBackendDescriptor_t n_override,
                                  cudnnBackendDescriptor_t k_override) {
  const char* what = "matmul";
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t mm, set_.Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR));
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  RETURN_IF_ERROR(Set(mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
  RETURN_IF_ERROR(Finalize(mm, what));
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                   set_.Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, mm, what));
  if (m_override != nullptr) {
    RETURN_IF_ERROR(
        SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_override, what));
  }
  if (n_override != nullptr) {
    RETURN_IF_ERROR(
        SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_override, what));
  }
  if (k_override != nullptr) {
    RETURN_IF_ERROR(
        SetDesc(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_override, what));
  }
  RETURN_IF_ERROR(Finalize(op, "matmul operation"));
  ops_.push_back(op);
  return absl::OkStatus();
}

// y = reduce(x) over the dimensions where y has extent 1 (or fewer heads).
absl::Status GraphBuilder::Reduction(cudnnReduceTensorOp_t reduce, cudnnBackendDescriptor_t x,
                                     cudnnBackendDescriptor_t y) {
  const char* what = "reduction";
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t rd, set_.Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR));
  const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
  RETURN_IF_ERROR(
      Set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &reduce, what));
  RETURN_IF_ERROR(Set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp, what));
  RETURN_IF_ERROR(Finalize(rd, what));
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                   set_.Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd, what));
  RETURN_IF_ERROR(Finalize(op, "reduction operation"));
  ops_.push_back(op);
  return absl::OkStatus();
}

// y = x viewed with y's dims and strides (a transpose, for the matmuls).
absl::Status GraphBuilder::Reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
  const char* what = "reshape";
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op,
                   set_.Make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y, what));
  RETURN_IF_ERROR(Finalize(op, "reshape operation"));
  ops_.push_back(op);
  return absl::OkStatus();
}

// y = Bernoulli(keep_probability) from cuDNN's Philox stream (seed, offset).
absl::Status GraphBuilder::Rng(double keep_probability, cudnnBackendDescriptor_t seed,
                               cudnnBackendDescriptor_t offset, cudnnBackendDescriptor_t y) {
  const char* what = "rng";
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t rng, set_.Make(CUDNN_BACKEND_RNG_DESCRIPTOR));
  const cudnnRngDistribution_t distribution = CUDNN_RNG_DISTRIBUTION_BERNOULLI;
  RETURN_IF_ERROR(
      Set(rng, CUDNN_ATTR_RNG_DISTRIBUTION, CUDNN_TYPE_RNG_DISTRIBUTION, 1, &distribution, what));
  RETURN_IF_ERROR(Set(rng, CUDNN_ATTR_RNG_BERNOULLI_DIST_PROBABILITY, CUDNN_TYPE_DOUBLE, 1,
                      &keep_probability, what));
  RETURN_IF_ERROR(Finalize(rng, what));
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t op, set_.Make(CUDNN_BACKEND_OPERATION_RNG_DESCRIPTOR));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_YDESC, y, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_SEED, seed, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_OFFSET_DESC, offset, what));
  RETURN_IF_ERROR(SetDesc(op, CUDNN_ATTR_OPERATION_RNG_DESC, rng, what));
  RETURN_IF_ERROR(Finalize(op, "rng operation"));
  ops_.push_back(op);
  return absl::OkStatus();
}

absl::Status GraphBuilder::Finish(cudnnHandle_t handle) {
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t graph,
                   set_.Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR));
  RETURN_IF_ERROR(Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                      static_cast<int64_t>(ops_.size()), ops_.data(), "operation graph"));
  RETURN_IF_ERROR(Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle,
                      "operation graph"));
  RETURN_IF_ERROR(Finalize(graph, "the operation graph"));
  return MakePlan(handle, graph, plan_);
}

absl::Status VariantPack::Execute(cudnnHandle_t handle, const CudnnPlan& plan, void* workspace) {
  DescriptorSet set;
  ASSIGN_OR_RETURN(cudnnBackendDescriptor_t pack, set.Make(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR));
  const int64_t n = static_cast<int64_t>(uids_.size());
  RETURN_IF_ERROR(Set(pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids_.data(),
                      "variant pack"));
  RETURN_IF_ERROR(Set(pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n,
                      pointers_.data(), "variant pack"));
  RETURN_IF_ERROR(Set(pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace,
                      "variant pack"));
  RETURN_IF_ERROR(Finalize(pack, "the variant pack"));
  CUDNN_RETURN_IF_ERROR(cudnnBackendExecute(handle, plan.plan, pack));
  return absl::OkStatus();
}

}  // namespace cudnn_graph
}  // namespace cuda
}  // namespace te
