#!/usr/bin/env bash
# Does the bundle run on a machine that has nothing but a minimal Debian?
#
# NOT run by CI: it needs root (debootstrap, chroot, mount), the Debian mirror
# (the first run downloads a minbase root, about 2 minutes), and it builds the
# bundle (minutes when Bazel's cache is cold). Run it by hand, as root:
#
#   tests/deploy/debootstrap_check.sh
#
# What it does:
#  1. deploy/bundle.sh with te_server, health_probe and quickstart;
#  2. a Debian 12 minbase root from debootstrap, cached in
#     $TE_DEBOOTSTRAP_CACHE (default /var/cache/te_debootstrap/bookworm) and
#     reused; every run works on a fresh copy of it, so the cache stays clean;
#  3. the bundle copied to /opt/te_server in the copy; inside `chroot`, with
#     /proc and a minimal /dev: `ldd` of each program through run.sh's library
#     path must find everything but CUDA's own libraries (bundle.sh leaves those
#     to the GPU host by design). Those few are then bind-mounted, read-only,
#     from this machine's CUDA toolkit, standing in for the GPU host's;
#  4. te_server via run.sh on the CPU, health_probe must say SERVING (server
#     and te.v1.TeService), the quickstart must run through it, and SIGTERM
#     must stop it with exit code 0.
# Prints a PASS or FAIL line per check and the time taken; exits non-zero on
# the first failure.
#
# Environment: TE_DEBOOTSTRAP_CACHE (the cached root), TE_DEBIAN_MIRROR
# (default: the bookworm mirror in this machine's apt sources),
# TE_CHECK_KEEP=1 (keep the work folder for inspection),
# TE_QUICKSTART_ARGS (default "--config=small --iters=3 --warmup=1"),
# TE_CHECK_BUNDLE=FOLDER (check a bundle already made instead of building one),
# TE_CHECK_DROP_LIB=NAME (delete that library from the copy in the root: the
# check must then FAIL, which shows it can).
set -euo pipefail
cd "$(dirname "$0")/../.."

started=$(date +%s)
cache="${TE_DEBOOTSTRAP_CACHE:-/var/cache/te_debootstrap/bookworm}"
quickstart_args="${TE_QUICKSTART_ARGS:---config=small --iters=3 --warmup=1}"
bundle_targets="//server:te_server //deploy:health_probe //client:quickstart"
programs=(te_server health_probe quickstart)
# Inside the root: where the bundle goes, and where the CUDA stand-ins go.
bundle_in_root=/opt/te_server
cuda_in_root=/opt/host_cuda/lib
# What bundle.sh leaves to the GPU host besides glibc and the C++ runtime
# (its system_lib pattern, the CUDA part).
cuda_lib='^(libcuda\.|libcudart|libcublas|libcudnn|libnvrtc|libnvJitLink|libnvidia)'

elapsed() { echo "$(($(date +%s) - started)) s"; }
pass() { echo "PASS: $* [$(elapsed)]"; }
fail() {
  echo "FAIL: $* [$(elapsed)]"
  echo "debootstrap_check: FAIL after $(elapsed)"
  exit 1
}

[ "$(id -u)" -eq 0 ] || fail "must run as root (debootstrap, chroot and mount need it)"
for tool in debootstrap chroot mount umount mountpoint; do
  command -v "$tool" >/dev/null || fail "$tool not found (apt-get install -y debootstrap)"
done

work="$(mktemp -d /tmp/te_debootstrap_check.XXXXXX)"
root="$work/root"
server_pid=""
mounts=()  # mounted by us, in order; unmounted in reverse
partial=""  # a half-made cache folder, removed if we stop before it is done

