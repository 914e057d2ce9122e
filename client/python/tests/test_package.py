"""te_client as a package: pip install from a read-only copy into a venv, its sdist, and a checkout
imported without installing. None of them may write into the source they start from."""
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import PYTHON_ROOT, REPO_ROOT

# Debian's interpreter: its grpcio / protobuf / numpy are what a --system-site-packages venv sees.
SYSTEM_PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
PACKAGE_FILES = ("pyproject.toml", "setup.py", "README.md", "te_client")


def _grpc_tools_compiles():
    # Debian's grpcio-tools 1.14 bundles protoc 3.5, which rejects proto3 `optional`.
    run = subprocess.run([SYSTEM_PYTHON, "-m", "grpc_tools.protoc", "--version"], capture_output=True, text=True)
    return run.returncode == 0 and tuple(int(p) for p in re.findall(r"\d+", run.stdout)[:2]) >= (3, 15)


# Building the package generates the stubs: without a compiler (the GPU machine has protoc but no
# grpc_python_plugin) there is nothing to test here; deploy/install_deps.sh installs both.
pytestmark = pytest.mark.skipif(
    not (shutil.which("protoc") and shutil.which("grpc_python_plugin")) and not _grpc_tools_compiles(),
    reason="no protoc with grpc_python_plugin (protobuf-compiler-grpc) to build the package's stubs")


def _copy_sources(root):
    """client/python's package files and proto/te/v1, laid out as in a checkout under `root`, read-only."""
    python = os.path.join(root, "client", "python")
    os.makedirs(python)
    for name in PACKAGE_FILES:
        src = os.path.join(PYTHON_ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(python, name),
                            ignore=shutil.ignore_patterns("__pycache__", "_proto", "*.pyc"))
        else:
            shutil.copy2(src, python)
    shutil.copytree(os.path.join(REPO_ROOT, "proto", "te"), os.path.join(root, "proto", "te"))
    _set_writable(root, False)
    return python


def _set_writable(root, writable):
    for folder, dirs, files in os.walk(root):
        for path in [folder] + [os.path.join(folder, f) for f in files]:
            mode = os.stat(path).st_mode
            os.chmod(path, (mode | stat.S_IWUSR) if writable else (mode & ~0o222))


def _snapshot(root):
    """Every path under root with its size and mtime: root bypasses read-only modes, this does not."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return found


def _clean_env(home):
    """No checkout on the path, no stubs folder named, an empty home and cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TE_CLIENT_STUBS_DIR", "TE_PROTO_DIR", "PIP_REQUIRE_VIRTUALENV")}
    env.update(HOME=home, XDG_CACHE_HOME=os.path.join(home, ".cache"), PIP_NO_INPUT="1")
    os.makedirs(home, exist_ok=True)
    return env


def _run(cmd, env, cwd):
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, "%s failed (%d):\n%s\n%s" % (" ".join(cmd), done.returncode, done.stdout[-3000:],
                                                             done.stderr[-3000:])
    return done.stdout


# Imports the installed package, checks where it and its stubs come from, and runs a layer.
_SMOKE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import te_client as te
    from te_client import _stubs
    from te_client.flax.transformer import DotProductAttention
    from te_client.common.recipe import DelayedScaling
    layer = te.flax.DenseGeneral(features=8)
    x = np.ones((2, 3, 4), np.float32)
    with te.connect(sys.argv[1]) as client, client.session():
        params = layer.init(0, x)
        y = layer.apply(params, x)
    print(json.dumps({"file": te.__file__, "stubs_dir": _stubs.stubs_dir(), "proto": te.client.service_pb2.__name__,
                      "y_shape": list(y.shape), "kernel": list(params["params"]["kernel"].shape)}))
