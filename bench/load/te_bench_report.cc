// te_bench: option parsing, latency statistics, and the table and JSON reports.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/load/te_bench_lib.h"
#include "nlohmann/json.hpp"

namespace te::client::bench {

int64_t BenchReport::total_errors() const {
  int64_t total = 0;
  for (const SweepPoint& p : points) {
    for (const auto& [code, n] : p.errors) total += n;
  }
  return total;
}

// ---- parsing --------------------------------------------------------------------

absl::StatusOr<std::vector<int>> ParseClientList(absl::string_view text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipWhitespace())) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--clients: \"", part, "\" in \"", text, "\" is not a positive integer"));
    }
    out.push_back(n);
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--clients: \"", text, "\" names no client count"));
  }
  return out;
}

absl::StatusOr<BenchLayer> ParseLayer(absl::string_view text) {
  if (text == "dense") return BenchLayer::kDense;
  if (text == "layernorm_mlp") return BenchLayer::kLayerNormMlp;
  if (text == "transformer") return BenchLayer::kTransformer;
  if (text == "flax") return BenchLayer::kFlax;
  return absl::InvalidArgumentError(
      absl::StrCat("--layer: \"", text, "\" is not dense, layernorm_mlp, transformer or flax"));
}

absl::StatusOr<BenchOp> ParseOp(absl::string_view text) {
  if (text == "forward") return BenchOp::kForward;
  if (text == "forward_backward") return BenchOp::kForwardBackward;
  if (text == "put") return BenchOp::kPut;
  if (text == "get") return BenchOp::kGet;
  return absl::InvalidArgumentError(
      absl::StrCat("--op: \"", text, "\" is not forward, forward_backward, put or get"));
}

absl::StatusOr<Fp8Mode> ParseFp8(absl::string_view text) {
  if (text == "none") return Fp8Mode::kNone;
  if (text == "delayed") return Fp8Mode::kDelayed;
  if (text == "current") return Fp8Mode::kCurrent;
  return absl::InvalidArgumentError(absl::StrCat("--fp8: \"", text, "\" is not none, delayed or current"));
}

const char* LayerName(BenchLayer layer) {
  switch (layer) {
    case BenchLayer::kDense:
      return "dense";
    case BenchLayer::kLayerNormMlp:
      return "layernorm_mlp";
    case BenchLayer::kTransformer:
      return "transformer";
    case BenchLayer::kFlax:
      return "flax";
  }
  return "?";
}

const char* OpName(BenchOp op) {
  switch (op) {
    case BenchOp::kForward:
      return "forward";
    case BenchOp::kForwardBackward:
      return "forward_backward";
    case BenchOp::kPut:
      return "put";
    case BenchOp::kGet:
      return "get";
  }
  return "?";
}

const char* Fp8Name(Fp8Mode mode) {
  switch (mode) {
    case Fp8Mode::kNone:
      return "none";
    case Fp8Mode::kDelayed:
      return "delayed";
    case Fp8Mode::kCurrent:
      return "current";
  }
  return "?";
}

absl::Status Validate(const BenchOptions& o) {
  if (o.clients.empty()) return absl::InvalidArgumentError("clients: empty sweep");
  for (int n : o.clients) {
    if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("clients: ", n, " is not positive"));
  }
  const LayerSize& s = o.size;
  if (s.batch <= 0 || s.seq <= 0 || s.hidden <= 0 || s.ffn <= 0 || s.heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("size: batch ", s.batch, ", seq ", s.seq, ", hidden ",
                                                   s.hidden, ", ffn ", s.ffn, ", heads ", s.heads,
                                                   " must all be positive"));
  }
  if (s.hidden % s.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("size: heads ", s.heads, " does not divide hidden ", s.hidden));
  }
  if (o.micro_batches <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("micro_batches: ", o.micro_batches, " is not positive"));
  }
  if (o.count < 0) return absl::InvalidArgumentError(absl::StrCat("count: ", o.count, " is negative"));
  if (o.count == 0 && o.duration <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("duration: ", absl::FormatDuration(o.duration),
                                                   " with count 0: give a positive duration or count"));
  }
  if (o.warmup < 0) return absl::InvalidArgumentError(absl::StrCat("warmup: ", o.warmup, " is negative"));
  if (o.dtype != DType::kBF16 && o.dtype != DType::kF32 && o.dtype != DType::kF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: ", DTypeName(o.dtype), "; x must be float32, bfloat16 or float16"));
  }
  return absl::OkStatus();
}

// ---- statistics ------------------------------------------------------------------

namespace {

// The nearest-rank percentile of sorted values: the smallest value with at
// least p% of the values at or below it.
double NearestRank(const std::vector<double>& sorted, double p) {
  const size_t n = sorted.size();
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(n)));
  rank = std::clamp<size_t>(rank, 1, n);
  return sorted[rank - 1];
}

}  // namespace

LatencySummary SummarizeLatencies(std::vector<double> ms) {
  LatencySummary s;
  if (ms.empty()) return s;
  std::sort(ms.begin(), ms.end());
  s.p50 = NearestRank(ms, 50);
  s.p90 = NearestRank(ms, 90);
  s.p99 = NearestRank(ms, 99);
  s.mean = std::accumulate(ms.begin(), ms.end(), 0.0) / static_cast<double>(ms.size());
  s.min = ms.front();
  s.max = ms.back();
  return s;
}

// ---- reports ---------------------------------------------------------------------

