#include "server/service/generate_stream.h"

#include <deque>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "server/service/executor.h"
#include "server/service/queued_turn.h"
#include "server/service/service_core.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"

namespace te::service {
namespace {

using session::SessionManager;

class GenerateCall final : public grpc::ServerWriteReactor<te::v1::GenerateResponse> {
 public:
  GenerateCall(const ServiceCore& core, grpc::CallbackServerContext* context,
               const te::v1::GenerateRequest* request)
      : core_(core),
        context_(context),
        request_(request),
        session_id_(request->session().session_id()),
        start_(absl::Now()),
        queued_(DeadlineOf(*context)) {
    absl::Status queued = queued_.SubmitForSession(
        core_, request_->session(), [this](DeviceExecutor::Turn turn) { OnTurn(std::move(turn)); },
        [this](absl::Status reason) { End(reason); });
    if (!queued.ok()) End(queued);
  }

  // Drops the call if it still waits; a running generation sees the cancel
  // between tokens.
  void OnCancel() override { queued_.Cancel(); }

  void OnWriteDone(bool ok) override {
    bool write_next = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!ok) {
        // The client went away: what is left goes nowhere (contract 3).
        client_gone_ = true;
        pending_.clear();
      } else if (!pending_.empty()) {
        outgoing_ = std::move(pending_.front());
        pending_.pop_front();
        write_next = writing_ = true;
      }
    }
    if (write_next) {
      StartWrite(&outgoing_);
    } else {
      MaybeEnd();
    }
  }

  void OnDone() override { delete this; }

 private:
  // On the executor, in the session's turn (contract 1).
  void OnTurn(DeviceExecutor::Turn turn) {
    const absl::Status status = RunInSessionTurn(
        core_, "Generate", session_id_, &request_->session().token(), queued_.Context(context_),
        [this](SessionManager::Lease& lease, const session::CallContext& call) {
          return lease.session().Generate(
              *request_, [this](const te::v1::GenerateResponse& step) { return Send(step); }, call);
        });
    turn.Release();  // the session's next call may start while the last steps go out
    {
      absl::MutexLock lock(&mu_);
      generated_ = true;
      status_ = status;
    }
    MaybeEnd();
  }

  // Generation's sink, on the executor (contract 2).
  absl::Status Send(const te::v1::GenerateResponse& step) {
    {
      absl::MutexLock lock(&mu_);
      if (client_gone_) {
        return absl::CancelledError("Generate: the client went away during the stream");
      }
      if (writing_) {
        pending_.push_back(step);
        return absl::OkStatus();
      }
      outgoing_ = step;
      writing_ = true;
    }
    StartWrite(&outgoing_);
    return absl::OkStatus();
  }

  // Ends the stream once generation has ended and nothing is left to write
  // (contract 3); `this` may be gone when it returns.
  void MaybeEnd() {
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      if (ended_ || !generated_ || writing_ || !pending_.empty()) return;
      ended_ = true;
      status = status_;
      if (status.ok() && client_gone_) {
        status = absl::CancelledError("Generate: the client went away during the stream");
      }
    }
    End(status);
  }

  void End(const absl::Status& status) {
    Finish(core_.Finished("Generate", session_id_, status, start_));
  }

  const ServiceCore& core_;
  grpc::CallbackServerContext* const context_;
  const te::v1::GenerateRequest* const request_;  // gRPC's, alive until OnDone
  const std::string session_id_;
  const absl::Time start_;
  QueuedTurn queued_;

  absl::Mutex mu_;
  te::v1::GenerateResponse outgoing_;  // the write in flight; guarded by writing_
  std::deque<te::v1::GenerateResponse> pending_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool client_gone_ ABSL_GUARDED_BY(mu_) = false;
  bool generated_ ABSL_GUARDED_BY(mu_) = false;  // generation has ended, with status_
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

grpc::ServerWriteReactor<te::v1::GenerateResponse>* StartGenerate(
    const ServiceCore& core, grpc::CallbackServerContext* context,
    const te::v1::GenerateRequest* request) {
  return new GenerateCall(core, context, request);
}

}  // namespace te::service
