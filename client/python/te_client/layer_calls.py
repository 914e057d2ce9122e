"""The calls of one server layer (a TE module, or a composite's graph): InitLayer,
Forward, and a value_and_grad step, for module.py's init / apply / value_and_grad."""
import dataclasses

import grpc
import numpy as np

from te_client import dtypes, errors, precision as precision_lib, recipe as recipe_lib
from te_client import variables as variables_lib
from te_client._pb import recipe_pb2, service_pb2, tensor_pb2
from te_client.session import ResidentTensor



@dataclasses.dataclass(frozen=True)
class Call:
    """What one call of a server layer sends: x, extra inputs, mask, deterministic,
    and whether it is TE's decode=True (one autoregressive step on the cache)."""
    x: object
    extra: list
    mask: object
    deterministic: bool
    decode: bool = False




def shape_and_wire(x, field):
    if isinstance(x, ResidentTensor):
        return tuple(x.shape), x.wire_dtype
    x = dtypes.as_numpy(x)
    return tuple(int(d) for d in x.shape), dtypes.wire_dtype(x, field)


def _nbytes(x):
    if isinstance(x, ResidentTensor):
        return int(np.prod(x.shape, dtype=np.int64)) * dtypes.ITEMSIZE[x.wire_dtype]
    return dtypes.as_numpy(x).nbytes


def autocast():
    return _autocast()


def _autocast():
    return recipe_lib.autocast_proto(recipe_lib.current_autocast(), recipe_pb2)


def graph_unknown(e):
    """Whether the server's InitLayer answer means it predates te.v1 GraphSpec."""
    if isinstance(e, errors.UnimplementedError):
        return "graph" in e.message
    return isinstance(e, errors.InvalidArgumentError) and "no module set" in e.message and "graph" not in e.message


_WIRES = {name: wire for wire, name in dtypes.NAMES.items()}


def extra_input_headers(traced):
    """InitLayer / AddGraph's extra_inputs for graph `traced`: the dtype and
    shape (beside the traced x) of each extra input the server will take,
    extra_inputs[0] up to the highest one the graph reads. Declared, an extra
    input may have any dtype (int32 labels beside a float x); the server
    checks each call's against it, leading dims that are x's following x's."""
    if traced is None:
        return ()
    read = [int(n[len("extra_inputs["):-1]) for n in traced.inputs if n.startswith("extra_inputs[")]
    headers = []
    for i in range(1 + max(read, default=-1)):
        name = "extra_inputs[%d]" % i
        headers.append(tensor_pb2.TensorHeader(dtype=_WIRES[traced.dtypes[name]], shape=list(traced.shapes[name])))
    return tuple(headers)


def init_layer(session, spec, seed, x, module, traced, trace_key, decode=False):
    """InitLayer; with `decode` (TE's init(..., decode=True)) the layer's
    attentions that decode also get their cache collection for x's batch and length."""
    shape, wire = shape_and_wire(x, "x")
    request = service_pb2.InitLayerRequest(spec=spec, seed=seed, input_dtype=wire, input_shape=shape,
                                           autocast=_autocast(), extra_inputs=extra_input_headers(traced),
                                           decode=bool(decode))
    try:
        response = session.call("InitLayer", request)
    except errors.TeError as e:
        if traced is not None and graph_unknown(e):
            raise errors.UnimplementedError(
                "%s: this te_server does not run composite graphs (spec.graph, te.v1.GraphSpec); it "
                "answered %s" % (type(module).__name__, e)) from e
        raise
    infos = [variables_lib.VariableInfo(v.collection, v.path, tuple(v.shape), v.dtype) for v in response.variables]
    return variables_lib.LayerHandle(session, response.layer_id, (), infos, tuple(response.output_shape),
                                     response.output_dtype, input_shape=shape, input_wire_dtype=wire,
                                     traced=traced, trace_key=trace_key, module_type=type(module))


def add_graph(handle, traced, x_shape, x_wire):
    """The layer's index of graph `traced` (AddGraph once per graph and input signature)."""
    extras = extra_input_headers(traced)
    key = (traced.spec.SerializeToString(deterministic=True), tuple(x_shape), x_wire,
           tuple(h.SerializeToString(deterministic=True) for h in extras))
    found = handle.graphs.get(key)
    if found is not None:
        return found
    if handle.traced is not None and x_shape == tuple(handle.input_shape) and x_wire == handle.input_wire_dtype \
            and traced.spec == handle.traced.spec and extras == extra_input_headers(handle.traced):
        found = variables_lib.GraphInfo(0, handle.traced, tuple(handle.output_shape), handle.output_wire_dtype)
    else:
        response = handle.session.call("AddGraph", service_pb2.AddGraphRequest(
            layer_id=handle.layer_id, graph=traced.spec, input_dtype=x_wire, input_shape=list(x_shape),
            extra_inputs=extras))
        found = variables_lib.GraphInfo(response.graph, traced, tuple(response.output_shape), response.output_dtype)
    handle.graphs[key] = found
    return found


