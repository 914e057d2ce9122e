#include "server/service/chunk_wire.h"

#include <cstdint>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace te::service {
namespace {

constexpr uint32_t kHeaderField = 1;
constexpr uint32_t kDataField = 2;
constexpr uint32_t kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

// Reads a message spread over slices as one byte stream.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { SkipEmpty(); }

  bool done() const { return slice_ == slices_.size(); }
  size_t remaining() const {
    size_t n = 0;
    for (size_t i = slice_; i < slices_.size(); ++i) n += slices_[i].size();
    return n - offset_;
  }

  bool ReadVarint(uint64_t* value) {
    *value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (done()) return false;
      const uint8_t byte = slices_[slice_].begin()[offset_];
      Advance(1);
      *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
      if ((byte & 0x80) == 0) return true;
    }
    return false;  // more than 10 bytes
  }

  // The next `n` bytes as views (no copy); false if fewer remain.
  bool Take(size_t n, std::vector<absl::string_view>* pieces) {
    if (n > remaining()) return false;
    while (n > 0) {
      const grpc::Slice& slice = slices_[slice_];
      const size_t take = std::min(n, slice.size() - offset_);
      if (pieces != nullptr) {
        pieces->emplace_back(reinterpret_cast<const char*>(slice.begin()) + offset_, take);
      }
      Advance(take);
      n -= take;
    }
    return true;
  }

 private:
  void Advance(size_t n) {
    offset_ += n;
    if (offset_ == slices_[slice_].size()) {
      ++slice_;
      offset_ = 0;
      SkipEmpty();
    }
  }
  void SkipEmpty() {
    while (slice_ < slices_.size() && slices_[slice_].size() == 0) ++slice_;
  }

  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
};

absl::Status Malformed(const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("not a PutTensorChunk: ", why));
}

void UnrefKeepalive(void* keepalive) {
  delete static_cast<std::shared_ptr<const void>*>(keepalive);
}

// The framing of a data message: tag and length.
std::string DataPrefix(size_t size) {
  std::string prefix(1, static_cast<char>((kDataField << 3) | kLengthDelimited));
  uint64_t n = size;
  do {
    const uint8_t low = n & 0x7f;
    n >>= 7;
    prefix.push_back(static_cast<char>(n != 0 ? (low | 0x80) : low));
  } while (n != 0);
  return prefix;
}

}  // namespace

size_t PutChunk::data_bytes() const {
  size_t n = 0;
  for (absl::string_view piece : data) n += piece.size();
  return n;
}

absl::Status ParsePutChunk(const grpc::ByteBuffer& message, PutChunk* chunk) {
  chunk->is_header = false;
  chunk->header.Clear();
  chunk->data.clear();
  chunk->slices.clear();
  if (grpc::Status dumped = message.Dump(&chunk->slices); !dumped.ok()) {
    return absl::InternalError(absl::StrCat("cannot read the message: ", dumped.error_message()));
  }
  SliceCursor cursor(chunk->slices);
  bool have_part = false;
  while (!cursor.done()) {
    uint64_t tag = 0;
    if (!cursor.ReadVarint(&tag)) return Malformed("truncated tag");
    const uint64_t field = tag >> 3;
    const uint32_t wire_type = tag & 7;
    if (field == 0) return Malformed("field number 0");
    switch (wire_type) {
      case kVarint: {
        uint64_t ignored = 0;
        if (!cursor.ReadVarint(&ignored)) return Malformed("truncated varint");
        break;
      }
      case kFixed64:
        if (!cursor.Take(8, nullptr)) return Malformed("truncated fixed64");
        break;
      case kFixed32:
        if (!cursor.Take(4, nullptr)) return Malformed("truncated fixed32");
        break;
      case kLengthDelimited: {
        uint64_t length = 0;
        if (!cursor.ReadVarint(&length) || length > cursor.remaining()) {
          return Malformed("a length past the message's end");
        }
        if (field == kDataField) {
          chunk->data.clear();  // the oneof's last field wins
          cursor.Take(length, &chunk->data);
          chunk->is_header = false;
          have_part = true;
        } else if (field == kHeaderField) {
          std::vector<absl::string_view> pieces;
          cursor.Take(length, &pieces);
          std::string bytes;
          for (absl::string_view piece : pieces) bytes.append(piece.data(), piece.size());
          // Repeated embedded messages merge, as protobuf's parser does.
          te::v1::PutTensorHeader part;
          if (!part.ParseFromString(bytes)) return Malformed("a header that does not parse");
          if (!chunk->is_header) chunk->header.Clear();
          chunk->header.MergeFrom(part);
          chunk->is_header = true;
          chunk->data.clear();
          have_part = true;
        } else {
          cursor.Take(length, nullptr);
        }
        break;
      }
      default: return Malformed(absl::StrCat("wire type ", wire_type));
    }
  }
  if (!have_part) return absl::InvalidArgumentError("a message with neither header nor data");
  return absl::OkStatus();
}

grpc::ByteBuffer HeaderMessage(const te::v1::TensorHeader& header) {
  te::v1::TensorChunk chunk;
  *chunk.mutable_header() = header;
  return Serialize(chunk);
}

grpc::ByteBuffer DataMessage(const std::shared_ptr<const void>& keepalive, const char* data,
                             size_t size) {
  grpc::Slice slices[2] = {
      grpc::Slice(DataPrefix(size)),
      grpc::Slice(const_cast<char*>(data), size, &UnrefKeepalive,
                  new std::shared_ptr<const void>(keepalive)),
  };
  return grpc::ByteBuffer(slices, size > 0 ? 2 : 1);
}

grpc::ByteBuffer Serialize(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

absl::Status Parse(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message) {
  grpc::Slice slice;
  if (grpc::Status dumped = buffer.DumpToSingleSlice(&slice); !dumped.ok()) {
    return absl::InternalError(absl::StrCat("cannot read the message: ", dumped.error_message()));
  }
  if (!message->ParseFromArray(slice.begin(), static_cast<int>(slice.size()))) {
    return absl::InvalidArgumentError(
        absl::StrCat("the request is not a valid ", message->GetTypeName()));
  }
  return absl::OkStatus();
}

}  // namespace te::service
