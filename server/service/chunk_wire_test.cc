#include "server/service/chunk_wire.h"

#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace te::service {
namespace {

std::string RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::string bytes(n, '\0');
  for (char& b : bytes) b = static_cast<char>(rng());
  return bytes;
}

// `wire` as a ByteBuffer cut into slices at `cuts` (as the transport may deliver it).
grpc::ByteBuffer Sliced(const std::string& wire, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t start = 0;
  cuts.push_back(wire.size());
  for (size_t cut : cuts) {
    slices.emplace_back(wire.data() + start, cut - start);
    start = cut;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Joined(const PutChunk& chunk) {
  std::string joined;
  for (absl::string_view piece : chunk.data) joined.append(piece.data(), piece.size());
  return joined;
}

TEST(ChunkWireTest, DataAcrossAnySliceBoundary) {
  te::v1::PutTensorChunk message;
  message.set_data(RandomBytes(300, 1));  // a two-byte length
  const std::string wire = message.SerializeAsString();
  for (size_t a = 0; a <= wire.size(); a += 7) {
    for (size_t b = a; b <= wire.size(); b += 13) {
      PutChunk chunk;
      ASSERT_TRUE(ParsePutChunk(Sliced(wire, {a, b}), &chunk).ok()) << a << " " << b;
      ASSERT_FALSE(chunk.is_header);
      EXPECT_EQ(chunk.data_bytes(), 300u);
      EXPECT_EQ(Joined(chunk), message.data());
    }
  }
}

TEST(ChunkWireTest, DataViewsPointIntoTheReceivedSlices) {
  te::v1::PutTensorChunk message;
  message.set_data(RandomBytes(1 << 20, 2));
  const std::string wire = message.SerializeAsString();
  grpc::Slice one(wire);
  PutChunk chunk;
  ASSERT_TRUE(ParsePutChunk(grpc::ByteBuffer(&one, 1), &chunk).ok());
  ASSERT_EQ(chunk.data.size(), 1u);
  const char* base = reinterpret_cast<const char*>(one.begin());
  EXPECT_GE(chunk.data[0].data(), base);
  EXPECT_LT(chunk.data[0].data(), base + one.size());
}

TEST(ChunkWireTest, HeaderParses) {
  te::v1::PutTensorChunk message;
  te::v1::PutTensorHeader* header = message.mutable_header();
  header->mutable_session()->set_session_id("abc");
  header->mutable_tensor()->set_dtype(te::v1::BFLOAT16);
  header->mutable_tensor()->add_shape(3);
  header->mutable_shm()->set_offset(64);
  PutChunk chunk;
  ASSERT_TRUE(ParsePutChunk(Sliced(message.SerializeAsString(), {3}), &chunk).ok());
  ASSERT_TRUE(chunk.is_header);
  EXPECT_EQ(chunk.header.SerializeAsString(), header->SerializeAsString());
}

TEST(ChunkWireTest, LastPartWinsAndUnknownFieldsAreSkipped) {
  te::v1::PutTensorChunk header;
  header.mutable_header()->mutable_tensor()->add_shape(1);
  te::v1::PutTensorChunk data;
  data.set_data("payload");
  // Unknown fields of every wire type: 9 varint, 10 fixed64, 11 bytes, 12 fixed32.
  const std::string unknown = std::string("\x48\x96\x01", 3) + "\x51" + std::string(8, 'x') +
                              "\x5a\x02hi" + "\x65" + std::string(4, 'y');
  PutChunk chunk;
  ASSERT_TRUE(
      ParsePutChunk(Sliced(header.SerializeAsString() + unknown + data.SerializeAsString(), {}),
                    &chunk)
          .ok());
  EXPECT_FALSE(chunk.is_header);
  EXPECT_EQ(Joined(chunk), "payload");
  ASSERT_TRUE(
      ParsePutChunk(Sliced(data.SerializeAsString() + header.SerializeAsString(), {}), &chunk)
          .ok());
  EXPECT_TRUE(chunk.is_header);
  EXPECT_TRUE(chunk.data.empty());
}

TEST(ChunkWireTest, EmptyDataIsData) {
  te::v1::PutTensorChunk message;
  message.set_data("");
  PutChunk chunk;
  ASSERT_TRUE(ParsePutChunk(Sliced(message.SerializeAsString(), {}), &chunk).ok());
  EXPECT_FALSE(chunk.is_header);
  EXPECT_EQ(chunk.data_bytes(), 0u);
}

TEST(ChunkWireTest, MalformedMessagesAreInvalid) {
  const std::vector<std::string> bad = {
      "",  // neither header nor data
      std::string("\x12\x05"
                  "abc",
                  5),                      // length past the end
      std::string("\x12", 1),              // no length
      std::string("\x0a\x02\xff\xff", 4),  // a header that does not parse
      std::string("\x13", 1),              // wire type 3 (groups)
      std::string("\x00\x01", 2),          // field 0
      std::string(11, '\x80'),             // endless varint
      std::string("\x48\x01", 2),          // only an unknown field
  };
  for (const std::string& wire : bad) {
    PutChunk chunk;
    EXPECT_EQ(ParsePutChunk(Sliced(wire, {}), &chunk).code(), absl::StatusCode::kInvalidArgument)
        << testing::PrintToString(wire);
  }
}

TEST(ChunkWireTest, DataMessageIsATensorChunkAndHoldsItsMemoryUntilSent) {
  auto memory = std::make_shared<std::string>(RandomBytes(5000, 3));
  std::weak_ptr<std::string> watch = memory;
  grpc::ByteBuffer message;
  {
    std::shared_ptr<const void> keepalive = memory;
    memory.reset();
    message = DataMessage(keepalive, static_cast<const std::string*>(keepalive.get())->data() + 100,
                          4000);
  }
  EXPECT_FALSE(watch.expired());  // the message's slice holds it
  te::v1::TensorChunk chunk;
  ASSERT_TRUE(Parse(message, &chunk).ok());
  ASSERT_EQ(chunk.part_case(), te::v1::TensorChunk::kData);
  EXPECT_EQ(chunk.data(), watch.lock()->substr(100, 4000));
  message.Clear();
  EXPECT_TRUE(watch.expired());
}

TEST(ChunkWireTest, HeaderMessageRoundTrips) {
  te::v1::TensorHeader header;
  header.set_dtype(te::v1::FLOAT8_E4M3);
  header.add_shape(7);
  header.add_shape(0);
  te::v1::TensorChunk chunk;
  ASSERT_TRUE(Parse(HeaderMessage(header), &chunk).ok());
  ASSERT_TRUE(chunk.has_header());
  EXPECT_EQ(chunk.header().SerializeAsString(), header.SerializeAsString());
}

}  // namespace
}  // namespace te::service
