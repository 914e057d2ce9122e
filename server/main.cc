// te_server: serves Transformer Engine style layers over gRPC (te.v1.TeService),
// with grpc.health.v1 and server reflection. Runs on the devices chosen at
// start (--device=auto|all|cpu|cuda:N[,...]), each with a bounded executor
// (--executor_threads, --executor_queue). SIGINT / SIGTERM shut it down gracefully:
// health goes NOT_SERVING, running calls get a grace period, then (with
// --state_dir) every session is saved, and it exits 0. With --state_dir a
// starting server restores the sessions saved there. TLS, mutual TLS and the
// access key: server/security/flags.h.
#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <pthread.h>
#include <signal.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kernels/ops.h"
#include "kernels/status_macros.h"
#include "server/security/flags.h"
#include "server/metrics/flags.h"
#include "server/metrics/rpc_bytes.h"
#include "server/metrics/server_metrics.h"
#include "server/service/device_pool.h"
#include "server/service/service.h"
#include "server/session/checkpoint.h"
#include "server/session/log.h"
#include "server/session/session.h"
#include "server/session/session_manager.h"

ABSL_FLAG(int, port, 50051, "TCP port to listen on; 0 picks a free port (see --port_file)");
ABSL_FLAG(std::string, port_file, "",
          "if set, the bound port is written to this file once the server listens");
ABSL_FLAG(std::string, host, "0.0.0.0", "address to listen on");
ABSL_FLAG(std::string, device, "auto",
          "auto (CUDA device 0 when available, else the CPU), all (every CUDA device), or a "
          "list of cpu and cuda:N (\"cuda:0,cuda:1\"); new sessions go to the least-loaded one");
ABSL_FLAG(int, executor_threads, 4,
          "worker threads per device: how many sessions run at once on one device");
ABSL_FLAG(int, executor_queue, 64,
          "calls that may wait for a device's workers; beyond, RESOURCE_EXHAUSTED at once");
ABSL_FLAG(bool, replay_decode_steps, true,
          "Generate records its one-token step as a CUDA graph and replays it (one launch a "
          "token instead of hundreds); --noreplay_decode_steps runs every step launch by launch");
ABSL_FLAG(bool, enable_shm, false,
          "let same-host clients register POSIX shared memory (RegisterSharedMemory) and "
          "pass tensors through it");
ABSL_FLAG(int, max_sessions, 64, "sessions held at once");
ABSL_FLAG(int64_t, session_memory_bytes, int64_t{8} << 30, "device memory per session");
ABSL_FLAG(int, max_saved_forwards, 16, "forwards a session keeps for their backward");
ABSL_FLAG(int, max_micro_batches, 256,
          "micro-batches one ForwardBackward call may carry; beyond, INVALID_ARGUMENT");
ABSL_FLAG(double, sequence_gap_seconds, 10,
          "how long a numbered call (SessionRef.sequence) waits for a lower number of its "
          "session that has not arrived; then ABORTED");
ABSL_FLAG(int64_t, max_message_bytes, int64_t{64} << 20, "largest gRPC message, each way");
ABSL_FLAG(int64_t, max_tensor_bytes, int64_t{1} << 30, "largest tensor in a request");
ABSL_FLAG(int64_t, session_ttl_seconds, 1800, "idle time after which a session expires");
ABSL_FLAG(std::string, state_dir, "",
          "directory for session checkpoints (Checkpoint RPC, and every session at shutdown); "
          "sessions saved there are restored at start. Empty: sessions live in memory only");
ABSL_FLAG(std::string, log_level, "info",
          "the least severe log lines written: info (every call's outcome), warning or error");
ABSL_FLAG(int64_t, cuda_memory_bytes, 0,
          "device memory all the sessions on one GPU may hold together (one account per "
          "device); 0: the memory free when the server starts, less --cuda_memory_reserve_bytes");
