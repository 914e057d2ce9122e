// The reactor of Generate, the server-streaming generation call.
//
//  1. The request is authenticated and queued on the session's device like
//     any other call (QueuedCall's contract 1); in the session's turn the
//     session generates (Session::Generate), holding the turn until the last
//     token is made: other calls on the session wait, other sessions do not.
//  2. Each step's GenerateResponse is written as soon as it is made, one
//     write in flight at a time; steps made while a write is in flight wait
//     in order (a few ints each). Generation never waits for the client.
//  3. The stream ends once generation has ended and every step made has
//     been written, with generation's status: OK, or DEADLINE_EXCEEDED /
//     CANCELLED (checked between tokens) after the steps already sent, or
//     the request's error before any. A write that fails (the client went
//     away) stops generation at its next step.
#ifndef TE_SERVER_SERVICE_GENERATE_STREAM_H_
#define TE_SERVER_SERVICE_GENERATE_STREAM_H_

#include <grpcpp/grpcpp.h>

#include "server/service/service_core.h"
#include "te/v1/service.pb.h"

namespace te::service {

grpc::ServerWriteReactor<te::v1::GenerateResponse>* StartGenerate(
    const ServiceCore& core, grpc::CallbackServerContext* context,
    const te::v1::GenerateRequest* request);

}  // namespace te::service

#endif  // TE_SERVER_SERVICE_GENERATE_STREAM_H_
