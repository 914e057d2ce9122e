// The request fuzzer's harness: one input = one RPC's request, run through
// the session layer exactly as the service's handlers run it (authenticate
// and take the turn with the SessionManager, then the Session method), on an
// in-process CPU session with tiny limits. Shared by the libFuzzer target
// (request_fuzzer.cc), the corpus replay test (corpus_test.cc) and the seed
// writer (write_seeds.cc). Not thread-safe.
//
// Input format:
//   byte 0   the RPC (Rpc below, modulo kRpcCount)
//   byte 1   flags:
//            bit 0 keep the input's own session ref (else the live session's
//                  is put in, so most inputs reach past authentication);
//            bit 1 keep empty things empty: ids (else they name the live
//                  layer, forward, resident tensor or region), tensors
//                  without data (else they become references to the live x,
//                  or dy where a gradient is asked for; a live
//                  DotProductAttention also gets k = v = x when no extra
//                  inputs are given), shared-memory refs without a region id
//                  (else the live region), InitLayer's input shape and dtype
//                  (else the live layer's x shape, float32);
//            bit 2 undo the call afterwards (Session::EndCall, as for a
//                  call whose client went away);
//            bits 3-5 the live layer (LayerKind below);
//            bits 6-7 the client's patience (Interrupt below).
//   rest     the request proto, serialized. PutTensor: a sequence of
//            varint-length-prefixed PutTensorChunk messages (the stream).
//            RestoreCheckpoint: a te.state.v1.SessionState manifest.
//
// The live session (made afresh for every input): one layer of the chosen
// kind, initialised (under FP8 autocast for most kinds), with gradients kept
// from one ForwardBackward step and one forward kept for a Backward; x and
// dy for it as resident tensors; and, where shm works, a registered
// shared-memory region.
//
// Calls run as the service runs them (server/service/queued_call.cc and
// tensor_streams.cc): no exception escapes (NoThrow), a failed call's
// creations are undone (Session::EndCall), and the step calls get a
// CallContext (deadline, cancellation; flags bits 6-7).
//
// Work caps (so one input stays fast): ForwardBackward runs at most
// kMaxRunMicroBatches micro-batches; a request with more (up to the server's
// own limit, kMaxMicroBatches, and beyond) is sent with its last
// micro-batch's dy made invalid (dtype unspecified), so the server still
// validates every micro-batch but runs none. A call's deadline is
// kCallSeconds ahead; Benchmark's 50 ms.
//
// The invariant (contract 2 of session.h, extended to every failure a client
// can provoke): a call that fails with INVALID_ARGUMENT, NOT_FOUND,
// FAILED_PRECONDITION, RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or CANCELLED
// leaves the session as it was: the live session's digest (GetVariables of
// every layer, all collections, values included; GetSessionInfo's bytes and
// counts; the resident tensors' bytes; the server's live sessions) after the
// call equals the digest before, else the harness prints both and traps
// (__builtin_trap). Other codes (INTERNAL, DATA_LOSS, ...) are not checked.
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

// The live layer an input runs against (flags bits 3-5). x is [2, 3, 8]
// float32 except for kAttentionGraphFp8 ([2, 3, 2, 4]: q, with k and v as
// extra inputs) and kLayerNormDenseMxfp8 ([2, 16, 32]: MXFP8 contracts in
// blocks of 32). kAttentionGraphFp8 and kGraphFp8 take k = v = x as extra
// inputs unless the request gives its own.
enum class LayerKind : uint8_t {
  kDenseFp8,             // DenseGeneral(4), DelayedScaling: y [2, 3, 4]
  kLayerNormMlpFp8,      // LayerNormMLP(16, gelu+linear), DelayedScaling: y, ln_out
  kUnfusedGraphFp8,      // the quickstart's unfused attention block as a graph (norm,
                         // dense, reshape, split, attention, reshape, dense, + x;
                         // request_specs.h), DelayedScaling
  kTransformerFp8,       // TransformerLayer(8, 16, 2 heads), DelayedScaling
  kMhaCurrentScaling,    // MultiHeadAttention(2 x 4), Float8CurrentScaling
  kAttentionGraphFp8,    // a graph: attention on q = x, k, v; reshape; dense; DelayedScaling
  kLayerNormDenseMxfp8,  // LayerNormDenseGeneral(32), MXFP8BlockScaling (a session
                         // negotiated under EMULATE: the CPU emulates MXFP8)
  kGraphFp8,             // a GraphSpec taking x, extra_inputs[0], extra_inputs[1]: q =
                         // Dense(x), k and v reshaped [2, -1, 2, 4] from the extra inputs,
                         // attention, reshape, + x, * 0.5; DelayedScaling
  kCount,
};
inline constexpr int kLayerKindCount = static_cast<int>(LayerKind::kCount);

// What the call's context (CallContext: deadline, cancellation) says while
// the call runs (flags bits 6-7). Without one, a call's deadline is
// kCallSeconds away.
enum class Interrupt : uint8_t {
  kNone,
  kDeadlinePassed,    // the deadline passed before the call started
  kCancelAfterOne,    // the client cancels after the call's first check
  kCancelAfterThree,  // ... after its third check
};
inline constexpr int kCallSeconds = 2;
inline constexpr uint8_t InterruptFlags(Interrupt interrupt) {
  return static_cast<uint8_t>(static_cast<uint8_t>(interrupt) << 6);
}

inline constexpr uint8_t kKeepRef = 1;
inline constexpr uint8_t kKeepEmpty = 2;
inline constexpr uint8_t kUndo = 4;
inline constexpr uint8_t KindFlags(LayerKind kind) {
  return static_cast<uint8_t>(static_cast<uint8_t>(kind) << 3);
}

// ForwardBackward micro-batches the harness lets run (see above), and the
// live session's --max_micro_batches (more are refused by the server).
inline constexpr int kMaxRunMicroBatches = 4;
inline constexpr int kMaxMicroBatches = 16;

// The harness's session limits (TinyConfig): large enough that a layer as big
// as TransformerLayer(hidden_size 2^20) passes the input-size check (x
// [1, 1, 2^20] float32 is 4 MiB) and its input norm's scale and bias fit (so
// its init reaches the QKV kernel), small enough that no input makes the
// harness slow or large.
inline constexpr int64_t kMaxTensorBytes = int64_t{4} << 20;
inline constexpr int64_t kSessionMemoryBytes = int64_t{16} << 20;

// The live session's shared-memory region (the harness's own object). Small:
// a tensor read from it stays small enough that an attention over it is fast
// ([1, 2048, 8] float32 at most), yet large enough for one whose scores pass
// the session's memory.
inline constexpr int64_t kShmRegionBytes = int64_t{64} << 10;

// Runs one input and returns the status its call earned (INVALID_ARGUMENT
// when the input does not parse). For the fuzzer every status is fine: only
// crashes, sanitizer reports and the invariant's trap are failures.
absl::Status RunOne(const uint8_t* data, size_t size);

// A seed: a valid or hostile input, and the codes its call may end with
// (OK only, for most).
struct Seed {
  std::string name;
  std::string bytes;
  std::vector<absl::StatusCode> allowed = {absl::StatusCode::kOk};
};

// Inputs for every RPC, valid ones and the hostile values a client has
// crashed or abused the server with: the seed corpus.
std::vector<Seed> SeedInputs();

}  // namespace te::fuzz

#endif  // TE_TESTS_FUZZ_REQUEST_HARNESS_H_