ABSL_FLAG(int64_t, cuda_memory_reserve_bytes, int64_t{4} << 30,
          "GPU memory kept outside the sessions' account, for the CUDA context, cuBLASLt and "
          "cuDNN's own allocations and the caching allocator's rounding");
ABSL_FLAG(bool, relative_bias_split, false,
          "TE's relative position bias without the dense [heads, S, S] bias: cuDNN's bias-free "
          "attention on the far keys and the band kernels on the nearest (off until its GPU "
          "tests have passed on a GPU)");
ABSL_FLAG(std::string, inject_device_fault, "",
          "TESTING ONLY: cuda:N@LAUNCHES makes kernel launch LAUNCHES+1 on cuda:N fail as a "
          "sticky CUDA fault would (the device goes NOT_SERVING); empty: none");
ABSL_FLAG(std::string, advertise_address, "",
          "this replica's own host:port, returned by CreateSession so clients pin their session "
          "to it (session affinity behind a load balancer)");

namespace te {
namespace {

using session::Log;
using session::LogLevel;

constexpr char kServiceName[] = "te.v1.TeService";
constexpr absl::Duration kShutdownGrace = absl::Seconds(10);
constexpr absl::Duration kHousekeepingPeriod = absl::Seconds(1);
// How long the shutdown save waits for any one session's turn.
constexpr absl::Duration kShutdownSaveWait = absl::Seconds(30);

absl::Status CheckFlags() {
  const int port = absl::GetFlag(FLAGS_port);
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("--port=", port, ": outside [0, 65535]"));
  }
  if (absl::GetFlag(FLAGS_max_sessions) < 1) {
    return absl::InvalidArgumentError("--max_sessions must be at least 1");
  }
  if (absl::GetFlag(FLAGS_session_memory_bytes) < 1) {
    return absl::InvalidArgumentError("--session_memory_bytes must be positive");
  }
  if (absl::GetFlag(FLAGS_max_micro_batches) < 1) {
    return absl::InvalidArgumentError("--max_micro_batches must be >= 1");
  }
  if (!(absl::GetFlag(FLAGS_sequence_gap_seconds) > 0)) {
    return absl::InvalidArgumentError("--sequence_gap_seconds must be > 0");
  }
  if (absl::GetFlag(FLAGS_max_saved_forwards) < 0) {
    return absl::InvalidArgumentError("--max_saved_forwards must be >= 0");
  }
  const int64_t message = absl::GetFlag(FLAGS_max_message_bytes);
  if (message < (int64_t{1} << 20) || message > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_message_bytes=", message, ": outside [1 MiB, 2 GiB)"));
  }
  if (absl::GetFlag(FLAGS_max_tensor_bytes) < 1) {
    return absl::InvalidArgumentError("--max_tensor_bytes must be positive");
  }
  if (absl::GetFlag(FLAGS_session_ttl_seconds) < 1) {
    return absl::InvalidArgumentError("--session_ttl_seconds must be positive");
  }
  if (absl::GetFlag(FLAGS_executor_threads) < 1 || absl::GetFlag(FLAGS_executor_threads) > 256) {
    return absl::InvalidArgumentError("--executor_threads must be in [1, 256]");
  }
  if (absl::GetFlag(FLAGS_executor_queue) < 1) {
    return absl::InvalidArgumentError("--executor_queue must be at least 1");
  }
  if (absl::GetFlag(FLAGS_cuda_memory_bytes) < 0) {
    return absl::InvalidArgumentError("--cuda_memory_bytes must be >= 0 (0: free memory at start)");
  }
  if (absl::GetFlag(FLAGS_cuda_memory_reserve_bytes) < 0) {
    return absl::InvalidArgumentError("--cuda_memory_reserve_bytes must be >= 0");
  }
  return service::ParseFaultInjections(absl::GetFlag(FLAGS_inject_device_fault)).status();
}

