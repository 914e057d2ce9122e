#include "server/session/tensor_upload.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kernels/status_macros.h"

namespace te::session {
namespace {

// A byte view of `tensor` at [offset, offset + size): pieces need not align
// to elements.
Tensor ByteWindow(const Tensor& tensor, int64_t offset, int64_t size) {
  return Tensor(nullptr, static_cast<char*>(tensor.data()) + offset, DType::kBool, {size});
}

}  // namespace

absl::StatusOr<std::unique_ptr<TensorUpload>> TensorUpload::Start(Ops& ops, Tensor destination) {
  std::shared_ptr<void> staging;
  // The CPU's "device" memory is host memory: staging would only add a copy.
  if (ops.device_name() != "cpu" && destination.nbytes() > 0) {
    ASSIGN_OR_RETURN(staging, ops.AllocateStaging(2 * kStagingHalfBytes));
  }
  return std::unique_ptr<TensorUpload>(
      new TensorUpload(ops, std::move(destination), std::move(staging)));
}

std::unique_ptr<TensorUpload> TensorUpload::Complete(Ops& ops, Tensor filled) {
  auto upload = std::unique_ptr<TensorUpload>(new TensorUpload(ops, std::move(filled), nullptr));
  upload->received_ = upload->total();
  return upload;
}

TensorUpload::TensorUpload(Ops& ops, Tensor destination, std::shared_ptr<void> staging)
    : ops_(ops), destination_(std::move(destination)), staging_(std::move(staging)) {}

TensorUpload::~TensorUpload() {
  // The staging memory must outlive the copies that read it.
  if (in_flight_[0] || in_flight_[1]) ops_.Synchronize().IgnoreError();
}

char* TensorUpload::half(int index) const {
  return static_cast<char*>(staging_.get()) + static_cast<size_t>(index) * kStagingHalfBytes;
}

absl::Status TensorUpload::Append(const char* data, size_t size) {
  if (size > static_cast<uint64_t>(total() - received_)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: the stream's bytes add up to more than the ", total(), " bytes that "
        "header.tensor.shape ", ShapeString(destination_.shape()), " ",
        DTypeName(destination_.dtype()), " holds (", received_, " received, then ", size,
        " more)"));
  }
  if (size == 0) return absl::OkStatus();
  if (staging_ == nullptr) {
    Tensor window = ByteWindow(destination_, received_, static_cast<int64_t>(size));
    RETURN_IF_ERROR(ops_.Upload(data, &window));
    received_ += static_cast<int64_t>(size);
    return absl::OkStatus();
  }
  while (size > 0) {
    const size_t take = std::min(size, kStagingHalfBytes - filled_);
    std::memcpy(half(filling_) + filled_, data, take);
    filled_ += take;
    data += take;
    size -= take;
    received_ += static_cast<int64_t>(take);
    if (filled_ == kStagingHalfBytes) RETURN_IF_ERROR(FlushHalf());
  }
  return absl::OkStatus();
}

absl::Status TensorUpload::FlushHalf() {
  const int other = 1 - filling_;
  if (in_flight_[other]) {
    // Ops has no per-copy events: waiting for the stream is how to know the
    // other half is free again. An event recorded after that copy would not
    // wait less: on one in-order stream it completes only once everything
    // queued before it has. Its copy was issued a whole half of arrival ago,
    // so this rarely waits; the copy issued below then runs while the other
    // half fills.
    RETURN_IF_ERROR(ops_.Synchronize());
    in_flight_[0] = in_flight_[1] = false;
  }
  if (filled_ > 0) {
    Tensor window = ByteWindow(destination_, filling_start_, static_cast<int64_t>(filled_));
    RETURN_IF_ERROR(ops_.UploadAsync(half(filling_), &window));
    in_flight_[filling_] = true;
  }
  filling_start_ += static_cast<int64_t>(filled_);
  filled_ = 0;
  filling_ = other;
  return absl::OkStatus();
}

absl::StatusOr<Tensor> TensorUpload::Finish() {
  if (received_ != total()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data: the stream's bytes add up to ", received_, ", but header.tensor.shape ",
        ShapeString(destination_.shape()), " ", DTypeName(destination_.dtype()), " needs ",
        total()));
  }
  if (staging_ != nullptr) {
    RETURN_IF_ERROR(FlushHalf());
    RETURN_IF_ERROR(ops_.Synchronize());
    in_flight_[0] = in_flight_[1] = false;
  }
  return destination_;
}

}  // namespace te::session
