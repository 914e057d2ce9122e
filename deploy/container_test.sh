#!/usr/bin/env bash
# Builds te_server's CPU image and runs it for real under a Docker engine of
# its own, as CI does (.ci/run), then removes what it made:
#
#   1. one container, its port published: health turns healthy, the
#      quickstart runs through the port, it runs as uid 10001, and a session
#      survives `docker stop` (SIGTERM to te_server as PID 1: drain, save)
#      and `docker start`;
#   2. docker-compose: three replicas behind nginx hashing x-te-session,
#      te_bench with 16 clients through it; every session's calls land on one
#      replica (replicas' and balancer's logs) and all three get sessions;
#   3. a replica killed (SIGKILL) while every session steps: its sessions get
#      UNAVAILABLE naming it, the others' calls all succeed; restarted on its
#      state volume, its checkpointed sessions resume bit for bit;
#   4. Prometheus (Debian's) inside the compose network scrapes every replica,
#      read back through its HTTP API;
#   5. the Kubernetes manifests through Debian's kubectl, client side only.
#
#   bash deploy/container_test.sh        # as root; prints "N passed, N failed" last
#
# Needs root and Debian's archive (it installs docker.io, debootstrap and
# docker-compose when missing). Its dockerd has its own socket, data root and
# pid file (/run/te_docker*, /var/lib/te_docker), so it never meets another
# engine; the images stay in that data root, and the debootstrap root in
# /var/cache/te_docker, as caches for the next run. Where dockerd cannot
# start, everything is skipped with a message and nothing counts as failed.
# Ports on 127.0.0.1: TE_CT_PORT (50061), TE_LB_PORT (50070),
# TE_PROMETHEUS_PORT (9095).
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$PWD"
t0=$(date +%s)
now() { echo $(( $(date +%s) - t0 )); }
passed=0 failed=0
declare -a times=()
pass() { passed=$((passed + 1)); echo "container_test: PASS ($(now) s): $*"; }
fail() { failed=$((failed + 1)); echo "container_test: FAIL ($(now) s): $*"; }
expect() { local what="$1"; shift; if "$@"; then pass "$what"; else fail "$what"; fi; }
stage_start=$t0
stage() { times+=("$1 $(( $(date +%s) - stage_start )) s"); stage_start=$(date +%s); }
finish() {
  echo "container_test: stage times: $(IFS=';'; echo "${times[*]:-none}"); $(now) s in all"
  echo "$passed passed, $failed failed"
  [ "$failed" -eq 0 ]
  exit
}
skip() {
  echo "container_test: SKIPPED: $*"
  echo "$passed passed, $failed failed"
  exit 0
}

[ "$(id -u)" -eq 0 ] || skip "needs root (dockerd, debootstrap)"

export DEBIAN_FRONTEND=noninteractive
need=()
for p in docker.io debootstrap docker-compose; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
  echo "container_test: installing ${need[*]}" >&2
  if ! { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null; }; then
    fail "apt-get install ${need[*]}"
    finish
  fi
fi

# Debian's client, not whatever docker is first on PATH.
docker=/usr/bin/docker
export DOCKER=$docker DOCKER_HOST=unix:///run/te_docker.sock COMPOSE_PROJECT_NAME=te-ct
export COMPOSE_HTTP_TIMEOUT=120
ct_port="${TE_CT_PORT:-50061}"
export TE_LB_PORT="${TE_LB_PORT:-50070}" TE_PROMETHEUS_PORT="${TE_PROMETHEUS_PORT:-9095}"
compose=(docker-compose -f deploy/container/compose.replicas.yaml)
work="$(mktemp -d /tmp/te_container_test.XXXXXX)"
pidfile=/run/te_docker.pid

# ---- dockerd, started here and stopped by its pid ---------------------------------
iptables-save >"$work/iptables.v4" 2>/dev/null || true
ip_forward="$(cat /proc/sys/net/ipv4/ip_forward)"
had_docker0=0; ip link show docker0 >/dev/null 2>&1 && had_docker0=1
dockerd_pid=""

