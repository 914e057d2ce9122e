// fault_client: starts a PutTensor stream on a session and dies in the middle
// of it, so the server sees a real connection drop (the kernel closes the
// socket of a process that exits; no gRPC cancellation is sent).
//   fault_client ADDRESS SESSION_ID TOKEN CHUNKS_BEFORE_DEATH
// Exits 3 if the stream could not be started. Used by fault_test.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <thread>

#include "te/v1/service.grpc.pb.h"

int main(int argc, char** argv) {
  if (argc != 5) return 2;
  constexpr int kChunkBytes = 64 << 10;
  constexpr int kChunks = 16;  // the tensor: 1 MiB of float32
  const int chunks_before_death = std::atoi(argv[4]);
  grpc::ChannelArguments args;
  auto stub = te::v1::TeService::NewStub(
      grpc::CreateCustomChannel(argv[1], grpc::InsecureChannelCredentials(), args));
  grpc::ClientContext context;
  te::v1::PutTensorResponse response;
  auto writer = stub->PutTensor(&context, &response);
  te::v1::PutTensorChunk header;
  header.mutable_header()->mutable_session()->set_session_id(argv[2]);
  header.mutable_header()->mutable_session()->set_token(argv[3]);
  header.mutable_header()->mutable_tensor()->set_dtype(te::v1::FLOAT32);
  header.mutable_header()->mutable_tensor()->add_shape(kChunks * kChunkBytes / 4);
  if (!writer->Write(header)) return 3;
  te::v1::PutTensorChunk chunk;
  chunk.set_data(std::string(kChunkBytes, '\x3f'));
  for (int i = 0; i < chunks_before_death && i < kChunks - 1; ++i) {
    if (!writer->Write(chunk)) return 3;
  }
  // Let the bytes reach the server, then vanish without a word.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  _exit(0);
}
