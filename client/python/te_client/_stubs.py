"""The generated te.v1 protobuf and gRPC modules, as the package te_client._proto.

Generated code is never committed. It is made by whichever compiler this
machine has that understands proto3 `optional`:
  1. protoc with the gRPC Python plugin (Debian: protobuf-compiler 3.21 and
     protobuf-compiler-grpc);
  2. grpc_tools.protoc from a grpcio-tools wheel (Debian's 1.14 bundles protoc
     3.5, which rejects `optional`, and is skipped).
Its `from te.v1 import x_pb2` lines are made relative, so the modules form one
package that can live anywhere and never shadows (or is shadowed by) another
`te` on sys.path.

Where load() finds them, first match wins:
  1. $TE_CLIENT_STUBS_DIR, when set (generated there if missing, or if the
     protos of the checkout it was made from have changed since);
  2. te_client/_proto inside an installed package (`pip install client/python`
     writes it at build time; see setup.py);
  3. a checkout without installing: generated from ../../proto into a cache
     folder named by the protos' hash ($XDG_CACHE_HOME/te_client or
     ~/.cache/te_client), or a temporary folder where no cache is writable.
Nothing is ever written into the source tree at import.

    python3 client/python/te_client/_stubs.py --out DIR   # generate into DIR
"""
import atexit
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
_PYTHON_ROOT = os.path.dirname(_HERE)                            # client/python
PACKAGE = "te_client._proto"
_PROTOS = ["te/v1/tensor.proto", "te/v1/recipe.proto", "te/v1/layers.proto", "te/v1/service.proto"]
_MODULES = ["tensor_pb2", "recipe_pb2", "layers_pb2", "service_pb2", "service_pb2_grpc"]
_STAMP = "protos.sha256"    # the hash of the protos the folder's modules were made from


def proto_roots(python_root=_PYTHON_ROOT):
    """Folders that may hold te/v1/*.proto, best first: $TE_PROTO_DIR, a copy
    next to the package (an sdist's proto/), the checkout's proto/."""
    roots = [os.environ.get("TE_PROTO_DIR"), os.path.join(python_root, "proto"),
             os.path.join(python_root, "..", "..", "proto")]
    return [os.path.normpath(r) for r in roots if r]


def find_protos(python_root=_PYTHON_ROOT):
    """The first of proto_roots() that holds every te.v1 proto, or None."""
    for root in proto_roots(python_root):
        if all(os.path.isfile(os.path.join(root, p)) for p in _PROTOS):
            return root
    return None


def protos_hash(proto_root):
    digest = hashlib.sha256()
    for p in _PROTOS:
        with open(os.path.join(proto_root, p), "rb") as f:
            digest.update(p.encode() + b"\0" + f.read() + b"\0")
    return digest.hexdigest()


def _compilers():
    """Command prefixes that can compile the protos, best first."""
    plugin = shutil.which("grpc_python_plugin")
    protoc = shutil.which("protoc")
    if protoc and plugin:
        yield [protoc, "--plugin=protoc-gen-grpc_python=" + plugin]
    yield [sys.executable, "-m", "grpc_tools.protoc"]


def _make_relative(folder):
    """Turns the compiler's te/v1 tree into one flat package with relative imports."""
    generated = os.path.join(folder, "te", "v1")
    for module in _MODULES:
        with open(os.path.join(generated, module + ".py")) as f:
            text = f.read()
        text = re.sub(r"^from te\.v1 import (\w+)", r"from . import \1", text, flags=re.M)
        # The message classes' __module__: this module's real name, not te.v1's.
        text = re.sub(r"'te\.v1\.\w+_pb2'", "__name__", text)
        with open(os.path.join(folder, module + ".py"), "w") as f:
            f.write(text)
    shutil.rmtree(os.path.join(folder, "te"))
    with open(os.path.join(folder, "__init__.py"), "w") as f:
        f.write('"""te.v1\'s generated protobuf and gRPC modules (te_client/_stubs.py made them)."""\n')


