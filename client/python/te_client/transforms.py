"""te_client.value_and_grad and grad: JAX's, over any loss function of a model's variables.

    def loss_fn(params, x, labels):
        logits = model.apply({"params": params}, x)           # or model.apply(variables, x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, logits                                  # has_aux
    (loss, logits), grads = te.value_and_grad(loss_fn, has_aux=True)(variables["params"], x, labels)

The whole function is traced, as jax.jit traces it: its array arguments
become the graph's inputs (the first "x", one passed as `attention_mask` or
`mask` the attention mask, the rest "extra_inputs[i]", containers such as a
batch dict walked in order), model.apply inside it inlines the model's graph
(its module nodes keep the names init gave them, so they read and train the
layer's own variables), and the jnp ops and the loss after it record glue
nodes. A parameter the function reads itself (an L2 penalty over params)
is a Param node over that same variable, so its gradient is the sum of
what flows through the model and what flows through the penalty, as JAX's.
The graph, y the float32 scalar loss and the aux outputs after it, is
added to the model's layer (AddGraph, once per signature: a new batch size
traces again, as jax.jit does) and run as one ForwardBackward: the server
seeds the backward itself, so no activation and no dy cross the wire.

argnums picks what is differentiated: a variables argument (init's
Variables or a tree of its VariableRefs) gives gradients shaped like it; an
array argument its input gradient. The gradients of variables come back as
te_client.Gradients, whose `.variables` are the layer's variables after the
step (under DelayedScaling the FP8 state moved): TrainState.apply_gradients
continues from them. Arguments that are not arrays (Python values, a JAX
PRNG key) are passed to the function as they are; a dropout key reaches the
server as the step's dropout seed (apply's rngs={'dropout': key}).

value_and_grad(layer.apply) keeps its earlier meaning, the quickstart's
vdot(apply(variables, x), dy): (variables, x, dy) -> (value, (grads, dx)).
"""
import inspect
import numbers

import grpc
import numpy as np

from te_client import dtypes, errors, graph, initializers, layer_calls, precision as precision_lib, symbolic
from te_client import module as module_lib
from te_client import variables as variables_lib
from te_client._pb import layers_pb2, service_pb2
from te_client.session import ResidentTensor

_MASK_ARGUMENTS = ("attention_mask", "mask")


