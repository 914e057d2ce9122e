// ServerProcess: the real //server:te_server binary, started for a test on a
// loopback port it picks itself (--port=0 --port_file), and stopped with
// SIGTERM (graceful shutdown), so tests exercise exactly what ships.
//
// The binary is found in the test's runfiles (data = ["//server:te_server"])
// or at $TE_SERVER_BINARY. Its log goes to the test's stderr. Not thread-safe.
#ifndef TE_TESTS_SERVER_FIXTURE_H_
#define TE_TESTS_SERVER_FIXTURE_H_

#include <grpcpp/grpcpp.h>
#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "te/v1/service.grpc.pb.h"

namespace te::testing {

class ServerProcess {
 public:
  struct Options {
    // Flags after the fixture's own (--port=0 --port_file --host=127.0.0.1
    // --device=cpu), then those in $TE_SERVER_FLAGS (space-separated, e.g.
    // "--device=auto" to run the same tests on a GPU); later flags win.
    std::vector<std::string> flags;
    absl::Duration startup_timeout = absl::Seconds(60);
    // How the fixture's channels (the start-up wait, NewChannel) connect; null:
    // plaintext. A TLS server needs TLS credentials here.
    std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
  };

  // Starts the server and waits until it accepts connections. UNAVAILABLE if
  // it exits first or does not listen within the timeout.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(const Options& options);
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start() { return Start(Options()); }

  // Stops the server if still running (see Stop).
  ~ServerProcess();

  // SIGTERM, then waits up to `grace` for a clean exit (status 0); SIGKILL
  // after that. INTERNAL if it needed the kill or exited non-zero.
  absl::Status Stop(absl::Duration grace = absl::Seconds(20));

  int port() const { return port_; }
  std::string address() const;  // "127.0.0.1:<port>"
  pid_t pid() const { return pid_; }

  // A channel whose message limits match the server's defaults (64 MiB).
  std::shared_ptr<grpc::Channel> NewChannel() const;
  std::unique_ptr<te::v1::TeService::Stub> NewStub() const;

 private:
  ServerProcess(pid_t pid, int port, std::shared_ptr<grpc::ChannelCredentials> credentials)
      : pid_(pid), port_(port), credentials_(std::move(credentials)) {}
  pid_t pid_;
  int port_;
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
  bool stopped_ = false;
};

// Where the te_server binary is: $TE_SERVER_BINARY, else the runfiles path.
std::string ServerBinaryPath();

}  // namespace te::testing

#endif  // TE_TESTS_SERVER_FIXTURE_H_
