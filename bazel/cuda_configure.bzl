"""Finds the CUDA toolkit at build time; without it the build is CPU-only."""

def _cuda_configure_impl(ctx):
    cuda_path = ctx.os.environ.get("CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(cuda_path + "/bin/nvcc")
    available = nvcc.exists and ctx.os.environ.get("TE_DISABLE_CUDA", "") != "1"
    ctx.file("defs.bzl", "CUDA_AVAILABLE = %s\nCUDA_PATH = \"%s\"\n" % (available, cuda_path))
    if available:
        ctx.symlink(cuda_path + "/include", "include")
        build = """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "cuda",
    # Every file under include/, not only *.h: cuda_fp16.h includes <nv/target>
    # and CCCL's headers have no extension, and a sandboxed compile sees only
    # the headers declared here.
    hdrs = glob(["include/**"]),
    includes = ["include"],
    linkopts = [
        "-L%s/lib64",
        "-Wl,-rpath,%s/lib64",
        "-lcudart",
        "-lcublasLt",
        "-lcudnn",
        "-ldl",
        "-lrt",
    ],
)
""" % (cuda_path, cuda_path)
    else:
        build = """
package(default_visibility = ["//visibility:public"])
cc_library(name = "cuda")
"""
    ctx.file("BUILD", build)

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_PATH", "TE_DISABLE_CUDA"],
    local = True,
)
