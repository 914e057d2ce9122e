"""cuda_library: .cu files compiled by nvcc for sm_90a (+ PTX), wrapped in a cc_library."""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "CUDA_PATH")

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_90,code=compute_90",
    "-Xcompiler",
    "-fPIC",
    # As .bazelrc's copts: an unhandled enum case is an error in host code too.
    "-Xcompiler",
    "-Werror=switch",
    "--expt-relaxed-constexpr",
    "-lineinfo",
    # Compress SASS and PTX in the fatbin (~10x smaller): every binary carries
    # every kernel, and the GPU machine takes 64 MiB per call.
    "-Xfatbin=-compress-all",
]

def cuda_library(name, srcs, hdrs = [], deps = [], nvcc_hdrs = [], **kwargs):
    """Compiles each .cu in srcs with nvcc into an object linked into a cc_library.

    nvcc_hdrs: labels of headers outside this package that the .cu files
    include, so that editing them recompiles the objects.
    """
    objs = []
    for src in srcs:
        obj = name + "_" + src.replace("/", "_").replace(".cu", ".o")
        native.genrule(
            name = obj + "_nvcc",
            srcs = [src] + hdrs + nvcc_hdrs + [
                h
                for h in native.glob(["**/*.h", "**/*.cuh"])
                if h not in hdrs
            ],
            outs = [obj],
            cmd = "%s/bin/nvcc %s -I. -I$(GENDIR) -c $(location %s) -o $@" % (
                CUDA_PATH,
                " ".join(NVCC_FLAGS),
                src,
            ),
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["@local_cuda//:cuda"],
        **kwargs
    )

def if_cuda(if_true, if_false = []):
    return if_true if CUDA_AVAILABLE else if_false
