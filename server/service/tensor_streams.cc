#include "server/service/tensor_streams.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kernels/status_macros.h"
#include "server/service/chunk_wire.h"
#include "server/service/executor.h"
#include "server/service/queued_turn.h"
#include "server/service/service_core.h"
#include "server/service/status.h"
#include "server/session/tensor_upload.h"

namespace te::service {
namespace {

using session::SessionManager;

// Messages read but not yet copied into place (contract 2).
constexpr int kMaxPendingChunks = 2;

absl::Status InMessage(const absl::Status& status, int index, const char* what) {
  return absl::Status(status.code(),
                      absl::StrCat(what, " (message ", index, "): ", status.message()));
}

// ---- PutTensor -------------------------------------------------------------------

class PutTensorCall final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PutTensorCall(const ServiceCore& core, grpc::CallbackServerContext* context,
                grpc::ByteBuffer* response)
      : core_(core),
        context_(context),
        response_(response),
        start_(absl::Now()),
        deadline_(DeadlineOf(*context)),
        queued_(deadline_) {
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    Phase phase;
    {
      absl::MutexLock lock(&mu_);
      phase = phase_;
    }
    if (phase == Phase::kHeader) {
      OnHeader(ok);
    } else {
      OnData(ok);
    }
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      if (phase_ == Phase::kStreaming) EndLocked(CancelReason(deadline_));
    }
    queued_.Cancel();  // drops the call if it still waits for its turn
  }

  void OnDone() override { Unref(); }

 private:
  enum class Phase { kHeader, kQueued, kStreaming };

  // Before the turn: nothing to undo.
  void FinishEarly(const absl::Status& status) {
    Finish(core_.Finished("PutTensor", session_id_, status, start_));
  }

  void OnHeader(bool ok) {
    if (!ok) {
      FinishEarly(context_->IsCancelled()
                      ? CancelReason(deadline_)
                      : absl::InvalidArgumentError(
                            "header: the stream ended before its first message, the header"));
      return;
    }
    PutChunk first;
    if (absl::Status parsed = ParsePutChunk(incoming_, &first); !parsed.ok()) {
      FinishEarly(InMessage(parsed, 1, "header"));
      return;
    }
    if (!first.is_header) {
      FinishEarly(
          absl::InvalidArgumentError("header: the stream's first message must be a header"));
      return;
    }
    header_ = std::move(first.header);
    session_id_ = header_.session().session_id();
    // Set before Submit: the call may start at once on a worker.
    {
      absl::MutexLock lock(&mu_);
      phase_ = Phase::kQueued;
    }
    absl::Status queued = queued_.SubmitForSession(
        core_, header_.session(), [this](DeviceExecutor::Turn turn) { OnTurn(std::move(turn)); },
        [this](absl::Status reason) { FinishEarly(reason); });
    if (!queued.ok()) FinishEarly(queued);
  }

  // On a worker, in the session's turn.
  void OnTurn(DeviceExecutor::Turn turn) {
    call_ = queued_.Context(context_);
    // The upload is the session's call from here until Cleanup: a SessionTurn
    // (RunInSessionTurn's, held across the stream's messages).
    std::unique_ptr<session::TensorUpload> upload;
    std::optional<SessionTurn> in_session;
    absl::Status status = [&]() -> absl::Status {
      RETURN_IF_ERROR(call_.StillWanted("PutTensor"));
      ASSIGN_OR_RETURN(SessionTurn entered,
                       SessionTurn::Enter(core_, session_id_, &header_.session().token()));
      in_session.emplace(std::move(entered));
      ASSIGN_OR_RETURN(upload, NoThrow([&] { return in_session->session().BeginPut(header_); }));
      return absl::OkStatus();
    }();
    if (!status.ok()) {
      if (in_session) status = in_session->Leave(status, call_, "PutTensor");
      in_session.reset();  // the session's lease
      turn.Release();
      FinishEarly(status);
      return;
    }
    bool cancelled = false;
    {
      absl::MutexLock lock(&mu_);
      session_.emplace(*std::move(in_session));
      upload_ = std::move(upload);
      turn_ = std::move(turn);
      phase_ = Phase::kStreaming;
      cancelled = cancelled_;  // a cancel that came while this started
      if (cancelled) {
        EndLocked(CancelReason(deadline_));
      } else {
        reading_ = true;
      }
    }
    if (!cancelled) StartRead(&incoming_);
  }

