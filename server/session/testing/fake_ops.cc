#include "server/session/testing/fake_ops.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te::session::testing {
namespace {

thread_local std::string current_tag;

}  // namespace

// ---- FakeBackend -------------------------------------------------------------------

FakeBackend::CallTag::CallTag(std::string tag) : previous_(std::move(current_tag)) {
  current_tag = std::move(tag);
}

FakeBackend::CallTag::~CallTag() { current_tag = std::move(previous_); }

std::vector<FakeOpCall> FakeBackend::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

void FakeBackend::ClearCalls() {
  absl::MutexLock lock(&mu_);
  calls_.clear();
}

void FakeBackend::FailOp(const std::string& op, absl::Status status, int skip) {
  absl::MutexLock lock(&mu_);
  failures_[op] = Failure{std::move(status), skip};
}

bool FakeBackend::failure_pending(const std::string& op) const {
  absl::MutexLock lock(&mu_);
  return failures_.count(op) > 0;
}

void FakeBackend::ClearFailures() {
  absl::MutexLock lock(&mu_);
  failures_.clear();
}

void FakeBackend::BlockOp(const std::string& op, const std::string& tag) {
  absl::MutexLock lock(&mu_);
  blocked_op_ = op;
  blocked_tag_ = tag;
}

void FakeBackend::Unblock() {
  absl::MutexLock lock(&mu_);
  blocked_op_.clear();
  blocked_tag_.clear();
}

bool FakeBackend::WaitBlocked(int n, absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  struct Args {
    const FakeBackend* self;
    int n;
  } args{this, n};
  return mu_.AwaitWithTimeout(
      absl::Condition(
          +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->self->blocked_ >= a->n; }, &args),
      timeout);
}

int64_t FakeBackend::live_bytes() const {
  absl::MutexLock lock(&mu_);
  return live_bytes_;
}

int FakeBackend::max_ops_in_flight_per_stream() const {
  absl::MutexLock lock(&mu_);
  return max_per_stream_;
}

int FakeBackend::max_streams_in_flight() const {
  absl::MutexLock lock(&mu_);
  return max_streams_;
}

int FakeBackend::NewStream() {
  absl::MutexLock lock(&mu_);
  return ++streams_;
}

absl::Status FakeBackend::Enter(int stream, const char* op) {
  absl::MutexLock lock(&mu_);
  calls_.push_back(FakeOpCall{stream, op, current_tag});
  // In flight from here, blocked or not: a blocked op is a call still running.
  const int running = ++in_flight_[stream];
  max_per_stream_ = std::max(max_per_stream_, running);
  const int streams = static_cast<int>(std::count_if(
      in_flight_.begin(), in_flight_.end(), [](const auto& s) { return s.second > 0; }));
  max_streams_ = std::max(max_streams_, streams);
  if (Blocks(op, current_tag)) {
    ++blocked_;
    struct Args {
      FakeBackend* self;
      std::string op, tag;
    } args{this, op, current_tag};
    mu_.Await(absl::Condition(
        +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !a->self->Blocks(a->op, a->tag); },
        &args));
    --blocked_;
  }
  auto failure = failures_.find(op);
  if (failure != failures_.end() && failure->second.skip-- == 0) {
    absl::Status status = std::move(failure->second.status);
    failures_.erase(failure);
    --in_flight_[stream];
    return status;
  }
  return absl::OkStatus();
}

bool FakeBackend::Blocks(const std::string& op, const std::string& tag) const {
  return !blocked_op_.empty() && blocked_op_ == op &&
         (blocked_tag_.empty() || blocked_tag_ == tag);
}

void FakeBackend::Exit(int stream) {
  absl::MutexLock lock(&mu_);
  --in_flight_[stream];
}

void FakeBackend::Allocated(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  live_bytes_ += bytes;
}

void FakeBackend::Freed(int64_t bytes) {
  absl::MutexLock lock(&mu_);
  live_bytes_ -= bytes;
}

// ---- FakeOps -----------------------------------------------------------------------

class FakeOps final : public Ops {
 public:
  explicit FakeOps(std::shared_ptr<FakeBackend> backend)
      : backend_(std::move(backend)), stream_(backend_->NewStream()) {}

  std::string device_name() const override { return "cpu"; }

