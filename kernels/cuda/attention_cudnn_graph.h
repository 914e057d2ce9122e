// A small toolkit over cuDNN 9's graph (backend) API, written by hand because
// cuDNN's C++ frontend is not available here: descriptors owned as a set, an
// operation-graph builder (tensors, pointwise, matmul, reduction, reshape,
// rng) that ends in an execution plan, and the variant pack that binds device
// pointers to a plan's tensors at execution. Not thread-safe; a plan is built
// once and then only read.
//
// Every cuDNN refusal becomes UNIMPLEMENTED (the caller falls back to its own
// kernels), an allocation failure RESOURCE_EXHAUSTED.
#ifndef TE_KERNELS_CUDA_ATTENTION_CUDNN_GRAPH_H_
#define TE_KERNELS_CUDA_ATTENTION_CUDNN_GRAPH_H_

#include <cudnn.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace te {
namespace cuda {
namespace cudnn_graph {

// UIDs of the tensors a call binds in its variant pack. Virtual tensors
// (intermediates that never reach memory) count up from kFirstVirtual.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kSeqQ,
  kSeqKv,
  kSeed,
  kOffset,
  kDropScale,
  kKeepProbability,
  kNegInf,
  kOne,
  kDO,
  kDQ,
  kDK,
  kDV,
  kSoftmaxSum,
  kDQAccum,
  kBias,
  kDBias,
  kFirstVirtual = 1000,
};

constexpr int64_t kAlignment = 16;  // bytes, promised for every bound tensor

// UNIMPLEMENTED naming what cuDNN declined (RESOURCE_EXHAUSTED for ALLOC_FAILED).
absl::Status Declined(const std::string& what, cudnnStatus_t status);

// Owns backend descriptors; destroys them in reverse order of creation.
class DescriptorSet {
 public:
  DescriptorSet() = default;
  DescriptorSet(const DescriptorSet&) = delete;
  DescriptorSet& operator=(const DescriptorSet&) = delete;
  ~DescriptorSet();

  absl::StatusOr<cudnnBackendDescriptor_t> Make(cudnnBackendDescriptorType_t type);

  // Destroys one descriptor early (a plan that did not finalize).
  void Destroy(cudnnBackendDescriptor_t d);

 private:
  std::vector<cudnnBackendDescriptor_t> owned_;
};

absl::Status Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                 cudnnBackendAttributeType_t type, int64_t count, const void* values,
                 const char* what);
absl::Status SetDesc(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                     cudnnBackendDescriptor_t value, const char* what);
absl::Status Finalize(cudnnBackendDescriptor_t d, const char* what);

// One built graph: its descriptors (kept alive with the plan) and the plan.
struct CudnnPlan {
  DescriptorSet descriptors;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace_bytes = 0;
};

using Dims = std::vector<int64_t>;

// Builds an operation graph op by op, then its execution plan (into the
// CudnnPlan given, which owns every descriptor made on the way).
class GraphBuilder {
 public:
  explicit GraphBuilder(CudnnPlan* plan) : set_(plan->descriptors), plan_(plan) {}

  absl::StatusOr<cudnnBackendDescriptor_t> Tensor(int64_t uid, cudnnDataType_t type,
                                                  const Dims& dims, const Dims& strides,
                                                  bool is_virtual = false,
                                                  bool by_value = false);

  absl::StatusOr<cudnnBackendDescriptor_t> Virtual(cudnnDataType_t type, const Dims& dims,
                                                   const Dims& strides);

  // A scalar passed by value from host memory at execution.
  absl::StatusOr<cudnnBackendDescriptor_t> Scalar(int64_t uid, cudnnDataType_t type);

  // y = mode(x, b) (or mode(x) when b is null; BINARY_SELECT: t ? x : b).
  absl::Status Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t math,
                         cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                         cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                         int64_t axis = -1);

  // c = a @ b (batched over the leading dims, f32 accumulation); the
  // overrides (int32 [B,1,1,1]) bound M, N, K per batch for padding masks.
  absl::Status Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b,
                      cudnnBackendDescriptor_t c, cudnnBackendDescriptor_t m_override,
                      cudnnBackendDescriptor_t n_override, cudnnBackendDescriptor_t k_override);

  // y = reduce(x) over the dimensions where y has extent 1 (or fewer heads).
  absl::Status Reduction(cudnnReduceTensorOp_t reduce, cudnnBackendDescriptor_t x,
                         cudnnBackendDescriptor_t y);

  // y = x viewed with y's dims and strides (a transpose, for the matmuls).
  absl::Status Reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y);

  // y = Bernoulli(keep_probability) from cuDNN's Philox stream (seed, offset).
  absl::Status Rng(double keep_probability, cudnnBackendDescriptor_t seed,
                   cudnnBackendDescriptor_t offset, cudnnBackendDescriptor_t y);

  // The operation graph and its plan (MakePlan); sets the plan and its
  // workspace size.
  absl::Status Finish(cudnnHandle_t handle);

 private:
  DescriptorSet& set_;
  CudnnPlan* plan_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_uid_ = kFirstVirtual;
};

// The plan of a finalized operation graph (attention_cudnn_engines.cc): the
// first engine config of heuristic mode A whose plan finalizes, or, while a
// probe has set SetEngineCandidate(i), the i-th of EngineCandidates. Its
// descriptors go into plan->descriptors.
absl::Status MakePlan(cudnnHandle_t handle, cudnnBackendDescriptor_t graph, CudnnPlan* plan);

// Every engine config a probe may time for one graph: heuristic modes A, B
// and FALLBACK in turn, then mode A's first config with one knob at a time
// set to each other value it allows (at most kMaxKnobValues a knob).
constexpr int kMaxKnobValues = 64;
absl::StatusOr<std::vector<cudnnBackendDescriptor_t>> EngineCandidates(
    cudnnBackendDescriptor_t graph, DescriptorSet& set);
// "engine G knobs T=V,..." of a config, for a probe's table.
std::string DescribeEngineConfig(cudnnBackendDescriptor_t config);

// Process-wide, for bench/kernels/cudnn_engine_probe only: -1 (the default)
// builds plans as the product does; i >= 0 makes MakePlan take candidate i
// (UNIMPLEMENTED past the last, or where it does not finalize). The last
// MakePlan's choice and candidate count are kept for the probe to print.
void SetEngineCandidate(int index);
struct EngineChoice {
  int candidates = 0;       // EngineCandidates' size (0 on the product's path)
  std::string description;  // DescribeEngineConfig of the plan made, or why none
};
EngineChoice LastEngineChoice();

// The device (or, for by-value scalars, host) pointers of one execution.
// Bound pointers must stay valid until Execute returns.
class VariantPack {
 public:
  void Bind(int64_t uid, const void* p) {
    uids_.push_back(uid);
    pointers_.push_back(const_cast<void*>(p));
  }

  // Enqueues the plan on the handle's stream; workspace holds at least
  // plan.workspace_bytes.
  absl::Status Execute(cudnnHandle_t handle, const CudnnPlan& plan, void* workspace);

 private:
  std::vector<int64_t> uids_;
  std::vector<void*> pointers_;
};

}  // namespace cudnn_graph
}  // namespace cuda
}  // namespace te

#endif  // TE_KERNELS_CUDA_ATTENTION_CUDNN_GRAPH_H_
