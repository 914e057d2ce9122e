#!/usr/bin/env bash
# te_server's metrics against Prometheus's own tools (Debian's prometheus
# package): sample_exporter serves the server's metric set (prometheus-cpp's
# families and text format, server/metrics) with made-up traffic;
#  1. `promtool check metrics` lints one scrape of it (format and naming rules);
#  2. a real Prometheus server scrapes it every second, and its query API must
#     show the target up and the values the exporter holds.
#   promtool_check.sh PATH_TO_SAMPLE_EXPORTER
set -euo pipefail

exporter_bin="$1"
for tool in promtool prometheus python3; do
  if ! command -v "$tool" >/dev/null; then
    echo "promtool_check: $tool not found; install Debian's prometheus package" >&2
    exit 1
  fi
done

work="$(mktemp -d "${TEST_TMPDIR:-/tmp}/promcheck.XXXXXX")"
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

# Polls until FILE exists (up to 20 s).
wait_for_file() {
  for _ in $(seq 200); do [ -s "$1" ] && return 0; sleep 0.1; done
  echo "promtool_check: $1 never appeared" >&2
  return 1
}

"$exporter_bin" --host=127.0.0.1 --port=0 --port_file="$work/port" 2>"$work/exporter.log" &
pids+=($!)
wait_for_file "$work/port"
port="$(cat "$work/port")"

fetch() { python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"; }

# 1. promtool's lint. It exits non-zero on any format error or lint problem.
fetch "http://127.0.0.1:$port/metrics" >"$work/scrape.txt"
if ! promtool check metrics <"$work/scrape.txt" >"$work/promtool.out" 2>&1; then
  echo "promtool_check: promtool check metrics failed:" >&2
  cat "$work/promtool.out" >&2
  exit 1
fi
echo "promtool check metrics: clean ($(grep -vc '^#' "$work/scrape.txt") samples)"

# 2. A real Prometheus server scraping every second.
prom_port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
cat >"$work/prometheus.yml" <<YAML
global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: te_server
    static_configs:
      - targets: ["127.0.0.1:$port"]
YAML
promtool check config "$work/prometheus.yml" >/dev/null
prometheus --config.file="$work/prometheus.yml" --storage.tsdb.path="$work/data" \
  --web.listen-address="127.0.0.1:$prom_port" --log.level=warn 2>"$work/prometheus.log" &
pids+=($!)

# Each query must come back as a one-element vector with the expected value.
python3 - "$prom_port" <<'PY'
import json, sys, time, urllib.parse, urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"
expected = {
    'up{job="te_server"}': 1,
    "te_sessions_open": 12,
    "te_queue_depth": 3,
    "sum(te_rpc_requests_total)": 1000,
    "sum(te_rpc_latency_seconds_count)": 1000,
    'sum(te_rpc_latency_seconds_bucket{le="+Inf"})': 1000,
    'te_device_memory_total_bytes{device="cuda:0"}': 140 * 2**30,
    'te_device_memory_used_bytes{device="cuda:0"}': 3 * 2**30,
    "count(te_rpc_received_bytes_total)": 5,
    "count(te_rpc_sent_bytes_total)": 5,
    'count(te_rpc_latency_seconds_bucket{method="Forward"})': 19,
    "te_fp8_amax_overflows_total": 4,
}

def query(expr):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]

deadline = time.time() + 60
pending = dict(expected)
last = {}
while pending and time.time() < deadline:
    for expr, want in list(pending.items()):
        try:
            result = query(expr)
        except OSError as error:  # not listening yet
            last[expr] = str(error)
            continue
        last[expr] = result
        if len(result) == 1 and float(result[0]["value"][1]) == want:
            del pending[expr]
    if pending:
        time.sleep(0.5)
if pending:
    for expr in pending:
        print(f"prometheus: {expr} != {expected[expr]}; last answer: {last.get(expr)}", file=sys.stderr)
    sys.exit(1)
with urllib.request.urlopen(f"{base}/api/v1/targets", timeout=5) as response:
    targets = json.load(response)["data"]["activeTargets"]
errors = [t["lastError"] for t in targets if t["lastError"]]
if errors:
    print(f"prometheus: scrape errors: {errors}", file=sys.stderr)
    sys.exit(1)
print(f"prometheus scraped te_server's metrics: {len(expected)} queries as expected")
PY