  // On gRPC's threads, while streaming.
  void OnData(bool ok) {
    PutChunk chunk;
    absl::Status parsed;
    if (ok) parsed = ParsePutChunk(incoming_, &chunk);
    bool read_next = false;
    {
      absl::MutexLock lock(&mu_);
      reading_ = false;
      if (ending_) return;
      if (!ok) {
        end_of_stream_ = true;
        if (absl::Status wanted = call_.StillWanted("PutTensor"); !wanted.ok()) {
          EndLocked(wanted);
        } else {
          PostLocked([this] { Commit(); });
        }
        return;
      }
      const int index = ++messages_;
      if (!parsed.ok()) {
        EndLocked(InMessage(parsed, index, "data"));
        return;
      }
      if (chunk.is_header) {
        EndLocked(absl::InvalidArgumentError(
            absl::StrCat("message ", index, ": only the first message may be a header")));
        return;
      }
      if (header_.has_shm()) {
        EndLocked(absl::InvalidArgumentError(absl::StrCat(
            "message ", index, ": the header named shared memory, so no data may follow")));
        return;
      }
      ++pending_;
      auto shared = std::make_shared<PutChunk>(std::move(chunk));
      PostLocked([this, shared, index] { Append(*shared, index); });
      if (pending_ < kMaxPendingChunks) read_next = reading_ = true;
    }
    if (read_next) StartRead(&incoming_);
  }

  // On the executor, in order.
  void Append(const PutChunk& chunk, int index) {
    {
      absl::MutexLock lock(&mu_);
      if (ending_) {
        --pending_;
        return;
      }
    }
    absl::Status status;
    for (absl::string_view piece : chunk.data) {
      status = NoThrow([&] { return upload_->Append(piece.data(), piece.size()); });
      if (!status.ok()) break;
    }
    bool read_next = false;
    {
      absl::MutexLock lock(&mu_);
      --pending_;
      if (!status.ok()) {
        EndLocked(InMessage(status, index, "data"));
        return;
      }
      if (!reading_ && !end_of_stream_ && !ending_) read_next = reading_ = true;
    }
    if (read_next) StartRead(&incoming_);
  }

  // On the executor, after the last message.
  void Commit() {
    {
      absl::MutexLock lock(&mu_);
      if (ending_) return;
    }
    te::v1::PutTensorResponse response;
    absl::Status status =
        NoThrow([&] { return session_->session().CommitPut(std::move(upload_), &response); });
    if (status.ok()) *response_ = Serialize(response);
    absl::MutexLock lock(&mu_);
    EndLocked(status);
  }