""")


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("venv") / "env")
    done = subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--system-site-packages", folder],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, ("python3 -m venv failed (Debian: apt-get install python3-venv, as "
                                  "deploy/install_deps.sh does):\n" + done.stderr[-2000:])
    return folder


def _installed_smoke(venv, home, server_address, cwd):
    out = _run([os.path.join(venv, "bin", "python"), "-c", _SMOKE, server_address], _clean_env(home), cwd)
    got = json.loads(out.strip().splitlines()[-1])
    assert got["file"].startswith(venv + os.sep), got     # the venv's copy, not the checkout's
    assert got["stubs_dir"] is None and got["proto"] == "te_client._proto.service_pb2"   # shipped stubs
    assert got["y_shape"] == [2, 3, 8] and got["kernel"] == [4, 8]
    assert not os.path.exists(os.path.join(home, ".cache", "te_client"))   # nothing generated at import


def test_pip_install_from_a_read_only_copy(tmp_path, venv, server_address):
    python = _copy_sources(str(tmp_path / "src"))
    before = _snapshot(str(tmp_path / "src"))
    home = str(tmp_path / "home")
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--no-build-isolation", "--no-index",
           "--force-reinstall", "--no-deps", python]
    _run(pip, _clean_env(home), str(tmp_path))
    assert _snapshot(str(tmp_path / "src")) == before
    _installed_smoke(venv, home, server_address, str(tmp_path))
    _set_writable(str(tmp_path / "src"), True)


def test_sdist_carries_the_protos_and_installs_alone(tmp_path, venv, server_address):
    python = _copy_sources(str(tmp_path / "src"))
    before = _snapshot(str(tmp_path / "src"))
    home, dist = str(tmp_path / "home"), str(tmp_path / "dist")
    _run([SYSTEM_PYTHON, "setup.py", "-q", "sdist", "-d", dist], _clean_env(home), python)
    assert _snapshot(str(tmp_path / "src")) == before
    (archive,) = os.listdir(dist)
    listing = subprocess.run(["tar", "tzf", os.path.join(dist, archive)], capture_output=True, text=True).stdout
    assert "/proto/te/v1/service.proto" in listing and "/te_client/flax/transformer.py" in listing
    # Installed from the archive alone: no checkout around it to find protos in.
    _run([os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--no-build-isolation", "--no-index",
          "--force-reinstall", "--no-deps", os.path.join(dist, archive)], _clean_env(home), dist)
    _installed_smoke(venv, home, server_address, dist)
    _set_writable(str(tmp_path / "src"), True)


def _checkout_import(python, env, cwd):
    env = dict(env, PYTHONPATH=python)
    code = "import te_client, te_client._stubs as s; print(s.stubs_dir()); print(te_client.client.service_pb2.__file__)"
    return _run([SYSTEM_PYTHON, "-c", code], env, cwd).split()


def test_a_checkout_imports_without_installing_and_writes_only_to_the_cache(tmp_path):
    python = _copy_sources(str(tmp_path / "src"))
    before = _snapshot(str(tmp_path / "src"))
    env = _clean_env(str(tmp_path / "home"))
    stubs_dir, service = _checkout_import(python, env, str(tmp_path))
    assert _snapshot(str(tmp_path / "src")) == before
    cache = os.path.join(env["XDG_CACHE_HOME"], "te_client")
    assert stubs_dir.startswith(cache + os.sep) and service.startswith(stubs_dir)
    # Where no cache can be written, a temporary folder, gone when the process ends.
    blocked = dict(env, XDG_CACHE_HOME=os.path.join(python, "setup.py"))   # a file: no folder can be made in it
    stubs_dir, service = _checkout_import(python, blocked, str(tmp_path))
    assert not stubs_dir.startswith(python) and not os.path.exists(stubs_dir)
    assert _snapshot(str(tmp_path / "src")) == before
    _set_writable(str(tmp_path / "src"), True)


def test_a_named_stubs_folder_is_remade_when_the_protos_change(tmp_path, monkeypatch):
    from te_client import _stubs
    folder = str(tmp_path / "stubs")
    _stubs.generate(folder)
    with open(os.path.join(folder, "protos.sha256"), "w") as f:
        f.write("made from other protos\n")
    monkeypatch.setenv("TE_CLIENT_STUBS_DIR", folder)
    assert _stubs.stubs_dir() == folder
    with open(os.path.join(folder, "protos.sha256")) as f:
        assert f.read().strip() == _stubs.protos_hash(_stubs.find_protos())
    with open(os.path.join(folder, "service_pb2_grpc.py")) as f:
        text = f.read()
    assert "from . import service_pb2" in text and "te.v1 import" not in text
