#include "tests/server_fixture.h"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "tests/runfiles.h"

extern char** environ;

namespace te::testing {
namespace {

constexpr int kMaxMessageBytes = 64 << 20;

std::string TempDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// A human-readable account of a waitpid status.
std::string DescribeExit(int wait_status) {
  if (WIFEXITED(wait_status)) return absl::StrCat("exit status ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return absl::StrCat("killed by signal ", WTERMSIG(wait_status));
  return absl::StrCat("wait status ", wait_status);
}

}  // namespace

std::string ServerBinaryPath() {
  if (const char* path = std::getenv("TE_SERVER_BINARY")) return path;
  return RunfilePath("server/te_server");
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(const Options& options) {
  static int started = 0;
  const std::string port_file =
      absl::StrCat(TempDir(), "/te_server_port_", getpid(), "_", started++);
  std::remove(port_file.c_str());
  const std::string binary = ServerBinaryPath();
  std::vector<std::string> args = {binary, "--port=0", "--port_file=" + port_file,
                                   "--host=127.0.0.1", "--device=cpu"};
  args.insert(args.end(), options.flags.begin(), options.flags.end());
  if (const char* env = std::getenv("TE_SERVER_FLAGS")) {
    for (absl::string_view flag : absl::StrSplit(env, ' ', absl::SkipEmpty())) {
      args.emplace_back(flag);
    }
  }
  std::vector<char*> argv;
  for (std::string& arg : args) argv.push_back(arg.data());
  argv.push_back(nullptr);

  // The child starts with no signals blocked, whatever the test's threads do.
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none;
  sigemptyset(&none);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK);
  pid_t pid = 0;
  const int spawned = posix_spawn(&pid, binary.c_str(), nullptr, &attr, argv.data(), environ);
  posix_spawnattr_destroy(&attr);
  if (spawned != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot start ", binary, ": ", std::strerror(spawned)));
  }

  const absl::Time deadline = absl::Now() + options.startup_timeout;
  int port = 0;
  while (port == 0) {
    int wait_status = 0;
    if (waitpid(pid, &wait_status, WNOHANG) == pid) {
      return absl::UnavailableError(
          absl::StrCat("te_server exited before listening: ", DescribeExit(wait_status)));
    }
    std::ifstream in(port_file);
    std::string line;
    if (in && std::getline(in, line) && absl::SimpleAtoi(absl::StripAsciiWhitespace(line), &port) &&
        port > 0) {
      break;
    }
    port = 0;
    if (absl::Now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
      return absl::UnavailableError("te_server did not write its port file in time");
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::unique_ptr<ServerProcess> server(new ServerProcess(
      pid, port,
      options.channel_credentials != nullptr ? options.channel_credentials
                                             : grpc::InsecureChannelCredentials()));
  auto channel = server->NewChannel();
  if (!channel->WaitForConnected(absl::ToChronoTime(deadline))) {
    return absl::UnavailableError(
        absl::StrCat("te_server on port ", port, " does not accept connections"));
  }
  return server;
}

ServerProcess::~ServerProcess() { Stop().IgnoreError(); }

absl::Status ServerProcess::Stop(absl::Duration grace) {
  if (stopped_) return absl::OkStatus();
  stopped_ = true;
  kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  int wait_status = 0;
  while (true) {
    const pid_t done = waitpid(pid_, &wait_status, WNOHANG);
    if (done == pid_) break;
    if (done < 0 && errno != EINTR) return absl::InternalError("waitpid failed");
    if (absl::Now() > deadline) {
      kill(pid_, SIGKILL);
      waitpid(pid_, &wait_status, 0);
      return absl::InternalError(absl::StrCat("te_server did not stop within ",
                                              absl::FormatDuration(grace), " of SIGTERM"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  if (!WIFEXITED(wait_status) || WEXITSTATUS(wait_status) != 0) {
    return absl::InternalError(
        absl::StrCat("te_server stopped uncleanly: ", DescribeExit(wait_status)));
  }
  return absl::OkStatus();
}

std::string ServerProcess::address() const { return absl::StrCat("127.0.0.1:", port_); }

std::shared_ptr<grpc::Channel> ServerProcess::NewChannel() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  return grpc::CreateCustomChannel(address(), credentials_, args);
}

std::unique_ptr<te::v1::TeService::Stub> ServerProcess::NewStub() const {
  return te::v1::TeService::NewStub(NewChannel());
}

}  // namespace te::testing
