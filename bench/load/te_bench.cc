// te_bench: a multi-client load generator for te_server (see te_bench_lib.h).
//
//   te_bench --server=localhost:50051 --clients=1,2,4,8 --layer=transformer --config=small
//            --op=forward_backward --fp8=delayed --duration_s=10 --json=out.json
//
// Prints a progress line per second on stderr, then the table on stdout, and
// the JSON report to --json (stdout after the table when --json is empty).
// Exit status: 0 when no call failed, 1 when some did (the report still
// prints), 2 for bad flags or a server that does not answer.
//
// With --soak_minutes it runs the soak instead (te_bench_soak.h): a mix of
// training and churning sessions for that long, a line per --soak_interval_s,
// and with --soak_restart_wait_s a check that a restarted server restored the
// held sessions bit for bit (bench/soak.sh drives it). Exit status 0 when no
// call failed and every held session came back, 1 otherwise.
#include <fstream>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "bench/load/te_bench_lib.h"
#include "bench/load/te_bench_soak.h"
#include "kernels/status_macros.h"

ABSL_FLAG(std::string, server, "localhost:50051", "te_server address (host:port)");
ABSL_FLAG(std::string, clients, "1", "concurrent clients per sweep point, e.g. 1,2,4,8");
ABSL_FLAG(std::string, layer, "transformer", "dense | layernorm_mlp | transformer | flax");
ABSL_FLAG(std::string, config, "small",
          "layer sizes: small (batch 2, seq 32, hidden 64, ffn 256, 4 heads) or quickstart (batch 4, "
          "seq 2048, hidden 4096, ffn 16384, 32 heads); --batch etc. override single sizes");
ABSL_FLAG(int64_t, batch, 0, "batch size (0: from --config)");
ABSL_FLAG(int64_t, seq, 0, "sequence length (0: from --config)");
ABSL_FLAG(int64_t, hidden, 0, "hidden size (0: from --config)");
ABSL_FLAG(int64_t, ffn, 0, "FFN (MLP) size (0: from --config)");
ABSL_FLAG(int, heads, 0, "attention heads (0: from --config)");
ABSL_FLAG(std::string, dtype, "bf16", "x's dtype: bf16 | f32 | f16");
ABSL_FLAG(std::string, op, "forward_backward", "forward | forward_backward | put | get");
ABSL_FLAG(std::string, fp8, "none", "none | delayed (DelayedScaling HYBRID, history 16, max) | current");
ABSL_FLAG(int, micro_batches, 1, "micro-batches per ForwardBackward call");
ABSL_FLAG(bool, deterministic, true, "false: dropout on, a fresh seed per call");
ABSL_FLAG(double, duration_s, 10.0, "seconds per sweep point (when --count is 0)");
ABSL_FLAG(int64_t, count, 0, "timed calls per client per point (0: run for --duration_s)");
ABSL_FLAG(int, warmup, 2, "untimed calls per client before each point");
ABSL_FLAG(bool, fetch_outputs, false, "forward: bring y back (else it stays resident and is deleted)");
ABSL_FLAG(std::string, device, "", "the sessions' device, e.g. cuda:0 (empty: the server's choice)");
ABSL_FLAG(std::string, affinity_keys, "",
          "comma-separated x-te-session keys, client i taking the i-th (cycling); empty: random");
ABSL_FLAG(double, rpc_timeout_s, 600.0, "deadline of each call");
ABSL_FLAG(std::string, json, "", "write the JSON report here (empty: stdout, after the table)");
ABSL_FLAG(double, soak_minutes, 0, "run the soak for this long instead of a sweep (0: no soak)");
ABSL_FLAG(int, soak_churners, 2, "soak: clients that open a session, step and close it, again");
ABSL_FLAG(int, soak_churn_steps, 4, "soak: steps per churned session");
ABSL_FLAG(bool, soak_generate, true,
          "soak: a client generating from an LM (Generate) the whole run");
ABSL_FLAG(double, soak_interval_s, 60, "soak: seconds per stats line");
ABSL_FLAG(double, soak_warmup_s, 60, "soak: memory slopes start after this many seconds");
ABSL_FLAG(int, server_pid, 0, "soak: the server's pid, for its resident memory (same host)");
ABSL_FLAG(double, soak_restart_wait_s, 0,
          "soak: after the run, record the held sessions' variables, then wait this long for a "
          "restarted server and compare (0: no restore check)");
ABSL_FLAG(std::string, soak_ready_file, "",
          "soak: created once the variables are recorded (the moment to restart the server)");