cleanup() {
  local rc=$?
  if [ -n "$server_pid" ] && kill -0 "$server_pid" 2>/dev/null; then
    kill -KILL "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  # Anything else still running inside our root was started by this script.
  local proc
  for proc in /proc/[0-9]*; do
    if [ "$(readlink "$proc/root" 2>/dev/null)" = "$root" ]; then
      kill -KILL "${proc#/proc/}" 2>/dev/null || true
    fi
  done
  local i
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do
    umount "${mounts[i]}" 2>/dev/null || umount -l "${mounts[i]}" 2>/dev/null ||
      echo "debootstrap_check: could not unmount ${mounts[i]}" >&2
  done
  [ -n "$partial" ] && rm -rf --one-file-system "$partial"
  # Never delete through a mount that is still there (a bind of the host's files).
  if grep -q " $work/" /proc/mounts; then
    echo "debootstrap_check: mounts remain under $work; not removing it" >&2
  elif [ "${TE_CHECK_KEEP:-0}" = 1 ]; then
    echo "debootstrap_check: kept $work" >&2
  else
    rm -rf --one-file-system "$work"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# --- 1. The bundle -----------------------------------------------------------
if [ -n "${TE_CHECK_BUNDLE:-}" ]; then
  bundle="$TE_CHECK_BUNDLE"
  echo "made earlier: $bundle" >"$work/bundle.log"
else
  bundle="$work/bundle"
  if ! BUNDLE_TARGETS="$bundle_targets" deploy/bundle.sh "$bundle" >"$work/bundle.log" 2>&1; then
    tail -n 30 "$work/bundle.log"
    fail "deploy/bundle.sh failed (log above)"
  fi
fi
for program in "${programs[@]}"; do
  [ -x "$bundle/$program" ] || { tail -n 30 "$work/bundle.log"; fail "bundle lacks $program (log above)"; }
done
pass "bundle ${TE_CHECK_BUNDLE:+$bundle }ready: $(grep -c '\.so' <(ls "$bundle")) libraries, $(du -sm "$bundle" | cut -f1) MiB"

# --- 2. The minimal Debian root -----------------------------------------------
# The mirror this machine's apt uses for bookworm (deb822 .sources or one-line
# .list files), so the check needs no more network than apt-get does.
find_mirror() {
  local files=(/etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources)
  local f
  for f in "${files[@]}"; do
    [ -r "$f" ] || continue
    if [[ "$f" == *.sources ]]; then
      awk 'BEGIN { RS = ""; FS = "\n" }
           { uris = ""; suites = ""; deb = 0
             for (i = 1; i <= NF; i++) {
               if ($i ~ /^URIs:/) { uris = $i; sub(/^URIs:[ \t]*/, "", uris) }
               if ($i ~ /^Suites:/) { suites = " " $i " " }
               if ($i ~ /^Types:.*(^|[ \t])deb([ \t]|$)/) deb = 1
             }
             if (deb && suites ~ /[ \t]bookworm[ \t]/) { split(uris, u, /[ \t]+/); print u[1]; exit } }' "$f"
    else
      # deb [options] URI SUITE COMPONENTS...
      awk '$1 == "deb" { i = 2
                         if ($i ~ /^\[/) { while ($i !~ /\]$/ && i < NF) i++; i++ }
                         if ($(i + 1) == "bookworm") { print $i; exit } }' "$f"
    fi
  done | head -n 1
}

if [ -f "$cache/.te_debootstrap_done" ]; then
  pass "minimal Debian 12 root reused from $cache ($(cat "$cache/.te_debootstrap_done"))"
else
  mirror="${TE_DEBIAN_MIRROR:-$(find_mirror)}"
  [ -n "$mirror" ] || fail "no bookworm mirror in /etc/apt/sources*; set TE_DEBIAN_MIRROR"
  mkdir -p "$(dirname "$cache")"
  partial="$cache.partial.$$"
  echo "debootstrap_check: debootstrap --variant=minbase bookworm from $mirror (a few minutes)"
  if ! debootstrap --variant=minbase bookworm "$partial" "$mirror" >"$work/debootstrap.log" 2>&1; then
    tail -n 30 "$work/debootstrap.log"
    fail "debootstrap failed (log above)"
  fi
  echo "minbase bookworm from $mirror, made $(date -u +%Y-%m-%dT%H:%MZ)" >"$partial/.te_debootstrap_done"
  rm -rf --one-file-system "$cache"
  mv "$partial" "$cache"
  partial=""
  pass "minimal Debian 12 root made in $cache"
fi

