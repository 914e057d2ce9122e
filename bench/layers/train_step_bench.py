"""The quickstart's TE TransformerLayer (bf16 params) trained on the server: a ForwardBackward
step with AdamW's update (apply_update) against the same step without it, x and dy resident.

    python3 bench/layers/train_step_bench.py ADDRESS [ITERS] [--fp8]

--fp8 runs both steps under FP8 DelayedScaling (HYBRID, history 1024, "max": TE's defaults), where
the update also rewrites the GEMM kernels' kept FP8 copies, so the step after it quantizes no weight.

Prints both mean step times, their difference (the update's cost) and the update's floor: bytes of
params, grads and both moments read and written, over the bandwidth given with --bandwidth_tbs.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "client", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "py"))  # a bundle folder
import te_client as te  # noqa: E402
import te_client.flax as te_flax  # noqa: E402
from te_client import client as client_lib, optim, recipe as recipe_lib, variables as variables_lib  # noqa: E402
from te_client.recipe import DelayedScaling, Format  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("iters", type=int, nargs="?", default=10)
    parser.add_argument("--bandwidth_tbs", type=float, default=4.24, help="device copy bandwidth, TB/s")
    parser.add_argument("--fp8", action="store_true", help="both steps under FP8 DelayedScaling")
    args = parser.parse_args()
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")
    pb = client_lib.service_pb2
    client = te.connect(args.address)
    with client.session() as session:
        layer = te_flax.TransformerLayer(
            hidden_size=4096, mlp_hidden_size=16384, num_attention_heads=32, mlp_activations=("gelu",),
            self_attn_mask_type="causal", layernorm_epsilon=1e-5, use_bias=True, intermediate_dropout=0.0,
            enable_relative_embedding=False, self_attn_bias_type="no_bias", hidden_dropout=0.0,
            attention_dropout=0.0, dtype=te.bfloat16)
        rng = np.random.default_rng(0)
        x = te.asarray(rng.standard_normal((4, 2048, 4096), dtype=np.float32), te.bfloat16)
        dy = te.asarray(rng.standard_normal((4, 2048, 4096), dtype=np.float32) * 1e-3, te.bfloat16)
        with te.autocast(enabled=args.fp8, recipe=recipe if args.fp8 else None):
            params = layer.init(0, x)
        optim.TrainState.create(apply_fn=layer.apply, params=params, tx=optim.adamw(1e-5))
        handle = variables_lib.handles_of(params)[0]
        n_params = sum(int(np.prod(v.shape)) for v in handle.infos if v.collection == "params")
        resident = [session.put(x, "x"), session.put(dy, "dy")]
        x_ref, dy_ref = (session.send(t, [], name) for t, name in zip(resident, ("x", "dy")))

        def step(update):
            request = pb.ForwardBackwardRequest(layer_id=handle.layer_id, deterministic=True, apply_update=update,
                                                return_dx=False, return_grads=False)
            if args.fp8:
                request.autocast.CopyFrom(recipe_lib.autocast_proto(recipe_lib.AutocastState(True, recipe),
                                                                    client_lib.recipe_pb2))
            mb = request.micro_batches.add()
            mb.x.CopyFrom(x_ref)
            mb.dy.CopyFrom(dy_ref)
            return session.call("ForwardBackward", request)

        times = {}
        for update in (False, True, False, True):
            for _ in range(3):
                step(update)
            start = time.perf_counter()
            for _ in range(args.iters):
                response = step(update)
            times.setdefault(update, []).append((time.perf_counter() - start) * 1000 / args.iters)
        assert response.update.applied and response.update.count > 0
        plain, train = min(times[False]), min(times[True])
        # AdamW in place: params read + written, grads read, mu and nu read + written (bf16 each).
        floor_ms = n_params * 2 * (2 + 1 + 2 + 2) / (args.bandwidth_tbs * 1e12) * 1e3
        print("params %d (bf16)%s" % (n_params, ", FP8 DelayedScaling" if args.fp8 else ""))
        print("ForwardBackward %.2f ms; with AdamW's update %.2f ms; update %.2f ms (floor %.2f ms at %.2f TB/s)" % (
            plain, train, train - plain, floor_ms, args.bandwidth_tbs))
        for t in resident:
            session.delete(t)
    client.close()


if __name__ == "__main__":
    main()