def _mask_wire(mask):
    """An attention mask as the request carries it: bool, True = masked out.

    TE's modules take a mask of any dtype, any nonzero element masked out
    (TE's own tests pass uint8 0/1: tests/jax/test_layer.py); the wire has no
    uint8, and bool is the narrowest, so every array mask goes as `mask != 0`
    (a resident mask is sent as it is: the server reads nonzero the same way)."""
    if isinstance(mask, ResidentTensor):
        return mask
    array = np.asarray(mask)
    return array if array.dtype == np.bool_ else array != 0


def forward_request(handle, call, dropout_seed, uploads, keep_for_backward=False, update_fp8_metas=False,
                    graph=0, version=0, decode=False):
    session = handle.session
    request = service_pb2.ForwardRequest(
        layer_id=handle.layer_id, x=session.send(call.x, uploads, "x"),
        extra_inputs=[session.send(e, uploads, "extra_inputs[%d]" % i) for i, e in enumerate(call.extra)],
        deterministic=call.deterministic, dropout_seed=dropout_seed, autocast=_autocast(),
        keep_for_backward=keep_for_backward, keep_outputs=session.large(4 * _nbytes(call.x)),
        update_fp8_metas=update_fp8_metas, graph=int(graph), version=int(version),
        matmul_precision=precision_lib.current(), decode=bool(decode))
    if call.mask is not None:
        request.attention_mask.CopyFrom(session.send(_mask_wire(call.mask), uploads, "attention_mask"))
    return request


def _grads(session, grads):
    return {variables_lib.join("params", v.path): session.receive(v.value, "grads/" + v.path) for v in grads}


def step(handle, call, dy, dropout_seed, graph=None, version=0):
    """value_and_grad of one server layer: (value, {"params/...": grad}, [dx, d(extra inputs)...], new version)."""
    session = handle.session
    index = graph.index if graph is not None else 0
    dy = dtypes.cast_to_wire(dy, graph.output_wire if graph is not None else handle.output_wire_dtype)
    uploads = []
    try:
        if not call.extra:
            batch = service_pb2.MicroBatch(x=session.send(call.x, uploads, "x"), dy=session.send(dy, uploads, "dy"),
                                           dropout_seed=dropout_seed)
            if call.mask is not None:
                batch.attention_mask.CopyFrom(session.send(_mask_wire(call.mask), uploads, "attention_mask"))
            response = session.call("ForwardBackward", service_pb2.ForwardBackwardRequest(
                layer_id=handle.layer_id, micro_batches=[batch], deterministic=call.deterministic,
                autocast=_autocast(), return_dx=True, return_grads=True, graph=index, version=int(version),
                matmul_precision=precision_lib.current()))
            if len(response.values) != 1 or len(response.dx) != 1:
                raise errors.error(grpc.StatusCode.INTERNAL, "ForwardBackward answered %d values and %d dx "
                                   "for one micro-batch" % (len(response.values), len(response.dx)))
            return (response.values[0], _grads(session, response.grads), [session.receive(response.dx[0], "dx")],
                    response.version)
        # ForwardBackward returns no gradients for extra inputs (k, v); Backward does.
        forward = session.call("Forward", forward_request(handle, call, dropout_seed, uploads, keep_for_backward=True,
                                                          graph=index, version=version))
        y = session.receive(forward.y, "y")
        value = float(np.vdot(np.asarray(y, np.float64), np.asarray(dy, np.float64)))
        backward = session.call("Backward", service_pb2.BackwardRequest(
            forward_id=forward.forward_id, dy=session.send(dy, uploads, "dy"),
            keep_outputs=session.large(dtypes.as_numpy(dy).nbytes)))
        input_grads = [session.receive(backward.dx, "dx")] + [
            session.receive(g, "extra_input_grads[%d]" % i) for i, g in enumerate(backward.extra_input_grads)]
        # A Backward under DelayedScaling makes a version (its FP8 state moved).
        return value, _grads(session, backward.grads), input_grads, backward.version
    finally:
        session.delete_all(uploads)