# A fresh copy per run: what a run writes (the bundle, logs) never reaches the cache.
cp -a "$cache" "$root"
rm -f "$root/.te_debootstrap_done"
# minbase carries no GPU stack and no gRPC: proof that nothing leaks in from it.
if compgen -G "$root/usr/lib/x86_64-linux-gnu/libgrpc*" >/dev/null ||
   compgen -G "$root/usr/lib/x86_64-linux-gnu/libcuda*" >/dev/null; then
  fail "the cached root $cache is not minimal (it has gRPC or CUDA libraries): remove it"
fi
[ -e "$root/usr/lib/x86_64-linux-gnu/libstdc++.so.6" ] || fail "the root has no libstdc++.so.6"
mkdir -p "$root$bundle_in_root"
cp -a "$bundle/." "$root$bundle_in_root/"
if [ -n "${TE_CHECK_DROP_LIB:-}" ]; then
  rm -f "$root$bundle_in_root/$TE_CHECK_DROP_LIB"
  echo "debootstrap_check: deleted $TE_CHECK_DROP_LIB from the bundle's copy (TE_CHECK_DROP_LIB)"
fi

mount -t proc proc "$root/proc"
mounts+=("$root/proc")
# A /dev of its own with only the usual character devices, not the host's.
mount -t tmpfs -o mode=755,nosuid devtmp "$root/dev"
mounts+=("$root/dev")
mknod -m 666 "$root/dev/null" c 1 3
mknod -m 666 "$root/dev/zero" c 1 5
mknod -m 666 "$root/dev/full" c 1 7
mknod -m 666 "$root/dev/random" c 1 8
mknod -m 666 "$root/dev/urandom" c 1 9
mkdir -m 1777 "$root/dev/shm"
ln -s /proc/self/fd "$root/dev/fd"
ln -s /proc/self/fd/0 "$root/dev/stdin"
ln -s /proc/self/fd/1 "$root/dev/stdout"
ln -s /proc/self/fd/2 "$root/dev/stderr"
pass "bundle copied into a fresh copy of the root; /proc and a minimal /dev mounted"

# The environment inside the root: nothing of this machine's LD_LIBRARY_PATH
# or PATH; run.sh pointed at the CUDA stand-ins.
root_env=(PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
          TE_CUDA_LIB_DIR="$cuda_in_root" TE_CUDNN_DIR="$cuda_in_root")
in_root() { chroot "$root" /usr/bin/env -i "${root_env[@]}" "$@"; }
# ldd of a bundled program with run.sh's library path: "name => path" lines.
ldd_in_root() {
  # shellcheck disable=SC2016  # $1 is expanded by the bash inside the root
  in_root /bin/bash -c 'export LD_LIBRARY_PATH='"$bundle_in_root:$cuda_in_root"'; ldd "$1"' \
    ldd "$bundle_in_root/$1"
}

# --- 3. Every library resolves ------------------------------------------------
# First without any CUDA: only CUDA's own libraries may be missing.
cuda_needed=()
for program in "${programs[@]}"; do
  missing=$(ldd_in_root "$program" | awk '/not found/ {print $1}' | sort -u)
  for lib in $missing; do
    [[ "$lib" =~ $cuda_lib ]] || fail "$program needs $lib: neither the bundle nor minimal Debian has it"
    [[ " ${cuda_needed[*]-} " == *" $lib "* ]] || cuda_needed+=("$lib")
  done
done
pass "in the bare root every library of ${programs[*]} resolves but CUDA's own: ${cuda_needed[*]:-none}"