def _is_array(value):
    if isinstance(value, ResidentTensor):
        return True
    if isinstance(value, (variables_lib.VariableRef, symbolic.Symbol)) or isinstance(value, (numbers.Number, str)):
        return False
    if not (hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__array__")):
        return False
    if isinstance(value, np.ndarray) and value.dtype == np.uint32:
        return False   # a PRNG key's words: an argument, not data
    try:
        return str(value.dtype) not in ("key<fry>",) and not str(value.dtype).startswith("key")
    except Exception:
        return True


def _is_variables(value):
    if isinstance(value, variables_lib.Variables):
        return True
    if isinstance(value, (dict, list, tuple)):
        leaves = variables_lib.tree_leaves(value)
        return bool(leaves) and any(isinstance(v, variables_lib.VariableRef) for v in leaves)
    return False


class LossTrace:
    """One trace of a loss function: the graph it records and the layer it reads."""

    def __init__(self):
        self.trace = graph.Trace(lambda: (), None)
        self.handle = None
        self.version = None
        self.module = None
        self.seed = None
        self.params = {}   # id(param Symbol) -> the VariableRef it reads

    def traced_variables(self, tree):
        """A variables argument as the traced function sees it: each params
        leaf a Symbol of a Param node reading that variable (AddGraph matches
        it to the layer's params/<path> by shape and dtype), the other
        collections' leaves VariableRefs. Unread Param nodes leave the graph
        at build; model.apply takes the tree and binds the refs behind it."""
        found = variables_lib.refs_version(tree)
        if found is None:
            return tree
        self._use(*found)

        def leaf(ref):
            if not isinstance(ref, variables_lib.VariableRef) or ref.info.collection != "params":
                return ref
            info = ref.info
            symbol = self.trace.record(
                "param", layers_pb2.GraphSpec.Param(shape=list(info.shape), dtype=info.wire_dtype,
                                                    initializer=initializers.zeros.proto()),
                [], [(info.shape, info.wire_dtype)], name=info.path)[0]
            self.params[id(symbol)] = ref
            return symbol
        return _map_leaves(leaf, tree)

    def _use(self, handle, version):
        if self.handle is not None and (handle is not self.handle or version is not self.version):
            raise NotImplementedError(
                "a traced function that applies two models (or two versions of one): a graph runs over one "
                "layer's variables; combine the models in one Module")
        self.handle, self.version = handle, version

    def bind(self, module, variables):
        found = variables_lib.refs_version(_map_leaves(
            lambda v: self.params.get(id(v), v) if isinstance(v, symbolic.Symbol) else v, variables))
        if found is None:
            raise errors.InvalidArgumentError(
                "%s.apply inside a traced function: variables are %s; pass the variables argument being "
                "differentiated (init's result or a tree of its VariableRefs, e.g. {'params': params}): arrays "
                "would be constants of the graph" % (type(module).__name__, type(variables).__name__))
        self._use(*found)
        self.module = module

    def dropout_key(self, rngs):
        if isinstance(rngs, dict) and "dropout" not in rngs:
            return
        seed = module_lib.seed_of(rngs, "dropout")
        if self.seed is not None and seed != self.seed:
            raise NotImplementedError("two different dropout keys in one traced function: a step has one dropout "
                                      "seed (each dropout node draws DeriveSeed(seed, its name))")
        self.seed = seed


def _map_leaves(fn, tree):
    """`tree` (dicts, lists, tuples; a Variables as a plain dict) with fn applied to each leaf."""
    if isinstance(tree, dict):
        return {k: _map_leaves(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(fn, v) for v in tree)
    return fn(tree)


class _Inputs:
    """The array arguments of a traced call, as graph inputs."""

    def __init__(self, fn, args, kwargs, skip):
        self.values = []      # (graph input name, value), in order
        self.names = {}       # id(value) -> name
        try:
            signature = inspect.signature(fn)
            bound = signature.bind(*args, **kwargs)
            by_name = {id(v): k for k, v in bound.arguments.items()}
        except (TypeError, ValueError):
            by_name = {}
        extra = [0]

        def visit(value, top_name):
            if _is_array(value):
                if not self.values:
                    name = "x"
                elif top_name in _MASK_ARGUMENTS:
                    name = "attention_mask"
                else:
                    name = "extra_inputs[%d]" % extra[0]
                    extra[0] += 1
                self.values.append((name, value))
                return
            if isinstance(value, dict) and not isinstance(value, variables_lib.Variables):
                for k in sorted(value):
                    visit(value[k], None)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    visit(v, None)

        for i, a in enumerate(args):
            if i not in skip:
                visit(a, by_name.get(id(a)))
        for k in sorted(kwargs):
            visit(kwargs[k], k)
        if self.values and self.values[0][0] != "x":
            raise TypeError("the traced function's first array argument is its x")
        # The extra inputs keep their own dtypes (int32 labels beside a float x): AddGraph declares
        # each one's dtype and shape (layer_calls.extra_input_headers).

    def substitute(self, tree, symbols, skip_ids=()):
        """`tree` with each array input replaced by its Symbol."""
        ids = {id(v): symbols[name] for name, v in self.values}

        def walk(value):
            if id(value) in ids and _is_array(value):
                return ids[id(value)]
            if isinstance(value, variables_lib.Variables) or id(value) in skip_ids:
                return value
            if isinstance(value, dict):
                return type(value)((k, walk(v)) for k, v in value.items()) if type(value) is dict else \
                    {k: walk(v) for k, v in value.items()}
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                return type(value)(*[walk(v) for v in value])
            if isinstance(value, (list, tuple)):
                return type(value)(walk(v) for v in value)
            return value
        return walk(tree)


class Prepared:
    """A traced call, ready to run: its graph on the layer, its inputs and outputs."""

    def __init__(self, fn, args, kwargs, argnums, has_aux, default_seed=None, add=True):
        self.default_seed = default_seed   # train_step's per-step key, when the function passes none
        self.args = args
        self.argnums = argnums
        self.has_aux = has_aux
        variable_args = [i for i, a in enumerate(args) if _is_variables(a)]
        self.inputs = _Inputs(fn, args, kwargs, set(variable_args))
        loss = self.loss = LossTrace()
        symbols = {name: loss.trace.input(name, *layer_calls.shape_and_wire(v, name)) for name, v in
                   self.inputs.values}
        t_args = tuple(loss.traced_variables(a) if i in variable_args else self.inputs.substitute(a, symbols)
                       for i, a in enumerate(args))
        t_kwargs = {k: self.inputs.substitute(v, symbols) for k, v in kwargs.items()}
        token = graph._loss.set(loss)
        try:
            out = fn(*t_args, **t_kwargs)
        finally:
            graph._loss.reset(token)
        if has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise TypeError("has_aux=True: the function returns %s; want a pair (loss, aux)" % type(out).__name__)
            value, aux = out
        else:
            value, aux = out, None
        if not isinstance(value, symbolic.Symbol) or value.trace is not loss.trace:
            raise TypeError("the traced function's loss is %s, not a traced tensor computed from the model's output"
                            % type(value).__name__)
        if value.shape != ():
            raise TypeError("Gradient only defined for scalar-output functions. Output had shape: %s" % (value.shape,))
        if value.wire != dtypes.FLOAT32:
            value = value._cast(dtypes.FLOAT32, "loss")   # the server's loss graphs have a float32 y
        if value.from_extra:
            value = value.as_known_scalar()   # a loss reading labels or targets: see Symbol.as_known_scalar
        self.aux_leaves, self.aux_def = variables_lib.tree_flatten(aux)
        self.aux_symbols = [v for v in self.aux_leaves if isinstance(v, symbolic.Symbol)]
        if loss.handle is None:
            raise TypeError("the traced function calls no model.apply: its graph would read no variables")
        self.handle = loss.handle
        self.version = loss.version
        self.traced = loss.trace.build(value, self.aux_symbols)
        x_shape, x_wire = layer_calls.shape_and_wire(self.inputs.values[0][1], "x") if self.inputs.values else ((), 0)
        if not self.inputs.values:
            raise TypeError("the traced function has no array argument (x)")
        self.info = layer_calls.add_graph(self.handle, self.traced, x_shape, x_wire) if add else None
        self.deterministic = True if loss.trace.deterministic is None else loss.trace.deterministic
        if not self.deterministic and loss.seed is None and default_seed is None and self.traced.dropouts:
            raise errors.InvalidArgumentError(
                '%s needs PRNG for "dropout": with deterministic=False pass rngs={"dropout": key} to apply, as '
                "Flax requires" % ", ".join(self.traced.dropouts))

    def seed(self, i=0):
        """Micro-batch i's dropout seed: the function's key, else the step's default (+ i)."""
        if self.loss.seed is not None:
            return self.loss.seed + i
        return (self.default_seed or 0) + i

    def micro_batch(self, session, uploads, seed=None, values=None):
        values = dict(values if values is not None else self.inputs.values)
        batch = service_pb2.MicroBatch(dropout_seed=int(seed if seed is not None else self.seed()) & (2**64 - 1))
        batch.x.CopyFrom(session.send(values["x"], uploads, "x"))
        read = [n for n in self.traced.inputs if n.startswith("extra_inputs")]
        count = 1 + max([int(n[len("extra_inputs["):-1]) for n in read], default=-1)
        for i in range(count):
            name = "extra_inputs[%d]" % i
            batch.extra_inputs.add().CopyFrom(session.send(values[name], uploads, name))
        if "attention_mask" in values and "attention_mask" in self.traced.inputs:
            batch.attention_mask.CopyFrom(session.send(layer_calls._mask_wire(values["attention_mask"]), uploads,
                                                       "attention_mask"))
        return batch

    def request(self, batches, apply_update=False, want_input_grads=False, read_version=True):
        """The ForwardBackward; read_version False leaves `version` for
        pipeline.dispatch to set (the version read may still be in the making)."""
        return service_pb2.ForwardBackwardRequest(
            layer_id=self.handle.layer_id, micro_batches=batches, deterministic=self.deterministic,
            autocast=layer_calls.autocast(), return_dx=want_input_grads, return_grads=not apply_update,
            apply_update=apply_update, graph=self.info.index,
            version=self.version.number if read_version else 0,
            return_outputs=bool(self.aux_symbols), matmul_precision=precision_lib.current())

    def aux(self, session, response, index=0):
        if not self.aux_symbols:
            return variables_lib.tree_unflatten(self.aux_def, self.aux_leaves)
        if len(response.outputs) <= index or len(response.outputs[index].outputs) != len(self.aux_symbols):
            raise errors.error(grpc.StatusCode.INTERNAL, "ForwardBackward answered %d aux outputs; the graph has %d" % (
                len(response.outputs[index].outputs) if len(response.outputs) > index else 0, len(self.aux_symbols)))
        got = iter(session.receive(t, "outputs[%d]" % i) for i, t in enumerate(response.outputs[index].outputs))
        leaves = [next(got) if isinstance(v, symbolic.Symbol) else v for v in self.aux_leaves]
        return variables_lib.tree_unflatten(self.aux_def, leaves)

    def new_variables(self, number):
        handle = self.handle
        module = self.loss.module
        if not number:
            number = self.version.number
        return variables_lib.Variables({handle.scope: handle}, module, variables_lib.Version(handle, number)) \
            if number != self.version.number else variables_lib.Variables({handle.scope: handle}, module,
                                                                           self.version)


def make_graph(fn, *args, has_aux=False, **kwargs):
    """The graph.Traced that value_and_grad(fn, has_aux=has_aux)(*args, **kwargs)
    would add to the model's layer (GraphSpec, edge shapes and dtypes), without
    running it: jax.make_jaxpr's counterpart, for inspecting what a function records."""
    return Prepared(fn, args, kwargs, (0,), has_aux, add=False).traced


def _grads_like(arg, flat, new_variables):
    """Gradients shaped like the variables argument `arg` (zeros where no gradient flows: fp8_metas)."""
    def leaf(ref):
        name = ref.name
        if name in flat:
            return flat[name]
        return dtypes.zeros(ref.shape, ref.info.wire_dtype)
    if isinstance(arg, variables_lib.Variables):
        tree = {"params": variables_lib.tree_map(leaf, arg["params"])} if "params" in arg else {}
    else:
        tree = variables_lib.tree_map(leaf, arg)
    grads = variables_lib.Gradients(tree) if isinstance(tree, dict) else tree
    if isinstance(grads, variables_lib.Gradients):
        grads.variables = new_variables
    return grads


def _input_grad(prepared, session, response, arg):
    """The gradient of an array argument (or a container of them): dx, extra_input_grads."""
    received = {}

    def get(name):
        if name not in received:
            if name == "x":
                if not response.dx:
                    raise errors.error(grpc.StatusCode.INTERNAL, "ForwardBackward returned no dx")
                received[name] = session.receive(response.dx[0], "dx")
            elif name.startswith("extra_inputs"):
                i = int(name[len("extra_inputs["):-1])
                grads = response.extra_input_grads[0].grads if response.extra_input_grads else []
                if i >= len(grads):
                    raise errors.error(grpc.StatusCode.INTERNAL, "ForwardBackward returned %d extra input gradients; "
                                       "want %s" % (len(grads), name))
                received[name] = session.receive(grads[i], "extra_input_grads[%d]" % i)
            else:
                raise TypeError("argnums: %s (the attention mask) has no gradient" % name)
        return received[name]
    names = {id(v): n for n, v in prepared.inputs.values}

    def walk(value):
        if id(value) in names:
            return get(names[id(value)])
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(v) for v in value)
        raise TypeError("argnums: an argument of type %s is neither variables nor an array" % type(value).__name__)
    return walk(arg)


def _bound_apply(fn):
    module = getattr(fn, "__self__", None)
    return module if isinstance(module, module_lib.Module) and getattr(fn, "__name__", "") == "apply" else None


def value_and_grad(fn, argnums=0, has_aux=False):
    """jax.value_and_grad(fn, argnums, has_aux) for a function that applies a
    te_client model: one ForwardBackward per call (see the module's comment).
    For `model.apply` itself: the quickstart's vdot(apply(v, x), dy) step."""
    module = _bound_apply(fn)
    if module is not None:
        if argnums != 0 or has_aux:
            raise TypeError("value_and_grad(model.apply) is the vdot(apply(v, x), dy) step: (variables, x, dy) -> "
                            "(value, (grads, dx)); for argnums and has_aux write the loss function")

        def step(variables, x, dy, *args, rngs=None, **kwargs):
            return module.value_and_grad(variables, x, dy, *args, rngs=rngs, **kwargs)
        return step
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if not nums:
        raise ValueError("argnums: at least one")

    def run(*args, **kwargs):
        for i in nums:
            if not -len(args) <= i < len(args):
                raise TypeError("argnums %d: the function was called with %d positional arguments" % (i, len(args)))
        positions = tuple(i % len(args) for i in nums)
        prepared = Prepared(fn, args, kwargs, positions, has_aux)
        session = prepared.handle.session
        want_inputs = any(not _is_variables(args[i]) for i in positions)
        uploads = []
        try:
            response = session.call("ForwardBackward", prepared.request(
                [prepared.micro_batch(session, uploads)], want_input_grads=want_inputs))
        finally:
            session.delete_all(uploads)
        if len(response.values) != 1:
            raise errors.error(grpc.StatusCode.INTERNAL, "ForwardBackward answered %d values for one micro-batch" %
                               len(response.values))
        value = float(response.values[0])
        flat = {variables_lib.join("params", prepared.handle.scope, g.path): session.receive(g.value, "grads/" + g.path)
                for g in response.grads}
        new_variables = prepared.new_variables(response.version)
        grads = tuple(_grads_like(args[i], flat, new_variables) if _is_variables(args[i]) else
                      _input_grad(prepared, session, response, args[i]) for i in positions)
        grads = grads[0] if isinstance(argnums, int) else grads
        if has_aux:
            return (value, prepared.aux(session, response)), grads
        return value, grads
    run.__wrapped__ = fn
    return run


def grad(fn, argnums=0, has_aux=False):
    """jax.grad: value_and_grad without the value (with has_aux, (grads, aux))."""
    vg = value_and_grad(fn, argnums, has_aux)
    if _bound_apply(fn) is not None:
        return lambda *a, **k: vg(*a, **k)[1]

    def run(*args, **kwargs):
        value, grads = vg(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads
    run.__wrapped__ = fn
    return run
