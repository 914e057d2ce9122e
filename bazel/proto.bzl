"""cc_grpc_proto: protoc + grpc_cpp_plugin (Debian's) into a cc_library."""

def cc_grpc_proto(name, srcs, imports = [], deps = []):
    """`imports`: .proto files `srcs` import (read, not generated); `deps`: their cc_grpc_proto."""
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_protoc",
        srcs = srcs + imports,
        outs = outs,
        cmd = " ".join([
            "/usr/bin/protoc",
            "--proto_path=proto",
            "--cpp_out=$(GENDIR)/proto",
            "--grpc_out=$(GENDIR)/proto",
            "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin",
        ] + ["$(location %s)" % s for s in srcs]),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = ["."],
        deps = ["@system//:grpc", "@system//:protobuf"] + deps,
    )
