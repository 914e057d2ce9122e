"""Tracing a composite module into a te.v1.GraphSpec (DESIGN.md section 11).

A composite's init runs its __call__ once on symbolic tensors (symbolic.py:
a shape and a dtype, no values). Each glue op on one (te_client.numpy's
reshape, split, concatenate, transpose, +, * constant, astype; nn.Dropout;
nn.make_causal_mask) and each TE module called on one records a node in the
Trace; Trace.build turns the record into the GraphSpec that the server runs
as one layer, so a step of the composite is one RPC and no activation leaves
the device. derive_seed is the server's rule for every derived seed, each node's included.

Names (what the spec's nodes and edges, and so the variables, are called):
  * a module node is the module's Flax scope path ("TEUnfusedMLP_0/DenseGeneral_0");
    nn.Dropout is a Flax module too ("Dropout_0");
  * a glue node is "<scope>/<op>_<n>", n counting that op in that scope in
    call order ("reshape_0", "TEUnfusedMLP_0/reshape_1"), passing over names a
    module holds; <op> is the GraphSpec.Node field ("split", "causal_mask"),
    "activation" for te.activation.activation;
  * a node's one output is the tensor named as the node; several are "<node>:<i>";
  * the graph's inputs are "x", "attention_mask" and "extra_inputs[i]".

Glue whose result the output does not depend on is left out (the quickstart's
TEUnfusedTransformerLayer makes a causal mask that only its Flax-attention
branch reads); module nodes always stay, since Flax creates their variables
whether or not the output uses them. A mask (the request's attention_mask, or
a causal_mask node's output) is read only as a module's mask, as the server
requires.
"""
import contextvars
import dataclasses
from typing import Optional

from te_client import dtypes
from te_client.symbolic import Symbol
from te_client._pb import layers_pb2

_M64 = (1 << 64) - 1

# ---- seeds (kernels/rng.h) ------------------------------------------------------------


def mix_bits(z):
    """kernels/rng.h's MixBits: splitmix64's finaliser on a uint64."""
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xbf58476d1ce4e5b9) & _M64
    z = ((z ^ (z >> 27)) * 0x94d049bb133111eb) & _M64
    return z ^ (z >> 31)


def name_hash(name):
    """kernels/rng.h's NameHash: FNV-1a (64-bit) of the name's UTF-8 bytes."""
    h = 0xcbf29ce484222325
    for byte in name.encode("utf-8") if isinstance(name, str) else bytes(name):
        h = ((h ^ byte) * 0x100000001b3) & _M64
    return h


def derive_seed(seed, name):
    """The seed named `name` under `seed`: kernels/rng.h's DeriveSeed, the one rule the server and
    both clients derive seeds by. A graph node's init key and dropout seed are the layer's under the
    node's name, so a module run on its own with derive_seed(seed, "DenseGeneral_0") draws the
    numbers the graph's node does; a timed step's dropout seed is the run's under "step/<i>"."""
    return mix_bits((int(seed) & _M64) ^ mix_bits(name_hash(name)))


# The loss function being traced (transforms.py's), if any: Module.apply inside it records
# the model's graph into the function's trace instead of calling the server.
_loss = contextvars.ContextVar("te_client_loss", default=None)


def current_loss():
    return _loss.get()


# ---- the record and the spec -----------------------------------------------------------

@dataclasses.dataclass(eq=False)
class _Node:
    op: str                  # the GraphSpec.Node oneof field: "module", "reshape", "dropout"...
    message: object          # that field's message
    label: str               # a glue node's name stem ("reshape", "activation")
    scope: tuple             # the module scope it was recorded in
    name: Optional[str]      # a module's scope path; glue is named by build()
    inputs: list
    mask: Optional[Symbol]
    outputs: list = dataclasses.field(default_factory=list)
    keep: bool = False       # stays even when the output does not depend on it (owns variables)


