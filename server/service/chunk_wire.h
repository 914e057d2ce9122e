// The PutTensor and GetTensor stream messages on the wire, read and written
// without copying their data. Both messages are
//   oneof part { <header> header = 1; bytes data = 2; }
// so a data message is the tag 0x12, a varint length, and the bytes.
//
// Reading: a received PutTensorChunk's data stays in the slices gRPC received
// it in; the caller copies it once, into its final place. Writing: a
// TensorChunk's data is a slice over memory the caller keeps alive (the
// tensor itself on the CPU), so nothing is copied before the socket.
#ifndef TE_SERVER_SERVICE_CHUNK_WIRE_H_
#define TE_SERVER_SERVICE_CHUNK_WIRE_H_

#include <grpcpp/grpcpp.h>

#include <cstddef>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "te/v1/service.pb.h"

namespace te::service {

// One PutTensorChunk, parsed with protobuf's rules (the last of the oneof's
// fields wins; unknown fields are skipped).
struct PutChunk {
  bool is_header = false;
  te::v1::PutTensorHeader header;       // when is_header
  std::vector<absl::string_view> data;  // when not: pieces, in order, into `slices`
  std::vector<grpc::Slice> slices;      // the message's memory
  size_t data_bytes() const;
};

// INVALID_ARGUMENT for a message that is not a PutTensorChunk with its part
// set (malformed wire format, a bad header, neither header nor data).
absl::Status ParsePutChunk(const grpc::ByteBuffer& message, PutChunk* chunk);

// A TensorChunk holding `header`.
grpc::ByteBuffer HeaderMessage(const te::v1::TensorHeader& header);
// A TensorChunk whose data is [data, data + size), without a copy: the
// memory stays valid as long as a reference to `keepalive` is held, which
// the message's slice does until gRPC has sent it.
grpc::ByteBuffer DataMessage(const std::shared_ptr<const void>& keepalive, const char* data,
                             size_t size);

// A protobuf message <-> a ByteBuffer (for the raw methods' headers and
// responses; these are small).
grpc::ByteBuffer Serialize(const google::protobuf::MessageLite& message);
absl::Status Parse(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message);

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_CHUNK_WIRE_H_
