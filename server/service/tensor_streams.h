// The reactors of the two streaming RPCs, on raw ByteBuffers so tensor bytes
// are copied once at most (chunk_wire.h).
//
// PutTensor:
//  1. The header is read and authenticated, and the call queues on the
//     session's device like any other (QueuedCall's contract 1).
//  2. Once its turn comes, the session's tensor is allocated from the header
//     and each data message is copied into place as it arrives
//     (Session::BeginPut), on the executor, in order, while the next message
//     is read: at most two messages wait to be copied, so a fast client is
//     held back by gRPC's flow control, not by server memory.
//  3. The call holds the session's turn until the stream ends: other calls on
//     the session wait, other sessions do not. A stream cut short, a message
//     too many, a malformed message, a cancellation or a passed deadline ends
//     it with its error, and frees the partly written tensor.
//
// GetTensor:
//  4. In the session's turn the resident tensor is looked up (on the CPU
//     nothing is copied; elsewhere it is downloaded once); the turn is then
//     released and the chunks are written from that memory, one write in
//     flight at a time.
#ifndef TE_SERVER_SERVICE_TENSOR_STREAMS_H_
#define TE_SERVER_SERVICE_TENSOR_STREAMS_H_

#include <grpcpp/grpcpp.h>

#include "server/service/service_core.h"

namespace te::service {

grpc::ServerReadReactor<grpc::ByteBuffer>* StartPutTensor(const ServiceCore& core,
                                                          grpc::CallbackServerContext* context,
                                                          grpc::ByteBuffer* response);

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartGetTensor(const ServiceCore& core,
                                                           grpc::CallbackServerContext* context,
                                                           const grpc::ByteBuffer* request);

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_TENSOR_STREAMS_H_
