#!/usr/bin/env bash
# Installs every system package the build, the tests and the tools need, from
# Debian 12's archive (run as root). Safe to run again.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
packages=(
  bazel-bootstrap bazel-platforms bazel-skylib
  g++ git ca-certificates
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libgtest-dev libgmock-dev libbenchmark-dev
  libeigen3-dev libopenblas-dev
  libjemalloc-dev  # te_server's malloc (third_party/system.BUILD)
  nlohmann-json3-dev libcpp-httplib-dev openssl libssl-dev python3-yaml
  prometheus-cpp-dev prometheus  # te_server's metrics; promtool and a real Prometheus for its tests
  clang-14 libclang-rt-14-dev
  python3 python3-grpcio python3-grpc-tools python3-protobuf python3-numpy python3-pytest
  python3-venv python3-pip python3-setuptools python3-wheel
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "install_deps: installing ${missing[*]}" >&2
  apt-get update -q
  apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "install_deps: all ${#packages[@]} packages present" >&2
fi