# iptables-restore only resets the tables its input names, so the tables
# dockerd writes (filter, nat) are emptied first, with default policies.
restore_network() {
  [ "$had_docker0" -eq 0 ] && ip link delete docker0 2>/dev/null
  for table in nat filter; do
    iptables -t "$table" -F 2>/dev/null; iptables -t "$table" -X 2>/dev/null
  done
  for chain in INPUT FORWARD OUTPUT; do iptables -P "$chain" ACCEPT 2>/dev/null; done
  [ -s "$work/iptables.v4" ] && iptables-restore <"$work/iptables.v4" 2>/dev/null
  echo "$ip_forward" >/proc/sys/net/ipv4/ip_forward
}

cleanup() {
  if [ -n "$dockerd_pid" ]; then
    timeout 120 "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
    ids="$($docker ps -aq --filter label=te-container-test 2>/dev/null)"
    [ -n "$ids" ] && $docker rm -f $ids >/dev/null 2>&1
    $docker volume rm -f te-ct-single-state >/dev/null 2>&1
    $docker network prune -f >/dev/null 2>&1
    kill "$dockerd_pid" 2>/dev/null
    for _ in $(seq 40); do kill -0 "$dockerd_pid" 2>/dev/null || break; sleep 0.5; done
    kill -9 "$dockerd_pid" 2>/dev/null
    # What dockerd leaves: its bridge, its iptables chains, ip_forward.
    restore_network
  fi
  rm -rf "$work"
}
trap cleanup EXIT
trap "exit 143" TERM INT