  absl::Status Upload(const void* src, Tensor* dst) override {
    return Run("Upload", [&] { std::memcpy(dst->data(), src, dst->nbytes()); });
  }
  absl::Status Download(const Tensor& src, void* dst) override {
    return Run("Download", [&] { std::memcpy(dst, src.data(), src.nbytes()); });
  }
  absl::Status Copy(const Tensor& src, Tensor* dst) override {
    if (src.nbytes() != dst->nbytes()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Copy: ", src.nbytes(), " bytes into ", dst->nbytes()));
    }
    return Run("Copy", [&] { std::memcpy(dst->data(), src.data(), src.nbytes()); });
  }
  absl::Status CopyRowsAt(const Tensor& src, const Tensor& position, Tensor* dst) override {
    return Run("CopyRowsAt");
  }
  absl::Status Synchronize() override { return Run("Synchronize"); }
  absl::Status Fill(float value, Tensor* y) override {
    return Run("Fill", [&] {
      if (y->dtype() == DType::kF32) {
        std::fill_n(y->data_as<float>(), y->numel(), value);
      } else if (value == 0.0f) {
        std::memset(y->data(), 0, y->nbytes());
      }
    });
  }

  absl::StatusOr<std::unique_ptr<OptimizerPlan>> NewOptimizerPlan(
      const OptimizerHyperparams& hyperparams, const std::vector<OptimizerSlot>& slots,
      const Tensor& count, const Tensor& total_notfinite) override {
    RETURN_IF_ERROR(Run("NewOptimizerPlan"));
    ASSIGN_OR_RETURN(Tensor info, Allocate(DType::kI32, {6}));
    return std::unique_ptr<OptimizerPlan>(
        new Plan(hyperparams, slots, count, total_notfinite, std::move(info)));
  }

  absl::Status Cast(const Tensor& x, Tensor* y) override { return Run("Cast"); }
  absl::Status Axpby(float alpha, const Tensor& a, float beta, const Tensor& b,
                     Tensor* y) override {
    return Run("Axpby");
  }
  absl::Status Permute(const Tensor& x, const std::vector<int>& perm, Tensor* y) override {
    return Run("Permute");
  }
  absl::Status SumRows(const Tensor& x, Tensor* y) override { return Run("SumRows"); }
  absl::Status Quantize(const Tensor& x, const Fp8Output& fp8, Tensor* y) override {
    return Run("Quantize");
  }
  absl::Status Dequantize(const Tensor& x, const Tensor& scale_inv, Tensor* y) override {
    return Run("Dequantize");
  }
  absl::Status Amax(const Tensor& x, Tensor* amax) override { return Run("Amax"); }
  absl::Status ScaleFromAmax(const Tensor& amax, float fp8_max, float margin, float epsilon,
                             Tensor* scale, Tensor* scale_inv) override {
    return Run("ScaleFromAmax");
  }
  absl::Status DelayedScalingUpdate(const DelayedScalingArgs& args, Tensor* amax_history,
                                    Tensor* scale, Tensor* scale_inv) override {
    return Run("DelayedScalingUpdate");
  }
  // The fakes compute no values, so there is no amax to count: the updates
  // run (and fail) one by one as the default runs them, non_finite untouched.
  absl::Status DelayedScalingUpdates(const std::vector<DelayedScalingItem>& items,
                                     Tensor* non_finite) override {
    return Ops::DelayedScalingUpdates(items, nullptr);
  }
  absl::Status FakeQuantizeBlockScaled(BlockFormat format, const Tensor& x, Tensor* y) override {
    return Run("FakeQuantizeBlockScaled");
  }
  absl::Status Gemm(const GemmArgs& args, Tensor* out) override { return Run("Gemm"); }
  absl::Status NormForward(const NormArgs& args, const Tensor& x, const Tensor& gamma,
                           const Tensor& beta, Tensor* y, Tensor* mu, Tensor* rsigma,
                           const Fp8Output* fp8) override {
    return Run("NormForward");
  }
  absl::Status NormBackward(const NormArgs& args, const Tensor& dy, const Tensor& x,
                            const Tensor& mu, const Tensor& rsigma, const Tensor& gamma, Tensor* dx,
                            Tensor* dgamma, Tensor* dbeta, const Tensor& residual_grad) override {
    return Run("NormBackward");
  }
  absl::Status ActivationForward(const std::vector<Activation>& acts, const Tensor& x, Tensor* y,
                                 const Fp8Output* fp8) override {
    return Run("ActivationForward");
  }
  absl::Status ActivationBackward(const std::vector<Activation>& acts, const Tensor& dy,
                                  const Tensor& x, Tensor* dx) override {
    return Run("ActivationBackward");
  }
  absl::Status DropoutForward(float rate, uint64_t seed, const Tensor& x, Tensor* y,
                              Tensor* mask) override {
    return Run("DropoutForward");
  }
  absl::Status DropoutBackward(float rate, const Tensor& dy, const Tensor& mask,
                               Tensor* dx) override {
    return Run("DropoutBackward");
  }
  absl::Status AttentionForward(const AttentionArgs& args, const Tensor& q, const Tensor& k,
                                const Tensor& v, Tensor* out, Tensor* softmax_lse) override {
    return Run("AttentionForward");
  }
  absl::Status AttentionBackward(const AttentionArgs& args, const Tensor& q, const Tensor& k,
                                 const Tensor& v, const Tensor& out, const Tensor& dout,
                                 const Tensor& softmax_lse, Tensor* dq, Tensor* dk, Tensor* dv,
                                 Tensor* dbias) override {
    return Run("AttentionBackward");
  }
  absl::Status OptimizerUpdate(const OptimizerUpdateArgs& args, const Tensor& grad,
                               const Tensor& grad_norm_sq, Tensor* param, Tensor* mu,
                               Tensor* nu) override {
    return Run("OptimizerUpdate");
  }
  absl::Status OptimizerStep(OptimizerPlan& plan, const std::vector<OptimizerSlot>& slots,
                             const std::vector<Tensor>& grads, Tensor* count,
                             Tensor* total_notfinite) override {
    return Run("OptimizerStep");
  }
  absl::Status EmbedForward(const Tensor& table, const Tensor& ids, Tensor* y) override {
    return Run("EmbedForward");
  }
  absl::Status EmbedBackward(const Tensor& dy, const Tensor& ids, Tensor* dtable) override {
    return Run("EmbedBackward");
  }
  absl::Status SoftmaxCrossEntropyForward(const Tensor& logits, const Tensor& labels, Tensor* loss,
                                          Tensor* lse) override {
    return Run("SoftmaxCrossEntropyForward");
  }
  absl::Status SoftmaxCrossEntropyBackward(const Tensor& logits, const Tensor& labels,
                                           const Tensor& lse, const Tensor& dloss,
                                           Tensor* dlogits) override {
    return Run("SoftmaxCrossEntropyBackward");
  }
  absl::Status ArgmaxLast(const Tensor& x, Tensor* y) override { return Run("ArgmaxLast"); }
  absl::Status AddScalarI32(int32_t value, Tensor* y) override { return Run("AddScalarI32"); }
  absl::Status Rotary(const RotaryArgs& args, const Tensor& x, Tensor* y) override {
    return Run("Rotary");
  }
  absl::Status RelativeBiasForward(const Tensor& table, const Tensor& buckets,
                                   const Tensor& first_row, Tensor* bias) override {
    return Run("RelativeBiasForward");
  }
  absl::Status RelativeBiasBackward(const Tensor& dbias, const Tensor& buckets,
                                    Tensor* dtable) override {
    return Run("RelativeBiasBackward");
  }

