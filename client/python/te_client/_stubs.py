"""The generated te.v1 protobuf and gRPC modules: found, or generated on first use.

Generated code is never committed: it is written at build time (run_tests.sh
runs this file as a script) into a git-ignored folder, by whichever compiler
this machine has that understands proto3 `optional`:
  1. protoc with the gRPC Python plugin (Debian: protobuf-compiler 3.21 and
     protobuf-compiler-grpc);
  2. grpc_tools.protoc from a grpcio-tools wheel (Debian's 1.14 bundles protoc
     3.5, which rejects `optional`, and is skipped).
Where the stubs live: $TE_CLIENT_STUBS_DIR if set, else client/python/build/proto.

    python3 client/python/te_client/_stubs.py --out DIR   # generate into DIR
"""
import os
import shutil
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_PYTHON_ROOT = os.path.dirname(_HERE)                            # client/python
PROTO_ROOT = os.path.normpath(os.path.join(_PYTHON_ROOT, "..", "..", "proto"))
DEFAULT_DIR = os.path.join(_PYTHON_ROOT, "build", "proto")
_PROTOS = ["te/v1/tensor.proto", "te/v1/recipe.proto", "te/v1/layers.proto", "te/v1/service.proto"]
_MARKER = os.path.join("te", "v1", "service_pb2_grpc.py")


def _compilers():
    """Command prefixes that can compile the protos, best first."""
    plugin = shutil.which("grpc_python_plugin")
    protoc = shutil.which("protoc")
    if protoc and plugin:
        yield [protoc, "--plugin=protoc-gen-grpc_python=" + plugin]
    yield [sys.executable, "-m", "grpc_tools.protoc"]


def generate(out_dir, proto_root=PROTO_ROOT):
    """Writes te/v1/*_pb2.py and *_pb2_grpc.py under out_dir (atomically)."""
    if not os.path.isfile(os.path.join(proto_root, _PROTOS[-1])):
        raise ImportError("te_client: no generated stubs and no protos at %s" % proto_root)
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    errors = []
    for compiler in _compilers():
        tmp = tempfile.mkdtemp(prefix=".stubs-", dir=parent)
        cmd = compiler + ["-I" + proto_root, "--python_out=" + tmp, "--grpc_python_out=" + tmp] + [
            os.path.join(proto_root, p) for p in _PROTOS]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            run = None
            errors.append("%s: %s" % (compiler[0], e))
        if run is not None and run.returncode == 0:
            # Regular packages (not namespace ones), so no other `te` on sys.path can shadow them.
            for pkg in ("te", os.path.join("te", "v1")):
                open(os.path.join(tmp, pkg, "__init__.py"), "a").close()
            shutil.rmtree(out_dir, ignore_errors=True)
            os.replace(tmp, out_dir)
            return out_dir
        if run is not None:
            errors.append("%s: %s" % (" ".join(compiler[:3]), run.stderr.strip().splitlines()[-1:]))
        shutil.rmtree(tmp, ignore_errors=True)
    raise ImportError("te_client: could not generate the te.v1 stubs; tried:\n  " + "\n  ".join(errors))


def _stubs_dir():
    configured = os.environ.get("TE_CLIENT_STUBS_DIR")
    out_dir = configured or DEFAULT_DIR
    if not os.path.isfile(os.path.join(out_dir, _MARKER)):
        generate(out_dir)
    return out_dir


def load():
    """Returns (tensor_pb2, recipe_pb2, layers_pb2, service_pb2, service_pb2_grpc)."""
    out_dir = _stubs_dir()
    if out_dir not in sys.path:
        sys.path.insert(0, out_dir)
    from te.v1 import layers_pb2, recipe_pb2, service_pb2, service_pb2_grpc, tensor_pb2
    return tensor_pb2, recipe_pb2, layers_pb2, service_pb2, service_pb2_grpc


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("TE_CLIENT_STUBS_DIR", DEFAULT_DIR))
    print(generate(parser.parse_args().out))