def generate(out_dir, proto_root=None):
    """Writes the package (__init__.py, *_pb2.py, service_pb2_grpc.py) into
    out_dir, replacing what was there at once (a reader never sees half of it).
    ImportError when no protos or no compiler are found."""
    proto_root = proto_root or find_protos()
    if proto_root is None or not os.path.isfile(os.path.join(proto_root, _PROTOS[-1])):
        raise ImportError("te_client: no generated te.v1 stubs and no protos (looked in %s; set "
                          "TE_PROTO_DIR to the folder holding te/v1/*.proto)" % ", ".join(proto_roots()))
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
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
            _make_relative(tmp)
            with open(os.path.join(tmp, _STAMP), "w") as f:
                f.write(protos_hash(proto_root) + "\n")
            shutil.rmtree(out_dir, ignore_errors=True)
            os.replace(tmp, out_dir)
            return out_dir
        if run is not None:
            errors.append("%s: %s" % (" ".join(compiler[:3]), run.stderr.strip().splitlines()[-1:]))
        shutil.rmtree(tmp, ignore_errors=True)
    raise ImportError("te_client: could not generate the te.v1 stubs (they need protoc >= 3.15 with "
                      "grpc_python_plugin, Debian's protobuf-compiler and protobuf-compiler-grpc, or a "
                      "grpcio-tools that bundles one); tried:\n  " + "\n  ".join(errors))


def _complete(folder):
    return all(os.path.isfile(os.path.join(folder, m + ".py")) for m in _MODULES + ["__init__"])


def _stamp(folder):
    try:
        with open(os.path.join(folder, _STAMP)) as f:
            return f.read().strip()
    except OSError:
        return None


def _cache_dir(digest):
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "te_client", "stubs-" + digest[:16])


def _from_checkout(proto_root):
    """A stubs folder for the checkout's protos: the cache's, made if needed;
    where no cache folder can be written, a temporary one removed at exit."""
    cached = _cache_dir(protos_hash(proto_root))
    if _complete(cached):
        return cached
    try:
        return generate(cached, proto_root)
    except OSError:
        tmp = tempfile.mkdtemp(prefix="te_client_stubs-")
        atexit.register(shutil.rmtree, tmp, True)
        return generate(os.path.join(tmp, "proto"), proto_root)


def stubs_dir():
    """The folder load() takes the stubs from; None for the installed package's own."""
    configured = os.environ.get("TE_CLIENT_STUBS_DIR")
    if configured:
        proto_root = find_protos()
        if not _complete(configured) or (proto_root and _stamp(configured) != protos_hash(proto_root)):
            generate(configured, proto_root)
        return configured
    if _complete(os.path.join(_HERE, "_proto")):
        return None
    proto_root = find_protos()
    if proto_root is None:
        raise ImportError("te_client: this copy has no generated te.v1 stubs (install it with pip, which "
                          "generates them) and no protos to generate them from (looked in %s; set "
                          "TE_PROTO_DIR)" % ", ".join(proto_roots()))
    return _from_checkout(proto_root)


def load():
    """Returns (tensor_pb2, recipe_pb2, layers_pb2, service_pb2, service_pb2_grpc)."""
    if PACKAGE not in sys.modules:
        folder = stubs_dir()
        if folder is not None:
            # The folder is imported as te_client._proto wherever it lies.
            spec = importlib.util.spec_from_file_location(PACKAGE, os.path.join(folder, "__init__.py"),
                                                          submodule_search_locations=[folder])
            package = importlib.util.module_from_spec(spec)
            sys.modules[PACKAGE] = package
            try:
                spec.loader.exec_module(package)
            except BaseException:
                del sys.modules[PACKAGE]
                raise
    from te_client._proto import layers_pb2, recipe_pb2, service_pb2, service_pb2_grpc, tensor_pb2
    return tensor_pb2, recipe_pb2, layers_pb2, service_pb2, service_pb2_grpc


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("TE_CLIENT_STUBS_DIR"), required=
                        not os.environ.get("TE_CLIENT_STUBS_DIR"))
    parser.add_argument("--protos", default=None, help="the folder holding te/v1/*.proto")
    args = parser.parse_args()
    print(generate(args.out, args.protos))