  // Ends the stream once, from any thread: the cleanup runs on the executor,
  // in the session's turn, after the work already posted.
  void EndLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ending_) return;
    ending_ = true;
    end_status_ = status;
    PostLocked([this] { Cleanup(); });
  }

  void Cleanup() {
    absl::Status status;
    {
      absl::MutexLock lock(&mu_);
      status = end_status_;
    }
    // A failed or abandoned upload frees its tensor here, in the turn.
    upload_.reset();
    status = session_->Leave(std::move(status), call_, "PutTensor");
    session_.reset();
    {
      absl::MutexLock lock(&mu_);
      turn_.Release();
    }
    Finish(core_.Finished("PutTensor", session_id_, status, start_));
  }

  // Runs `fn` on the executor in the session's turn; the reactor lives until
  // it has run.
  void PostLocked(std::function<void()> fn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ++refs_;
    turn_.Post([this, fn = std::move(fn)] {
      fn();
      Unref();
    });
  }

  void Unref() {
    bool last = false;
    {
      absl::MutexLock lock(&mu_);
      last = --refs_ == 0;
    }
    if (last) delete this;
  }

  const ServiceCore& core_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;
  const absl::Time start_;
  const absl::Time deadline_;
  grpc::ByteBuffer incoming_;  // one read in flight at a time
  te::v1::PutTensorHeader header_;
  std::string session_id_;
  QueuedTurn queued_;
  // Used in the session's turn only (OnTurn, then the posted work).
  session::CallContext call_;
  std::optional<SessionTurn> session_;
  std::unique_ptr<session::TensorUpload> upload_;

  absl::Mutex mu_;
  Phase phase_ ABSL_GUARDED_BY(mu_) = Phase::kHeader;
  DeviceExecutor::Turn turn_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool reading_ ABSL_GUARDED_BY(mu_) = false;
  bool end_of_stream_ ABSL_GUARDED_BY(mu_) = false;
  bool ending_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status end_status_ ABSL_GUARDED_BY(mu_);
  int messages_ ABSL_GUARDED_BY(mu_) = 1;  // the header was message 1
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  int refs_ ABSL_GUARDED_BY(mu_) = 1;  // gRPC's, until OnDone
};

// ---- GetTensor -------------------------------------------------------------------

class GetTensorCall final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  GetTensorCall(const ServiceCore& core, grpc::CallbackServerContext* context,
                const grpc::ByteBuffer* request)
      : core_(core), context_(context), start_(absl::Now()), queued_(DeadlineOf(*context)) {
    if (absl::Status parsed = Parse(*request, &request_); !parsed.ok()) {
      End(parsed);
      return;
    }
    session_id_ = request_.session().session_id();
    absl::Status queued = queued_.SubmitForSession(
        core_, request_.session(), [this](DeviceExecutor::Turn turn) { OnTurn(std::move(turn)); },
        [this](absl::Status reason) { End(reason); });
    if (!queued.ok()) End(queued);
  }

  // Drops the call if it still waits; the chunks already being written stop
  // at the next write, which fails.
  void OnCancel() override { queued_.Cancel(); }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::CancelledError("the client went away during the stream"));
      return;
    }
    if (sent_ == source_.bytes) {
      End(absl::OkStatus());
      return;
    }
    const int64_t n = std::min(source_.chunk_bytes, source_.bytes - sent_);
    outgoing_ = DataMessage(source_.keepalive, source_.data + sent_, static_cast<size_t>(n));
    sent_ += n;
    StartWrite(&outgoing_);
  }

  void OnDone() override { delete this; }

 private:
  void OnTurn(DeviceExecutor::Turn turn) {
    const absl::Status read = RunInSessionTurn(
        core_, "GetTensor", session_id_, &request_.session().token(), queued_.Context(context_),
        [this](SessionManager::Lease& lease, const session::CallContext&) -> absl::Status {
          ASSIGN_OR_RETURN(source_, lease.session().ReadTensor(request_));
          return absl::OkStatus();
        });
    turn.Release();  // the stream goes out without holding the session up
    if (!read.ok()) {
      End(read);
      return;
    }
    outgoing_ = HeaderMessage(source_.header);
    StartWrite(&outgoing_);  // `this` may be gone once this returns
  }

  void End(const absl::Status& status) {
    Finish(core_.Finished("GetTensor", session_id_, status, start_));
  }

  const ServiceCore& core_;
  grpc::CallbackServerContext* const context_;
  const absl::Time start_;
  QueuedTurn queued_;
  te::v1::GetTensorRequest request_;
  std::string session_id_;
  session::Session::TensorSource source_;
  int64_t sent_ = 0;
  grpc::ByteBuffer outgoing_;  // one write in flight at a time
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* StartPutTensor(const ServiceCore& core,
                                                          grpc::CallbackServerContext* context,
                                                          grpc::ByteBuffer* response) {
  return new PutTensorCall(core, context, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartGetTensor(const ServiceCore& core,
                                                           grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request) {
  return new GetTensorCall(core, context, request);
}

}  // namespace te::service
