"""Builds te_client with its generated te.v1 stubs inside (pyproject.toml holds the metadata).

The stubs are made from proto/te/v1 at build time, by te_client/_stubs.py
(protoc 3.21 with grpc_python_plugin, or grpc_tools.protoc where it is new
enough), into the built package as te_client/_proto. The protos are found in
$TE_PROTO_DIR, in a proto/ folder next to this file (an sdist carries one),
or in the checkout's ../../proto.

The build writes nothing next to this file: setuptools' build/ and
egg-info folders go to a temporary folder, so a read-only source (a copy on
a read-only mount, a checkout another user owns) builds as well.
"""
import atexit
import importlib.util
import os
import shutil
import tempfile

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = os.path.dirname(os.path.abspath(__file__))


def _stubs_tool():
    """te_client/_stubs.py on its own: the package's __init__ needs the stubs it makes."""
    spec = importlib.util.spec_from_file_location("_te_client_stubs", os.path.join(HERE, "te_client", "_stubs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _protos(stubs):
    root = stubs.find_protos(HERE)
    if root is None:
        raise SystemExit("te_client: no te/v1/*.proto in %s; build from a checkout or set TE_PROTO_DIR"
                         % ", ".join(stubs.proto_roots(HERE)))
    return root


class BuildPyWithStubs(build_py):
    """build_py, then the te.v1 stubs generated into the built package."""

    def run(self):
        super().run()
        if not self.dry_run:
            stubs = _stubs_tool()
            stubs.generate(os.path.join(self.build_lib, "te_client", "_proto"), _protos(stubs))


_scratch = tempfile.mkdtemp(prefix="te_client_build-")
atexit.register(shutil.rmtree, _scratch, True)


class SdistWithProtos(sdist):
    """An sdist that builds on its own: the protos travel in it as proto/te/v1.
    Its tree is laid out in the scratch folder, not next to this file."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        root = _protos(_stubs_tool())
        shutil.copytree(os.path.join(root, "te", "v1"), os.path.join(base_dir, "proto", "te", "v1"),
                        dirs_exist_ok=True)

    def make_distribution(self):
        name = self.distribution.get_fullname()
        root = tempfile.mkdtemp(dir=_scratch)
        self.make_release_tree(os.path.join(root, name), self.filelist.files)
        os.makedirs(self.dist_dir, exist_ok=True)
        self.archive_files = []
        for fmt in self.formats:
            archive = self.make_archive(os.path.join(os.path.abspath(self.dist_dir), name), fmt, root_dir=root,
                                        base_dir=name, owner=self.owner, group=self.group)
            self.archive_files.append(archive)
            self.distribution.dist_files.append(("sdist", "", archive))


setup(packages=find_packages(include=["te_client", "te_client.*"]),
      cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos},
      options={"build": {"build_base": os.path.join(_scratch, "build")},
               "egg_info": {"egg_base": _scratch}})
