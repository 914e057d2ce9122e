#!/usr/bin/env bash
# Runs te_client's pytest suite against a real te_server, which must already
# be built (bazel build //server:te_server; the tests start
# bazel-bin/server/te_server on a loopback port, or $TE_SERVER_BIN).
#
#   client/python/run_tests.sh [JUNIT_XML]     # default /tmp/te_python_junit.xml
#
# First it generates the te.v1 Python stubs from proto/te/v1 into
# client/python/build/proto (git-ignored; $TE_CLIENT_STUBS_DIR overrides) with
# Debian's protoc 3.21 and grpc_python_plugin, so the tests import the checkout
# without installing it. (Debian's python3-grpc-tools bundles protoc 3.5, which
# rejects proto3 `optional`; _stubs.py falls back to grpc_tools.protoc only
# where a newer one is installed.) tests/test_package.py installs the package
# itself into a temporary venv (python3-venv, python3-pip: deploy/install_deps.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
junit="${1:-/tmp/te_python_junit.xml}"
export TE_CLIENT_STUBS_DIR="${TE_CLIENT_STUBS_DIR:-$PWD/client/python/build/proto}"

# The Python that has Debian's grpcio / protobuf / numpy / pytest (a pyenv or
# venv python3 earlier on PATH may lack them).
python="${PYTHON:-python3}"
needs="import grpc, google.protobuf, numpy, pytest"
if ! "$python" -c "$needs" 2>/dev/null && /usr/bin/python3 -c "$needs" 2>/dev/null; then
  python=/usr/bin/python3
fi

"$python" client/python/te_client/_stubs.py --out "$TE_CLIENT_STUBS_DIR" >/dev/null
exec "$python" -m pytest -q -p no:cacheprovider client/python/tests --junitxml="$junit"