namespace {

bool MovesTensors(BenchOp op) { return op == BenchOp::kPut || op == BenchOp::kGet; }

std::string ErrorsText(const std::map<std::string, int64_t>& errors) {
  if (errors.empty()) return "0";
  std::vector<std::string> parts;
  for (const auto& [code, n] : errors) parts.push_back(absl::StrCat(code, " ", n));
  return absl::StrJoin(parts, ", ");
}

std::string Header(const BenchReport& r) {
  const BenchOptions& o = r.options;
  const LayerSize& s = o.size;
  std::string run = o.count > 0 ? absl::StrCat(o.count, " calls per client")
                                : absl::StrCat(absl::FormatDuration(o.duration), " per point");
  return absl::StrCat(
      "te_bench: ", LayerName(o.layer), " ", OpName(o.op), ", batch ", s.batch, " seq ", s.seq, " hidden ",
      s.hidden, " ffn ", s.ffn, " heads ", s.heads, ", ", DTypeName(o.dtype), ", fp8 ", Fp8Name(o.fp8),
      o.op == BenchOp::kForwardBackward ? absl::StrCat(", ", o.micro_batches, " micro-batch(es)")
                                        : std::string(),
      ", ", run, ", ", o.warmup, " warm-up\nserver ", o.server, " (te_server ", r.server_version,
      r.devices.empty() ? "" : "; ", absl::StrJoin(r.devices, ", "), ")\n");
}

}  // namespace

std::string FormatTable(const BenchReport& report) {
  const bool bytes = MovesTensors(report.options.op);
  std::string out = Header(report);
  absl::StrAppendFormat(&out, "%7s %9s %10s %10s", "clients", "calls", "calls/s", "steps/s");
  if (bytes) absl::StrAppendFormat(&out, " %9s", "MB/s");
  absl::StrAppendFormat(&out, " %9s %9s %9s  %-28s %s\n", "p50 ms", "p90 ms", "p99 ms",
                        "slowest/fastest client", "errors");
  for (const SweepPoint& p : report.points) {
    absl::StrAppendFormat(&out, "%7d %9d %10.2f %10.2f", p.clients, p.calls, p.calls_per_s, p.steps_per_s);
    if (bytes) absl::StrAppendFormat(&out, " %9.1f", p.megabytes_per_s);
    const std::string fairness =
        absl::StrFormat("%.2f/%.2f calls/s = %.2f", p.slowest_calls_per_s, p.fastest_calls_per_s, p.fairness);
    absl::StrAppendFormat(&out, " %9.3f %9.3f %9.3f  %-28s %s\n", p.latency_ms.p50, p.latency_ms.p90,
                          p.latency_ms.p99, fairness, ErrorsText(p.errors));
  }
  for (const SweepPoint& p : report.points) {
    for (const auto& [code, message] : p.error_examples) {
      absl::StrAppend(&out, "  ", p.clients, " clients, ", code, ": ", message, "\n");
    }
  }
  return out;
}

std::string FormatJson(const BenchReport& report) {
  const BenchOptions& o = report.options;
  nlohmann::json j;
  j["tool"] = "te_bench";
  j["server"] = o.server;
  j["server_version"] = report.server_version;
  j["devices"] = report.devices;
  j["layer"] = LayerName(o.layer);
  j["op"] = OpName(o.op);
  j["fp8"] = Fp8Name(o.fp8);
  j["dtype"] = DTypeName(o.dtype);
  j["size"] = {{"batch", o.size.batch},
               {"seq", o.size.seq},
               {"hidden", o.size.hidden},
               {"ffn", o.size.ffn},
               {"heads", o.size.heads}};
  j["micro_batches"] = o.micro_batches;
  j["deterministic"] = o.deterministic;
  j["duration_s"] = absl::ToDoubleSeconds(o.duration);
  j["count"] = o.count;
  j["warmup"] = o.warmup;
  j["total_errors"] = report.total_errors();
  nlohmann::json points = nlohmann::json::array();
  for (const SweepPoint& p : report.points) {
    nlohmann::json e;
    e["clients"] = p.clients;
    e["seconds"] = p.seconds;
    e["calls"] = p.calls;
    e["failed_calls"] = p.failed_calls;
    e["calls_per_s"] = p.calls_per_s;
    e["steps_per_s"] = p.steps_per_s;
    if (MovesTensors(o.op)) e["megabytes_per_s"] = p.megabytes_per_s;
    e["latency_ms"] = {{"p50", p.latency_ms.p50},   {"p90", p.latency_ms.p90}, {"p99", p.latency_ms.p99},
                       {"mean", p.latency_ms.mean}, {"min", p.latency_ms.min}, {"max", p.latency_ms.max}};
    e["per_client_calls_per_s"] = p.per_client_calls_per_s;
    e["fairness"] = {{"slowest_calls_per_s", p.slowest_calls_per_s},
                     {"fastest_calls_per_s", p.fastest_calls_per_s},
                     {"slowest_over_fastest", p.fairness}};
    nlohmann::json errors = nlohmann::json::object();
    for (const auto& [code, n] : p.errors) errors[code] = n;
    e["errors"] = errors;
    nlohmann::json examples = nlohmann::json::object();
    for (const auto& [code, message] : p.error_examples) examples[code] = message;
    e["error_examples"] = examples;
    points.push_back(std::move(e));
  }
  j["points"] = std::move(points);
  return j.dump(2) + "\n";
}

}  // namespace te::client::bench