// Written whole or not at all: a reader polling for the file never sees half.
absl::Status WritePortFile(const std::string& path, int port) {
  const std::string temp = path + ".tmp";
  {
    std::ofstream out(temp, std::ios::trunc);
    out << port << "\n";
    if (!out.good()) return absl::UnavailableError(absl::StrCat("cannot write ", temp));
  }
  if (std::rename(temp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", temp, " to ", path));
  }
  return absl::OkStatus();
}

// SIGINT and SIGTERM are taken by one thread with sigwait; every other thread
// (gRPC's included, started later) inherits the blocked mask.
sigset_t BlockStopSignals() {
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  return stop_signals;
}

// The devices of --device, each with its executor, logged one line each.
absl::StatusOr<std::unique_ptr<service::DevicePool>> OpenDevices() {
  service::ExecutorOptions executor;
  executor.threads = absl::GetFlag(FLAGS_executor_threads);
  executor.max_queued = absl::GetFlag(FLAGS_executor_queue);
  executor.sequence_gap = absl::Seconds(absl::GetFlag(FLAGS_sequence_gap_seconds));
  service::DeviceOpenOptions open;
  open.cuda.memory_bytes = absl::GetFlag(FLAGS_cuda_memory_bytes);
  open.cuda.memory_reserve_bytes = absl::GetFlag(FLAGS_cuda_memory_reserve_bytes);
  open.cuda.relative_bias_split = absl::GetFlag(FLAGS_relative_bias_split);
  ASSIGN_OR_RETURN(open.faults,
                   service::ParseFaultInjections(absl::GetFlag(FLAGS_inject_device_fault)));
  absl::StatusOr<std::unique_ptr<service::DevicePool>> devices =
      service::DevicePool::Open(absl::GetFlag(FLAGS_device), executor, open);
  if (!devices.ok()) return devices.status();
  for (int i = 0; i < (*devices)->size(); ++i) {
    const DeviceInfo info = (*devices)->device(i).info();
    Log(LogLevel::kInfo,
        absl::StrCat("device ", info.name, ": ", info.description,
                     info.compute_capability > 0 ? absl::StrCat(", sm_", info.compute_capability)
                                                 : std::string(),
                     info.memory_bytes > 0 ? absl::StrCat(", ", info.memory_bytes >> 20, " MiB")
                                           : std::string(),
                     "; executor: ", executor.threads, " threads, queue ", executor.max_queued));
  }
  return devices;
}

// The session manager's limits from the flags. A session that goes (closed,
// expired, evicted): its executors forget its call numbering, and it must not
// come back at the next start.
session::SessionManagerOptions ManagerOptionsFromFlags(session::CheckpointStore* store,
                                                      service::DevicePool* pool) {
  const absl::Duration ttl = absl::Seconds(absl::GetFlag(FLAGS_session_ttl_seconds));
  session::SessionManagerOptions manager_options;
  manager_options.on_removed = [store, pool](const std::string& id) {
    for (int i = 0; i < pool->size(); ++i) pool->executor(i).ForgetKey(id);
    if (store == nullptr) return;
    if (absl::Status removed = store->Remove(id); !removed.ok()) {
      session::LogForSession(LogLevel::kError, id, "cannot remove its checkpoint",
                             {{"error", removed.ToString()}});
    }
  };
  manager_options.max_sessions = absl::GetFlag(FLAGS_max_sessions);
  manager_options.default_ttl = ttl;
  manager_options.max_ttl = std::max(ttl, absl::Hours(24 * 7));
  return manager_options;
}

// The service's limits and per-session options from the flags.
service::ServiceOptions ServiceOptionsFromFlags(int max_sessions) {
  service::ServiceOptions options;
  options.session.session_memory_bytes = absl::GetFlag(FLAGS_session_memory_bytes);
  options.session.max_saved_forwards = absl::GetFlag(FLAGS_max_saved_forwards);
  options.session.max_micro_batches = absl::GetFlag(FLAGS_max_micro_batches);
  options.session.max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  options.session.max_tensor_bytes = absl::GetFlag(FLAGS_max_tensor_bytes);
  options.session.enable_shm = absl::GetFlag(FLAGS_enable_shm);
  options.session.replay_decode_steps = absl::GetFlag(FLAGS_replay_decode_steps);
  options.max_sessions = max_sessions;
  options.session_ttl_seconds = absl::GetFlag(FLAGS_session_ttl_seconds);
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  return options;
}

// The sessions --state_dir holds, each back on the device it was saved on
// (the first device where this server lacks it); returns how many came back.
int RestoreSessions(session::CheckpointStore& checkpoints, service::DevicePool* pool,
                    const session::SessionConfig& session_options,
                    session::SessionManager* sessions) {
  auto device_for = [pool](const std::string& saved_on) {
    const int index = pool->Find(saved_on);
    return &pool->device(index >= 0 ? index : 0);
  };
  const session::CheckpointStore::RestoreReport restored =
      checkpoints.RestoreAll(device_for, session_options, sessions);
  Log(LogLevel::kInfo, "state directory read",
      {{"state_dir", checkpoints.state_dir()},
       {"restored", absl::StrCat(restored.restored)},
       {"failed", absl::StrCat(restored.failed)}});
  return restored.restored;
}

// Serves until SIGINT or SIGTERM, running `tick` (expiry, gauges, health)
// every kHousekeepingPeriod; then NOT_SERVING, and the calls in flight drain
// (or meet the grace period).
void ServeUntilStopped(grpc::Server* server, grpc::HealthCheckServiceInterface* health,
                       const sigset_t& stop_signals, const std::function<void()>& tick) {
  absl::Notification stopping;
  std::thread housekeeping([&] {
    while (!stopping.WaitForNotificationWithTimeout(kHousekeepingPeriod)) tick();
  });
  std::thread signal_waiter([&] {
    int signal_number = 0;
    sigwait(&stop_signals, &signal_number);
    Log(LogLevel::kInfo, absl::StrCat("signal ", signal_number, ": shutting down (grace ",
                                      absl::FormatDuration(kShutdownGrace), ")"));
    stopping.Notify();
    health->Shutdown();  // NOT_SERVING from now on
    server->Shutdown(absl::ToChronoTime(absl::Now() + kShutdownGrace));
  });
  server->Wait();  // calls in flight have drained (or hit the grace period)
  signal_waiter.join();
  housekeeping.join();
}

// The checkpoint store --state_dir names; null without one.
absl::StatusOr<std::unique_ptr<session::CheckpointStore>> OpenCheckpointsFromFlags() {
  const std::string state_dir = absl::GetFlag(FLAGS_state_dir);
  if (state_dir.empty()) return std::unique_ptr<session::CheckpointStore>();
  return session::CheckpointStore::Open(state_dir);
}

// Prometheus metrics (--metrics_port): the registry, the server's metric
// set, and the /metrics endpoint when one is asked for (else null).
struct Telemetry {
  std::shared_ptr<prometheus::Registry> registry;
  metrics::ServerMetrics metrics;
  std::unique_ptr<metrics::Exporter> exporter;
};

absl::StatusOr<Telemetry> StartTelemetryFromFlags() {
  auto registry = std::make_shared<prometheus::Registry>();
  ASSIGN_OR_RETURN(metrics::ServerMetrics server_metrics, metrics::RegisterServerMetrics(*registry));
  ASSIGN_OR_RETURN(std::unique_ptr<metrics::Exporter> exporter,
                   metrics::StartExporterFromFlags(registry));
  if (exporter != nullptr) {
    Log(LogLevel::kInfo, absl::StrCat("metrics on http://", absl::GetFlag(FLAGS_metrics_host), ":",
                                      exporter->port(), "/metrics"));
  }
  return Telemetry{std::move(registry), std::move(server_metrics), std::move(exporter)};
}

// The gRPC server for `service` on --host:--port, started, with the health
// and reflection services and every call's bytes counted; *bound_port is the
// port it listens on.
absl::StatusOr<std::unique_ptr<grpc::Server>> StartGrpcServer(
    service::TeService& service, const std::shared_ptr<grpc::ServerCredentials>& credentials,
    const metrics::ServerMetrics& server_metrics, int64_t max_message_bytes, int* bound_port) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string address =
      absl::StrCat(absl::GetFlag(FLAGS_host), ":", absl::GetFlag(FLAGS_port));
  builder.AddListeningPort(address, credentials, bound_port);
  builder.SetMaxReceiveMessageSize(static_cast<int>(max_message_bytes));
  builder.SetMaxSendMessageSize(static_cast<int>(max_message_bytes));
  builder.RegisterService(&service);
  // Every call's request and response bytes, unary and streaming alike.
  RETURN_IF_ERROR(metrics::CountRpcBytes(server_metrics, te::v1::TeService::service_full_name(),
                                         service::kRawMethods, &builder));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", address));
  }
  return server;
}