@dataclasses.dataclass
class Traced:
    """A composite traced for one input signature: the spec and what it holds."""
    spec: object             # te.v1.GraphSpec
    shapes: dict             # every edge (inputs included) -> its shape
    dtypes: dict             # every edge -> its dtype name ("bfloat16")
    inputs: list             # the graph inputs it reads, of "x", "attention_mask", "extra_inputs[i]"
    output_shape: tuple
    output_wire: int
    dropouts: list = dataclasses.field(default_factory=list)   # names of what draws dropout (rate > 0)
    # Whether a module node was called with TE's decode=True (init creates the
    # cache; apply runs one autoregressive step on it).
    decode: bool = False

    def node(self, name):
        return next(n for n in self.spec.nodes if n.name == name)


class Trace:
    """The nodes one run of a composite's __call__ recorded. `scope` gives the
    module scope path ops run in now; `deterministic` is the value the
    composite was traced with (every dropout in the graph follows the request's)."""

    def __init__(self, scope, deterministic):
        self.nodes = []
        self.inputs = {}
        self.scope = scope
        # None (a loss function's trace): set by the first dropout the trace meets.
        self.deterministic = None if deterministic is None else bool(deterministic)
        self.closed = False
        self.dropouts = []   # what draws dropout: it needs apply's rngs['dropout'] when not deterministic
        self.decodes = []    # module nodes called with decode=True
        self._owners = {}    # module node name -> the module instance

    def input(self, name, shape, wire):
        self.inputs[name] = Symbol(self, shape, wire, input_name=name, is_mask=name == "attention_mask")
        return self.inputs[name]

    def record(self, op, message, inputs, outputs, label=None, name=None, mask=None, keep=False,
               makes_mask=False):
        """Records a node reading `inputs` (and `mask`) and returns Symbols for
        its `outputs` [(shape, wire)...]. `name` for a module node, else it is
        named at build()."""
        if self.closed:
            raise TypeError("a traced tensor was used after its composite's trace ended (kept on self?)")
        for s in list(inputs) + ([mask] if mask is not None else []):
            if s.trace is not self:
                raise TypeError("%s: a tensor from another trace" % (name or op))
        for s in inputs:
            if s.is_mask:
                raise TypeError("%s: an attention mask (the composite's attention_mask, or a causal mask) as the "
                                "input of %s: in a GraphSpec a mask is read only as a module's mask" % (
                                    name or op, "module " + name if name else op))
        if mask is not None and not mask.is_mask:
            raise TypeError("%s: its mask is a computed tensor; a module's mask is the composite's attention_mask "
                            "or nn.make_causal_mask's result" % name)
        if op == "module" and inputs:
            inputs = [self._known(inputs[0])] + list(inputs[1:])   # a module's x; k and v may be extra inputs
        node = _Node(op, message, label or op, tuple(self.scope()), name, list(inputs), mask, keep=keep)
        node.outputs = [Symbol(self, shape, wire, node, i, is_mask=makes_mask) for i, (shape, wire) in enumerate(outputs)]
        from_extra = any(s.from_extra for s in inputs) and not (
            op in ("module", "softmax_cross_entropy") or op == "reshape" and -1 not in message.shape)
        for s in node.outputs:
            s.from_extra = from_extra
        self.nodes.append(node)
        return node.outputs

    def _known(self, s):
        """`s`, or, where its shape derives from an extra input, `s` through a
        reshape to the shape this trace knows it has. te_server infers a
        graph's shapes from x alone (an extra input's shape is unknown until a
        forward), and a module's x must have a known shape; a reshape to an
        explicit shape is known, and the graph is traced per input signature,
        so the shape written is the one every forward of it sees."""
        if not s.from_extra:
            return s
        return self.record("reshape", layers_pb2.GraphSpec.Reshape(shape=list(s.shape)), [s], [(s.shape, s.wire)])[0]

    def claim(self, name, module):
        """A module node's name, once: Flax gives each module its own variables."""
        owner = self._owners.get(name)
        if owner is module:
            raise NotImplementedError(
                "%s (%s) is called twice: in Flax both calls share its parameters; a GraphSpec module node "
                "has its own, so call two modules" % (name, type(module).__name__))
        if owner is not None:
            raise ValueError("%s: the name is already used by another module in the same scope (%s)" % (
                name, type(owner).__name__))
        self._owners[name] = module

    def build(self, result, extra=()):
        """The GraphSpec whose outputs are `result` (the Symbol __call__
        returned: y) and then `extra` (a loss function's aux outputs)."""
        if isinstance(result, tuple) and result and isinstance(result[0], Symbol) and all(
                r is None for r in result[1:]):
            result = result[0]   # (y, None): a TE module's (y, ln_out) without ln_out
        if not isinstance(result, Symbol) or result.trace is not self or result.is_mask:
            raise TypeError("__call__ returned %s: a traced composite returns one traced tensor (y)" % (
                "a mask" if isinstance(result, Symbol) else type(result).__name__
                if not isinstance(result, (tuple, list)) else "a %s of %d" % (type(result).__name__, len(result))))
        outputs = [result] + list(extra)
        for s in extra:
            if not isinstance(s, Symbol) or s.trace is not self or s.is_mask:
                raise TypeError("a traced output is %s, not a tensor of this trace" % type(s).__name__)
        self.closed = True
        live = self._live(outputs)
        names = self._name_glue(live)
        edges = {}
        for name, s in self.inputs.items():
            edges[id(s)] = name
        nodes_pb = []
        pb = layers_pb2
        for node in self.nodes:
            if node not in live:
                continue
            name = names[node]
            base = name or "module"    # a layer that is one module: its node is named "" (AddGraph)
            for i, s in enumerate(node.outputs):
                edge = base if len(node.outputs) == 1 else "%s:%d" % (base, i)
                if edge in self.inputs:
                    raise ValueError("%s: a node's output would be named like the graph input %r" % (name, edge))
                edges[id(s)] = edge
            msg = pb.GraphSpec.Node(name=name, inputs=[edges[id(s)] for s in node.inputs],
                                    outputs=[edges[id(s)] for s in node.outputs])
            if node.mask is not None:
                msg.mask = edges[id(node.mask)]
            getattr(msg, node.op).CopyFrom(node.message)
            nodes_pb.append(msg)
        spec = pb.GraphSpec(nodes=nodes_pb, outputs=[edges[id(s)] for s in outputs])
        symbols = list(self.inputs.values()) + [s for n in self.nodes if n in live for s in n.outputs]
        read = {edges[id(s)] for n in self.nodes if n in live for s in n.inputs + [n.mask] if s is not None}
        read.update(edges[id(s)] for s in outputs)
        return Traced(spec=spec, shapes={edges[id(s)]: s.shape for s in symbols},
                      dtypes={edges[id(s)]: dtypes.dtype_name(s.wire) for s in symbols},
                      inputs=[n for n in self.inputs if n in read],
                      output_shape=result.shape, output_wire=result.wire, dropouts=list(self.dropouts),
                      decode=bool(self.decodes))

    def _live(self, outputs):
        live, stack = set(), [n for n in self.nodes if n.keep]
        stack.extend(s.node for s in outputs if s.node is not None)
        while stack:
            node = stack.pop()
            if node in live:
                continue
            live.add(node)
            stack.extend(s.node for s in node.inputs + [node.mask] if s is not None and s.node is not None)
        return live

    def _name_glue(self, live):
        taken = set(self.inputs) | {n.name for n in self.nodes if n.name is not None}
        counters, names = {}, {}
        for node in self.nodes:
            if node not in live:
                continue
            if node.name is not None:
                names[node] = node.name
                continue
            key = (node.scope, node.label)
            k = counters.get(key, 0)
            while "/".join(node.scope + ("%s_%d" % (node.label, k),)) in taken:
                k += 1
            names[node] = "/".join(node.scope + ("%s_%d" % (node.label, k),))
            taken.add(names[node])
            counters[key] = k + 1
        return names