namespace te::client::bench {
namespace {

absl::StatusOr<DType> ParseDType(const std::string& text) {
  if (text == "bf16" || text == "bfloat16") return DType::kBF16;
  if (text == "f32" || text == "float32") return DType::kF32;
  if (text == "f16" || text == "float16") return DType::kF16;
  return absl::InvalidArgumentError(absl::StrCat("--dtype: \"", text, "\" is not bf16, f32 or f16"));
}

absl::StatusOr<BenchOptions> OptionsFromFlags() {
  BenchOptions o;
  o.server = absl::GetFlag(FLAGS_server);
  ASSIGN_OR_RETURN(o.clients, ParseClientList(absl::GetFlag(FLAGS_clients)));
  ASSIGN_OR_RETURN(o.layer, ParseLayer(absl::GetFlag(FLAGS_layer)));
  ASSIGN_OR_RETURN(o.size, SizeForConfig(absl::GetFlag(FLAGS_config)));
  if (absl::GetFlag(FLAGS_batch) > 0) o.size.batch = absl::GetFlag(FLAGS_batch);
  if (absl::GetFlag(FLAGS_seq) > 0) o.size.seq = absl::GetFlag(FLAGS_seq);
  if (absl::GetFlag(FLAGS_hidden) > 0) o.size.hidden = absl::GetFlag(FLAGS_hidden);
  if (absl::GetFlag(FLAGS_ffn) > 0) o.size.ffn = absl::GetFlag(FLAGS_ffn);
  if (absl::GetFlag(FLAGS_heads) > 0) o.size.heads = absl::GetFlag(FLAGS_heads);
  ASSIGN_OR_RETURN(o.dtype, ParseDType(absl::GetFlag(FLAGS_dtype)));
  ASSIGN_OR_RETURN(o.op, ParseOp(absl::GetFlag(FLAGS_op)));
  ASSIGN_OR_RETURN(o.fp8, ParseFp8(absl::GetFlag(FLAGS_fp8)));
  o.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  o.deterministic = absl::GetFlag(FLAGS_deterministic);
  o.duration = absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  o.count = absl::GetFlag(FLAGS_count);
  o.warmup = absl::GetFlag(FLAGS_warmup);
  o.fetch_outputs = absl::GetFlag(FLAGS_fetch_outputs);
  o.device = absl::GetFlag(FLAGS_device);
  o.affinity_keys = absl::StrSplit(absl::GetFlag(FLAGS_affinity_keys), ',', absl::SkipEmpty());
  o.rpc_timeout = absl::Seconds(absl::GetFlag(FLAGS_rpc_timeout_s));
  o.progress = &std::cerr;
  RETURN_IF_ERROR(Validate(o));
  return o;
}

int Soak(const BenchOptions& bench) {
  SoakOptions o;
  o.server = bench.server;
  o.size = bench.size;
  o.device = bench.device;
  o.duration = absl::Seconds(absl::GetFlag(FLAGS_soak_minutes) * 60);
  o.churners = absl::GetFlag(FLAGS_soak_churners);
  o.churn_steps = absl::GetFlag(FLAGS_soak_churn_steps);
  o.generate = absl::GetFlag(FLAGS_soak_generate);
  o.interval = absl::Seconds(absl::GetFlag(FLAGS_soak_interval_s));
  o.warmup = absl::Seconds(absl::GetFlag(FLAGS_soak_warmup_s));
  o.server_pid = absl::GetFlag(FLAGS_server_pid);
  o.restart_wait = absl::Seconds(absl::GetFlag(FLAGS_soak_restart_wait_s));
  o.ready_file = absl::GetFlag(FLAGS_soak_ready_file);
  o.rpc_timeout = bench.rpc_timeout;
  o.out = &std::cout;
  absl::StatusOr<SoakReport> report = RunSoak(o);
  if (!report.ok()) {
    std::cerr << "te_bench: " << report.status() << std::endl;
    return 2;
  }
  return report->ok() ? 0 : 1;
}

int Main() {
  absl::StatusOr<BenchOptions> options = OptionsFromFlags();
  if (!options.ok()) {
    std::cerr << "te_bench: " << options.status() << std::endl;
    return 2;
  }
  if (absl::GetFlag(FLAGS_soak_minutes) > 0) return Soak(*options);
  absl::StatusOr<BenchReport> report = RunBench(*options);
  if (!report.ok()) {
    std::cerr << "te_bench: " << report.status() << std::endl;
    return 2;
  }
  std::cout << FormatTable(*report) << std::flush;
  const std::string json = FormatJson(*report);
  const std::string path = absl::GetFlag(FLAGS_json);
  if (path.empty()) {
    std::cout << json << std::flush;
  } else {
    std::ofstream out(path);
    out << json;
    if (!out.good()) {
      std::cerr << "te_bench: could not write the JSON report to --json=" << path << std::endl;
      return 2;
    }
  }
  return report->total_errors() == 0 ? 0 : 1;
}

}  // namespace
}  // namespace te::client::bench

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return te::client::bench::Main();
}