# Then the CUDA libraries from this machine's toolkit, one bind mount each, as
# the GPU host (or the image's CUDA base) provides them.
if [ ${#cuda_needed[@]} -gt 0 ]; then
  mkdir -p "$root$cuda_in_root"
  for lib in "${cuda_needed[@]}"; do
    [ "$lib" != libcuda.so.1 ] || fail "a program links the driver (libcuda.so.1), which only a GPU host has"
    host_path=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
    for dir in "${TE_CUDA_LIB_DIR:-/usr/local/cuda/lib64}" /usr/local/cuda/lib64; do
      [ -n "$host_path" ] || { [ -e "$dir/$lib" ] && host_path="$dir/$lib"; }
    done
    [ -n "$host_path" ] || fail "$lib is not on this machine to stand in for the GPU host's"
    touch "$root$cuda_in_root/$lib"
    mount --bind "$(readlink -f "$host_path")" "$root$cuda_in_root/$lib"
    mounts+=("$root$cuda_in_root/$lib")
    mount -o remount,bind,ro "$root$cuda_in_root/$lib"
  done
fi
for program in "${programs[@]}"; do
  resolved=$(ldd_in_root "$program")
  if grep -q 'not found' <<<"$resolved"; then
    echo "$resolved"
    fail "$program still has unresolved libraries"
  fi
  from_bundle=$(grep -c " => $bundle_in_root/" <<<"$resolved" || true)
  from_cuda=$(grep -c " => $cuda_in_root/" <<<"$resolved" || true)
  from_debian=$(grep -cE " => /(usr/)?lib" <<<"$resolved" || true)
  pass "$program: every library resolves ($from_bundle from the bundle, $from_debian from minimal Debian, $from_cuda CUDA stand-ins)"
done

# --- 4. Serve, probe, run the quickstart, stop ----------------------------------
port_file_in_root=/tmp/te_server.port
server_log="$work/te_server.log"
# chroot directly, not through in_root: a function put in the background runs
# in a forked shell, and $! would be that shell instead of the server.
chroot "$root" /usr/bin/env -i "${root_env[@]}" "$bundle_in_root/run.sh" te_server \
  --device=cpu --host=127.0.0.1 --port=0 --port_file="$port_file_in_root" >"$server_log" 2>&1 &
server_pid=$!
for _ in $(seq 300); do
  [ -s "$root$port_file_in_root" ] && break
  kill -0 "$server_pid" 2>/dev/null || { tail -n 30 "$server_log"; fail "te_server exited during start (log above)"; }
  sleep 0.1
done
[ -s "$root$port_file_in_root" ] || { tail -n 30 "$server_log"; fail "te_server wrote no port file in 30 s"; }
port=$(cat "$root$port_file_in_root")
# chroot, env and run.sh all exec: the pid we hold is te_server itself, so
# SIGTERM below reaches the server and not a wrapper.
[ "$(cat "/proc/$server_pid/comm")" = te_server ] ||
  fail "pid $server_pid is $(cat "/proc/$server_pid/comm"), not te_server"
pass "te_server (CPU) listening on 127.0.0.1:$port inside the root"

for service in "" te.v1.TeService; do
  if ! probe=$(in_root "$bundle_in_root/run.sh" health_probe --address="127.0.0.1:$port" \
                 --service="$service" 2>&1); then
    echo "$probe"
    fail "health_probe${service:+ --service=$service} did not get SERVING"
  fi
  pass "health_probe${service:+ --service=$service}: ${probe#health_probe: }"
done

quickstart_log="$work/quickstart.log"
# shellcheck disable=SC2086  # the arguments are meant to split
if ! in_root "$bundle_in_root/run.sh" quickstart --server="127.0.0.1:$port" $quickstart_args \
     >"$quickstart_log" 2>&1; then
  tail -n 30 "$quickstart_log"
  fail "quickstart $quickstart_args failed (log above)"
fi
# The variants' headings and timings; the whole log only on failure.
grep -E '^(== |Mean time|Total wall time)' "$quickstart_log" | sed 's/^/  quickstart| /'
pass "quickstart $quickstart_args ran through te_server"

kill -TERM "$server_pid"
# The server drains for up to 10 s; past 30 s it is hung.
( sleep 30; kill -KILL "$server_pid" 2>/dev/null ) &
watchdog=$!
server_rc=0
wait "$server_pid" || server_rc=$?
kill "$watchdog" 2>/dev/null || true
wait "$watchdog" 2>/dev/null || true
server_pid=""
if [ "$server_rc" -ne 0 ]; then
  tail -n 30 "$server_log"
  fail "te_server exited with $server_rc after SIGTERM (137: hung, killed after 30 s)"
fi
pass "te_server stopped by SIGTERM with exit code 0"

echo "debootstrap_check: PASS in $(elapsed)"