if [ -s "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
  skip "a dockerd (pid $(cat "$pidfile")) already runs on $DOCKER_HOST"
fi
dockerd --host="$DOCKER_HOST" --data-root=/var/lib/te_docker --exec-root=/run/te_docker \
  --pidfile="$pidfile" >"$work/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 40); do
  $docker info >/dev/null 2>&1 && break
  kill -0 "$dockerd_pid" 2>/dev/null || break
  sleep 0.5
done
if ! $docker info >/dev/null 2>&1; then
  tail -n 5 "$work/dockerd.log" >&2
  kill "$dockerd_pid" 2>/dev/null; wait "$dockerd_pid" 2>/dev/null; dockerd_pid=""
  restore_network
  skip "dockerd did not start (log above)"
fi
# A run that was killed may have left its containers in the data root.
timeout 120 "${compose[@]}" down -v --remove-orphans >/dev/null 2>&1
$docker rm -f te-ct-single >/dev/null 2>&1
$docker volume rm -f te-ct-single-state >/dev/null 2>&1
stage "dockerd"

# ---- images ----------------------------------------------------------------------------
if ! bazel build //server:te_server //deploy:health_probe //client:quickstart //bench/load:te_bench \
     >"$work/bazel.log" 2>&1; then
  tail -n 20 "$work/bazel.log"
  fail "bazel build of te_server, health_probe, quickstart, te_bench"
  finish
fi
bin="$(bazel info bazel-bin 2>/dev/null)"
BUNDLE_NO_BENCH=1 BUNDLE_TARGETS="//server:te_server //deploy:health_probe" \
  bash deploy/bundle.sh "$work/bundle" >"$work/bundle.log" 2>&1 &&
  bash deploy/container/cpu_cuda_libs.sh "$work/bundle" >>"$work/bundle.log" 2>&1
expect "the bundle for the CPU image (te_server, health_probe, their libraries)" test -x "$work/bundle/te_server"
stage "bundle"
expect "the Debian 12 base image (debootstrap, cached)" timeout 600 bash deploy/container/base_image.sh local/debian:12
stage "base image"
mkdir -p "$work/lb" "$work/prometheus"
cp deploy/container/nginx.conf "$work/lb/"
cp /usr/bin/prometheus deploy/container/prometheus.yml "$work/prometheus/"
build() {  # TAG DOCKERFILE CONTEXT [ARGS...]
  local tag="$1" file="$2" context="$3"; shift 3
  timeout 600 $docker build -q -f "$file" "$@" -t "$tag" "$context" >"$work/build.log" 2>&1 ||
    { tail -n 20 "$work/build.log"; return 1; }
}
expect "docker build te_server:cpu (deploy/Dockerfile, BASE_IMAGE=local/debian:12)" \
  build te_server:cpu deploy/Dockerfile "$work/bundle" --build-arg BASE_IMAGE=local/debian:12
expect "docker build te_lb:nginx (Debian's nginx)" build te_lb:nginx deploy/container/lb.Dockerfile "$work/lb"
expect "docker build te_prometheus:debian (Debian's prometheus)" \
  build te_prometheus:debian deploy/container/prometheus.Dockerfile "$work/prometheus"
image_bytes="$($docker image inspect -f '{{.Size}}' te_server:cpu 2>/dev/null || echo 0)"
echo "container_test: image te_server:cpu is $((image_bytes / 1000000)) MB ($(( $($docker image inspect -f '{{.Size}}' local/debian:12 2>/dev/null || echo 0) / 1000000 )) MB of it the base)"
stage "images"

# ---- 1. one container ---------------------------------------------------------------
wait_healthy() {  # CONTAINER SECONDS
  local status=""
  for _ in $(seq $(( $2 * 2 ))); do
    status="$($docker inspect -f '{{.State.Health.Status}}' "$1" 2>/dev/null)"
    [ "$status" = healthy ] && return 0
    sleep 0.5
  done
  echo "container_test: $1 health is '$status'" >&2
  return 1
}
export TE_CLIENT_STUBS_DIR="$work/stubs" PYTHONPATH="$repo/client/python"
/usr/bin/python3 client/python/te_client/_stubs.py --out "$TE_CLIENT_STUBS_DIR" >/dev/null
check_py() { timeout 300 /usr/bin/python3 deploy/container/container_check.py "$@"; }

$docker run -d --name te-ct-single --label te-container-test -p "127.0.0.1:$ct_port:50051" \
  --health-interval=2s -v te-ct-single-state:/var/lib/te_server -e TE_FLAG_DEVICE=cpu \
  te_server:cpu >/dev/null
expect "one container: health turns healthy (health_probe as HEALTHCHECK)" wait_healthy te-ct-single 60
expect "one container: runs as te (uid 10001), not root" \
  bash -c "$docker top te-ct-single -o pid,uid,args | awk '\$2 == 10001 && /te_server/' | grep -q ."
timeout 300 "$bin/client/quickstart" --server="127.0.0.1:$ct_port" >"$work/quickstart.log" 2>&1
quickstart_rc=$?
tail -n 3 "$work/quickstart.log"
expect "one container: the quickstart's six variants through the published port" test "$quickstart_rc" -eq 0
check_py hold "127.0.0.1:$ct_port" "$work/held.json"; [ $? -eq 0 ] && pass "a session held open" || fail "a session held open"
timeout 60 $docker stop -t 30 te-ct-single >/dev/null
expect "docker stop: te_server, PID 1, exits 0 on SIGTERM" \
  test "$($docker inspect -f '{{.State.ExitCode}}' te-ct-single)" = 0
expect "docker stop: it drained and saved the open session to its volume" \
  bash -c "$docker logs te-ct-single 2>&1 | grep -q 'stopped; 1 of 1 sessions saved'"
$docker start te-ct-single >/dev/null
wait_healthy te-ct-single 60 >/dev/null
check_py resume "127.0.0.1:$ct_port" "$work/held.json"
[ $? -eq 0 ] && pass "docker start: the saved session resumes" || fail "docker start: the saved session resumes"
$docker rm -f te-ct-single >/dev/null
$docker volume rm -f te-ct-single-state >/dev/null
stage "one container"

# ---- 2. three replicas behind nginx ----------------------------------------------------
if timeout 180 "${compose[@]}" up -d >"$work/compose.log" 2>&1; then
  pass "docker-compose up: te-1, te-2, te-3 healthy, then nginx and Prometheus"
else
  tail -n 20 "$work/compose.log"
  fail "docker-compose up"
  finish
fi
stage "compose up"
# te_bench's 16 session keys are chosen to cover the three replicas (random
# keys left one empty about once in 200 runs).
check_py probe_keys "127.0.0.1:$TE_LB_PORT" 48
"${compose[@]}" logs --no-color lb >"$work/lb_probe.log" 2>&1
check_py pick_keys "$work/lb_probe.log" 16 "$work/keys"
[ $? -eq 0 ] && pass "16 session keys that cover every replica" || fail "16 session keys that cover every replica"
timeout 120 "$bin/bench/load/te_bench" --server="127.0.0.1:$TE_LB_PORT" --clients=16 --layer=transformer \
  --config=small --duration_s=8 --warmup=2 --affinity_keys="$(cat "$work/keys" 2>/dev/null)" \
  --json="$work/bench.json" >"$work/bench.log" 2>&1
bench_rc=$?
grep -A2 '^clients' "$work/bench.log"
expect "te_bench, 16 clients through the balancer: no call failed" test "$bench_rc" -eq 0
mkdir -p "$work/logs"
for s in te-1 te-2 te-3 lb; do "${compose[@]}" logs --no-color "$s" >"$work/logs/$s.log" 2>&1; done
check_py affinity "$work/logs" "$work/bench.json"; [ $? -eq 0 ] && pass "session affinity" || fail "session affinity"
stage "te_bench and affinity"

# ---- 4 (before 3, while no replica has restarted). Prometheus ---------------------------
bench_calls="$(python3 -c "import json; p = json.load(open('$work/bench.json'))['points'][0]; print(p['calls'] + 2 * p['clients'])" 2>/dev/null || echo 0)"
check_py prometheus "http://127.0.0.1:$TE_PROMETHEUS_PORT" "$bench_calls"
[ $? -eq 0 ] && pass "Prometheus scrapes every replica" || fail "Prometheus scrapes every replica"
stage "Prometheus"

# ---- 3. a replica killed in the middle -------------------------------------------------
replicas=te-1=10.213.7.11:50051,te-2=10.213.7.12:50051,te-3=10.213.7.13:50051
check_py failover "127.0.0.1:$TE_LB_PORT" "$replicas" \
  "$docker kill -s KILL te-ct_{replica}_1" "$docker start te-ct_{replica}_1" "$work/failover.json"
[ $? -eq 0 ] && pass "a replica killed and restarted on its state volume" ||
  fail "a replica killed and restarted on its state volume"
stage "failover"
timeout 120 "${compose[@]}" down -v >/dev/null 2>&1
expect "docker-compose down: nothing of the deployment left" \
  test -z "$($docker ps -aq --filter label=com.docker.compose.project=te-ct)"
stage "compose down"

# ---- 5. Kubernetes manifests, client side (Debian's kubectl, from its .deb) -----------
kube_dir=/var/cache/te_docker/kubernetes-client
if [ ! -x "$kube_dir/usr/bin/kubectl" ]; then
  # Unpacked, not installed: another kubectl may own /usr/bin/kubectl.
  mkdir -p "$kube_dir" && (cd "$work" && apt-get download -q kubernetes-client >/dev/null 2>&1) &&
    dpkg-deb -x "$work"/kubernetes-client_*.deb "$kube_dir"
fi
kubectl="$kube_dir/usr/bin/kubectl"
if [ -x "$kubectl" ]; then
  export KUBECONFIG="$work/no-cluster.kubeconfig"
  : >"$KUBECONFIG"
  "$kubectl" kustomize deploy/k8s >"$work/k8s.yaml" 2>"$work/kubectl.log"
  expect "kubectl kustomize deploy/k8s (Debian's kubectl $("$kubectl" version --client --short 2>/dev/null | awk '{print $3}'))" \
    test -s "$work/k8s.yaml"
  expect "the manifests name the image and probe the containers test: te_server image, grpc probes on 50051" \
    bash -c "grep -q 'image: .*te_server:' '$work/k8s.yaml' && grep -A2 'readinessProbe:' '$work/k8s.yaml' | grep -q grpc"
  if "$kubectl" apply --dry-run=client --validate=false -f "$work/k8s.yaml" >"$work/dry.log" 2>&1; then
    pass "kubectl apply --dry-run=client: $(grep -c 'created\|configured' "$work/dry.log") objects"
  else
    echo "container_test: kubectl apply --dry-run=client needs an API server here: $(tail -n 1 "$work/dry.log")"
  fi
else
  echo "container_test: Debian's kubernetes-client could not be fetched; manifests not checked by kubectl"
fi
stage "kubectl"

[ -s "$work/failover.json" ] && echo "container_test: failover: $(cat "$work/failover.json" | tr -d '\n ')"
finish