 protected:
  absl::StatusOr<std::shared_ptr<void>> AllocateBytes(size_t bytes) override {
    RETURN_IF_ERROR(Run("Allocate"));
    void* memory = std::calloc(bytes, 1);
    if (memory == nullptr) return absl::ResourceExhaustedError("calloc failed");
    backend_->Allocated(static_cast<int64_t>(bytes));
    std::shared_ptr<FakeBackend> backend = backend_;
    return std::shared_ptr<void>(memory, [backend, bytes](void* p) {
      std::free(p);
      backend->Freed(static_cast<int64_t>(bytes));
    });
  }

 private:
  class Plan final : public OptimizerPlan {
   public:
    Plan(const OptimizerHyperparams& hyperparams, const std::vector<OptimizerSlot>& slots,
         const Tensor& count, const Tensor& total_notfinite, Tensor info) {
      Remember(hyperparams, slots, count, total_notfinite);
      info_ = std::move(info);
    }
  };

  // Records `op`; runs `effect` (the bytes it moves) unless a failure was armed.
  template <typename Effect>
  absl::Status Run(const char* op, Effect effect) {
    RETURN_IF_ERROR(backend_->Enter(stream_, op));
    effect();
    backend_->Exit(stream_);
    return absl::OkStatus();
  }
  absl::Status Run(const char* op) {
    return Run(op, [] {});
  }

  const std::shared_ptr<FakeBackend> backend_;
  const int stream_;
};

// ---- FakeDevice --------------------------------------------------------------------

DeviceInfo FakeDevice::info() const {
  DeviceInfo info;
  info.name = "cpu";
  info.description = "fake device (ops recorded, not computed)";
  info.memory_bytes = int64_t{1} << 30;
  return info;
}

absl::StatusOr<std::unique_ptr<Ops>> FakeDevice::NewOps(int64_t memory_limit) {
  auto ops = std::make_unique<FakeOps>(backend_);
  ops->set_memory_limit(memory_limit);
  return std::unique_ptr<Ops>(std::move(ops));
}

}  // namespace te::session::testing