// Each device under its name, and the server while any device serves
// (DevicePool contract 4). Returns the devices that are not healthy.
std::string PublishHealth(const service::DevicePool& devices,
                          grpc::HealthCheckServiceInterface* health) {
  for (const service::HealthEntry& entry : devices.Health(kServiceName)) {
    health->SetServingStatus(entry.service, entry.serving);
  }
  return devices.UnhealthyNames();
}

// The gauges the housekeeping thread refreshes: sessions, queued calls,
// each device's memory, and the FP8 amax overflows counted so far.
void PublishGauges(const metrics::ServerMetrics& server_metrics, service::DevicePool& devices,
                   const session::SessionManager& sessions, const service::TeService& service) {
  server_metrics.sessions_open->Set(sessions.live_sessions());
  int queued = 0;
  const std::vector<service::DeviceLoad> loads = service.Loads();
  for (int i = 0; i < devices.size(); ++i) {
    queued += devices.executor(i).queued();
    server_metrics.SetDeviceMemory(devices.device(i).info().name, loads[i].bytes_in_use,
                                   devices.device(i).info().memory_bytes);
  }
  server_metrics.queue_depth->Set(queued);
  server_metrics.CountFp8AmaxOverflowsTo(session::Fp8NonFiniteAmaxes());
}

