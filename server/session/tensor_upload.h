// TensorUpload: a tensor that arrives in pieces (a PutTensor stream), written
// into its final device allocation piece by piece: never gathered whole on the
// host first.
//
// On the CPU each piece is copied straight into place. On other devices the
// pieces gather in a double-buffered host staging area (Ops::AllocateStaging:
// page-locked on CUDA) and each full half goes up with Ops::UploadAsync on the
// session's stream while the other half fills; a half is refilled only after
// the stream has finished with it.
//
// Not thread-safe: it uses the session's Ops, so every method (and the
// destructor, which waits for copies in flight) runs in the session's turn.
#ifndef TE_SERVER_SESSION_TENSOR_UPLOAD_H_
#define TE_SERVER_SESSION_TENSOR_UPLOAD_H_

#include <cstddef>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/ops.h"
#include "kernels/tensor.h"

namespace te::session {

class TensorUpload {
 public:
  // Bytes per staging half (two halves per upload on a device other than the CPU).
  static constexpr size_t kStagingHalfBytes = size_t{4} << 20;

  // `destination` was allocated on `ops`, which must outlive the upload.
  static absl::StatusOr<std::unique_ptr<TensorUpload>> Start(Ops& ops, Tensor destination);
  // An upload whose bytes are all in `filled` already (shared memory):
  // Finish returns it.
  static std::unique_ptr<TensorUpload> Complete(Ops& ops, Tensor filled);
  ~TensorUpload();
  TensorUpload(const TensorUpload&) = delete;
  TensorUpload& operator=(const TensorUpload&) = delete;

  // Writes the next `size` bytes. INVALID_ARGUMENT (nothing written) when they
  // would pass the tensor's end; device errors keep their codes.
  absl::Status Append(const char* data, size_t size);
  // The finished tensor, once every copy is done. INVALID_ARGUMENT unless
  // exactly total() bytes arrived.
  absl::StatusOr<Tensor> Finish();

  int64_t received() const { return received_; }
  int64_t total() const { return static_cast<int64_t>(destination_.nbytes()); }

 private:
  TensorUpload(Ops& ops, Tensor destination, std::shared_ptr<void> staging);
  // Sends the filling half (if it holds anything) and switches halves.
  absl::Status FlushHalf();
  char* half(int index) const;

  Ops& ops_;
  Tensor destination_;
  int64_t received_ = 0;
  // Staging (null on the CPU): two halves; `filling_` gathers bytes that go
  // to destination offset `filling_start_`.
  std::shared_ptr<void> staging_;
  int filling_ = 0;
  size_t filled_ = 0;
  int64_t filling_start_ = 0;
  bool in_flight_[2] = {false, false};  // the stream may still read that half
};

}  // namespace te::session

#endif  // TE_SERVER_SESSION_TENSOR_UPLOAD_H_
