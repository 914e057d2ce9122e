"""Generation on the server: a causal LM's new tokens, streamed back as they are made.

    params = model.init(key, tokens, labels)          # a traced LM (examples/train_lm.py), or state.params
    out = te.generate(params, prompt, 64)             # int32 [batch, prompt_length + steps]: greedy
    out = te.generate(params, prompt, 64, temperature=0.8, top_k=40, seed=1, stop_tokens=[10])
    for step in te.generate_stream(params, prompt, 64):
        print(step.step, step.tokens, step.stopped)   # each position of every sequence, as it is made

One Generate call (te.v1) runs the whole loop on the server's device: the
prompt at once, then one cached position per new token, so no activation and
no prefix crosses the wire, only the prompt and the new ids. The model is the
layer `variables` name (init's result, a training state, or a tree of their
VariableRefs) at their version, which stays as it was. The current
te.autocast and default_matmul_precision go with the call, as with apply.

Sampling: greedy (the argmax, lowest index on ties, as jnp.argmax) unless a
sampling parameter is given (or greedy=False): then logits / temperature,
the top_k most likely, the top_p nucleus, and a draw that depends on (seed,
step, sequence) alone, so the same call gives the same tokens. A sequence
that makes one of stop_tokens stops there (it repeats its stop token while
the others go on); the call ends when every sequence has stopped.

A deadline (`timeout`, in seconds) or an interrupt is honoured between
tokens: the stream ends with DeadlineExceededError (or the interrupt) after
the tokens already made; generate() attaches them to the error as `.tokens`.
"""
import collections

import grpc
import numpy as np

from te_client import dtypes, errors, layer_calls, precision as precision_lib
from te_client import variables as variables_lib
from te_client._pb import service_pb2

__all__ = ["generate", "generate_stream", "Step"]

# One position of every sequence: step (0 for the first new token), tokens
# int32 [batch], stopped bool [batch] (the sequence has made a stop token).
Step = collections.namedtuple("Step", ["step", "tokens", "stopped"])


def generate_stream(variables, prompt, max_new_tokens, *, greedy=None, temperature=None, top_k=0, top_p=None,
                    seed=0, stop_tokens=(), graph=0, timeout=None):
    """Yields a Step per new position as the server makes it (see the module's
    comment for the arguments). Closing the generator early (break, or
    close()) cancels the call on the server. Raises the server's TeError
    (InvalidArgumentError naming the field: prompt, max_new_tokens,
    sampling.temperature, layer_id for a model that cannot generate...)."""
    handle, version = _target(variables)
    session = handle.session
    prompt = _prompt(prompt)
    request = service_pb2.GenerateRequest(
        layer_id=handle.layer_id, graph=int(graph), version=version.number, max_new_tokens=int(max_new_tokens),
        stop_tokens=[int(t) for t in stop_tokens], autocast=layer_calls.autocast(),
        matmul_precision=precision_lib.current())
    request.sampling.CopyFrom(_sampling(greedy, temperature, top_k, top_p, seed))
    uploads = []
    request.prompt.CopyFrom(session.send(prompt, uploads, "prompt"))
    # A stream has no response to wait for, so it runs Session.call's steps
    # itself: queued releases first, the call's number in the session's
    # order, and how the call ended kept there.
    session.flush_pending()
    sequence = session._number(request.session)
    deadline = session._timeout(timeout)
    call = None
    try:
        session.client.check_open("Generate")
        call = session._stub.Generate(request, timeout=deadline, metadata=session._metadata)
        for response in call:
            yield Step(int(response.step), np.asarray(response.tokens, np.int32),
                       np.asarray(response.stopped, np.bool_))
    except grpc.RpcError as e:
        error = session._error(e, "Generate", deadline)
        session._ended(sequence, error.code)
        raise error from None
    except BaseException:
        # Closed early (GeneratorExit), or interrupted: the server stops at its next token.
        if call is not None:
            call.cancel()
        session._ended(sequence, grpc.StatusCode.CANCELLED)
        raise
    else:
        session._ended(sequence, grpc.StatusCode.OK)
    finally:
        session.delete_all(uploads)


def generate(variables, prompt, max_new_tokens, *, greedy=None, temperature=None, top_k=0, top_p=None, seed=0,
             stop_tokens=(), graph=0, timeout=None, on_step=None):
    """The prompt followed by the new tokens: int32 [batch, prompt_length +
    steps] (steps < max_new_tokens when every sequence stopped early; a
    sequence that stopped repeats its stop token). `on_step(step)` sees each
    Step as it arrives. A TeError raised after some tokens carries them
    (the same array, so far) as `.tokens`."""
    prompt = _prompt(prompt)
    made = []
    try:
        for step in generate_stream(variables, prompt, max_new_tokens, greedy=greedy, temperature=temperature,
                                    top_k=top_k, top_p=top_p, seed=seed, stop_tokens=stop_tokens, graph=graph,
                                    timeout=timeout):
            made.append(step.tokens)
            if on_step is not None:
                on_step(step)
    except errors.TeError as e:
        e.tokens = _joined(prompt, made)
        raise
    return _joined(prompt, made)


def _joined(prompt, made):
    if not made:
        return prompt.copy()
    return np.concatenate([prompt, np.stack(made, axis=1)], axis=1)


def _target(variables):
    """(LayerHandle, Version) of the model: init's Variables, a tree of their
    VariableRefs, or anything with .params (a TrainState)."""
    found = variables_lib.refs_version(variables)
    if found is None and hasattr(variables, "params"):
        found = variables_lib.refs_version(variables.params)
    if found is None:
        raise errors.InvalidArgumentError(
            "variables: want what init returned (a te_client Variables), a tree of its VariableRefs or a "
            "TrainState; the model runs where its variables are, got %s" % type(variables).__name__)
    return found


def _prompt(prompt):
    """Token ids as int32 (the wire's id dtype); other integer dtypes are converted when their values fit."""
    array = dtypes.as_numpy(prompt) if not isinstance(prompt, (list, tuple)) else np.asarray(prompt)
    if array.dtype == np.int32 or not np.issubdtype(array.dtype, np.integer):
        return array   # a float prompt goes as it is, for the server to name
    info = np.iinfo(np.int32)
    if array.size and (array.min() < info.min or array.max() > info.max):
        raise errors.InvalidArgumentError("prompt: token ids outside int32 (%d to %d)" % (array.min(), array.max()))
    return array.astype(np.int32)


def _sampling(greedy, temperature, top_k, top_p, seed):
    sample = (temperature is not None or bool(top_k) or top_p is not None) if greedy is None else not greedy
    sampling = service_pb2.Sampling(sample=sample, top_k=int(top_k), seed=int(seed))
    if temperature is not None:
        sampling.temperature = float(temperature)
    if top_p is not None:
        sampling.top_p = float(top_p)
    return sampling