// Exits with 1 (a start that failed) or 2 (flags to fix), after logging why.
int Failed(int code, const absl::Status& status) {
  Log(LogLevel::kError, status.ToString());
  return code;
}

int Run() {
  if (absl::Status flags = CheckFlags(); !flags.ok()) return Failed(2, flags);
  absl::StatusOr<LogLevel> log_level = session::ParseLogLevel("--log_level", absl::GetFlag(FLAGS_log_level));
  if (!log_level.ok()) return Failed(2, log_level.status());
  session::SetMinLogLevel(*log_level);
  const sigset_t stop_signals = BlockStopSignals();
  absl::StatusOr<std::unique_ptr<service::DevicePool>> devices = OpenDevices();
  if (!devices.ok()) {
    return Failed(1, absl::Status(devices.status().code(),
                                  absl::StrCat("cannot open the devices: ",
                                               devices.status().message())));
  }
  absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> credentials =
      security::ServerCredentialsFor(security::TlsFilesFromFlags());
  if (!credentials.ok()) return Failed(2, credentials.status());
  absl::StatusOr<std::shared_ptr<const security::AccessKey>> access_key =
      security::AccessKeyFromFlags();
  if (!access_key.ok()) return Failed(2, access_key.status());
  absl::StatusOr<std::unique_ptr<session::CheckpointStore>> opened = OpenCheckpointsFromFlags();
  if (!opened.ok()) return Failed(2, opened.status());
  std::unique_ptr<session::CheckpointStore> checkpoints = *std::move(opened);

  const session::SessionManagerOptions manager_options =
      ManagerOptionsFromFlags(checkpoints.get(), devices->get());
  session::SessionManager sessions(manager_options);
  service::ServiceOptions options = ServiceOptionsFromFlags(manager_options.max_sessions);
  options.access_key = *access_key;
  options.checkpoints = checkpoints.get();
  if (checkpoints != nullptr) {
    options.sessions_restored =
        RestoreSessions(*checkpoints, devices->get(), options.session, &sessions);
  }
  // Every finished call is counted and timed; housekeeping refreshes the gauges.
  absl::StatusOr<Telemetry> telemetry = StartTelemetryFromFlags();
  if (!telemetry.ok()) return Failed(1, telemetry.status());
  const metrics::ServerMetrics& server_metrics = telemetry->metrics;
  options.on_finished = [m = server_metrics](absl::string_view method, absl::StatusCode code,
                                             absl::Duration latency) {
    m.ObserveRpc(method, code, latency);
  };
  service::TeService service(devices->get(), &sessions, options);
  int bound_port = 0;
  absl::StatusOr<std::unique_ptr<grpc::Server>> server = StartGrpcServer(
      service, *credentials, server_metrics, options.session.max_message_bytes, &bound_port);
  if (!server.ok()) return Failed(1, server.status());
  grpc::HealthCheckServiceInterface* health = (*server)->GetHealthCheckService();
  PublishHealth(**devices, health);
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    if (absl::Status written = WritePortFile(port_file, bound_port); !written.ok()) {
      (*server)->Shutdown();
      return Failed(1, written);
    }
  }
  Log(LogLevel::kInfo,
      absl::StrCat("te_server listening on ", absl::GetFlag(FLAGS_host), ":", bound_port,
                   " (max ", options.max_sessions, " sessions, ",
                   options.session.session_memory_bytes, " bytes each, idle ttl ",
                   options.session_ttl_seconds, " s)"),
      {{"transport", security::DescribeTransport(security::TlsFilesFromFlags())},
       {"access_key", options.access_key != nullptr ? "required" : "none"},
       {"state_dir", checkpoints != nullptr ? checkpoints->state_dir() : "none"}});

  // Housekeeping: expire idle sessions, follow the devices' health.
  std::string was_unhealthy;
  ServeUntilStopped(server->get(), health, stop_signals, [&] {
    sessions.Sweep();
    PublishGauges(server_metrics, **devices, sessions, service);
    const std::string unhealthy = PublishHealth(**devices, health);
    if (unhealthy != was_unhealthy) {
      Log(LogLevel::kError,
          absl::StrCat("sticky device error on ", unhealthy,
                       ": NOT_SERVING there; its sessions fail with UNAVAILABLE, the other "
                       "devices (if any) go on"));
    }
    was_unhealthy = unhealthy;
  });
  if (checkpoints != nullptr) {
    const int saved = service.SaveAllSessions(absl::Now() + kShutdownSaveWait);
    Log(LogLevel::kInfo, absl::StrCat("stopped; ", saved, " of ", sessions.live_sessions(),
                                      " sessions saved to ", checkpoints->state_dir()));
  } else {
    Log(LogLevel::kInfo, absl::StrCat("stopped; ", sessions.live_sessions(),
                                      " sessions dropped (no --state_dir)"));
  }
  return 0;
}

}  // namespace
}  // namespace te

int main(int argc, char** argv) {
  // --help lists the server's own flags (server/main.cc, server/security,
  // server/metrics), not only those of a file named like the program.
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view path) {
    return absl::StrContains(path, "server/");
  };
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "te_server: Transformer Engine style layers over gRPC.\n"
      "  te_server --port=50051 --device=auto");
  absl::ParseCommandLine(argc, argv);
  return te::Run();
}
