// The request fuzzer's harness: one input = one RPC's request, run through
// the session layer exactly as the service's handlers run it (authenticate
// and take the turn with the SessionManager, then the Session method), on an
// in-process CPU session with tiny limits. Shared by the libFuzzer target
// (request_fuzzer.cc), the corpus replay test (corpus_test.cc) and the seed
// writer (write_seeds.cc). Not thread-safe.
//
// Input format:
//   byte 0   the RPC (Rpc below, modulo kRpcCount)
//   byte 1   flags: bit 0 keep the input's own session ref (else the live
//            session's is put in, so most inputs reach past authentication);
//            bit 1 keep empty ids empty (else they name the live layer,
//            forward, or resident tensor); bit 2 undo the call afterwards
//            (Session::ForgetSince, as for a call whose client went away)
//   rest     the request proto, serialized. PutTensor: a sequence of
//            varint-length-prefixed PutTensorChunk messages (the stream).
//            RestoreCheckpoint: a te.state.v1.SessionState manifest.
#ifndef TE_TESTS_FUZZ_REQUEST_HARNESS_H_
#define TE_TESTS_FUZZ_REQUEST_HARNESS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace te::fuzz {

enum class Rpc : uint8_t {
  kCreateSession,
  kCloseSession,
  kInitLayer,
  kForward,
  kBackward,
  kForwardBackward,
  kGetVariables,
  kSetVariables,
  kPutTensor,
  kGetTensor,
  kDeleteTensor,
  kBenchmark,
  kRegisterSharedMemory,
  kUnregisterSharedMemory,
  kCheckpoint,
  kRestoreCheckpoint,
  kGetSessionInfo,
  kCount,
};
inline constexpr int kRpcCount = static_cast<int>(Rpc::kCount);

// Runs one input and returns the status its call earned (INVALID_ARGUMENT
// when the input does not parse). For the fuzzer every status is fine: only
// crashes and sanitizer reports are failures.
absl::Status RunOne(const uint8_t* data, size_t size);

// Valid inputs for every RPC (name, bytes): the seed corpus.
std::vector<std::pair<std::string, std::string>> SeedInputs();

}  // namespace te::fuzz

#endif  // TE_TESTS_FUZZ_REQUEST_HARNESS_H_
