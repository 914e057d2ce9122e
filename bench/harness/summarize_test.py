"""summarize.py on synthetic OURS / MODULE / PEER / PEERMEM / CEIL lines (no GPU needed)."""
import io
import json
import os
import tempfile
import unittest
from contextlib import redirect_stdout

import summarize

RUN = """\
SETUP GPU: NVIDIA H200
SETUP commit: abc123
CONFIG batch 4 seq 2048 hidden 4096 ffn 16384 heads 32 bf16 causal dropout on warmup 5 iters 20
jax 0.11.2 [CudaDevice(id=0)]
PEER flax_quickstart_baseline 40.400 (seed-style 39.000)
PEER jax_bf16_cudnn_attention 17.200 (seed-style 17.100)
PEER jax_bf16_xla_attention FAILED RuntimeError: something
PEERMEM jax_bf16_cudnn_attention 2273
CEIL bf16 gemm 8192^3: 800 TFLOP/s
CEIL fp8 gemm 8192^3: 1600 TFLOP/s
CEIL d2d copy: 4000 GB/s (read+write)
PEER torch_bf16_eager_sdpa 18.300
OURS v1_flax_bf16 30.000 31.000 5000
MODULE v3_te_unfused_bf16 LayerNorm_0 0.100
MODULE v3_te_unfused_bf16 DenseGeneral_0 5.000
OURS v3_te_unfused_bf16 20.000 25.000 -
OURS v5_te_fused_fp8 - 12.000 -
OURS v6_te_transformer_fp8 10.320 10.500 2100
OURS v7_te_transformer_bf16 FAILED INTERNAL: cuDNN said no
STAGE torch_peers TIMED OUT after 170 s
garbage line that is ignored
"""


class FlopsTest(unittest.TestCase):
    def test_quickstart_flops_match_the_formula(self):
        c = summarize.QUICKSTART
        # ENV.md: the 12 GEMMs of forward + backward are 9.90 TFLOP.
        self.assertEqual(summarize.gemm_flops(c), 3 * 2 * 8192 * 4096 * (3 * 4096 + 4096 + 2 * 16384))
        self.assertAlmostEqual(summarize.gemm_flops(c) / 1e12, 9.90, places=2)
        # Causal attention, forward + backward: 6 * B * H * S^2 * D.
        self.assertEqual(summarize.attention_flops(c), 6 * 4 * 32 * 2048 ** 2 * 128)
        self.assertAlmostEqual(summarize.attention_flops(c) / 1e12, 0.412, places=3)


class ParseTest(unittest.TestCase):
    def test_every_kind_of_line(self):
        run = summarize.parse(RUN.splitlines())
        self.assertEqual(run["ours"]["v6_te_transformer_fp8"], {"server": 10.32, "client": 10.5, "mem": 2100})
        self.assertEqual(run["ours"]["v5_te_fused_fp8"], {"server": None, "client": 12.0, "mem": None})
        self.assertIn("v7_te_transformer_bf16", run["failed"])
        self.assertIn("jax_bf16_xla_attention", run["failed"])
        self.assertNotIn("jax_bf16_xla_attention", run["peers"])
        self.assertEqual(run["peers"]["jax_bf16_cudnn_attention"], 17.2)
        self.assertEqual(run["peer_mem"]["jax_bf16_cudnn_attention"], 2273)
        self.assertEqual(run["ceil"], {"bf16": 800.0, "fp8": 1600.0})
        self.assertEqual(len(run["modules"]["v3_te_unfused_bf16"]), 2)
        self.assertEqual(run["config"]["heads"], 32)
        self.assertEqual(run["setup"], ["GPU: NVIDIA H200", "commit: abc123"])

    def test_config_line_sets_the_sizes(self):
        run = summarize.parse(["CONFIG batch 2 seq 32 hidden 64 ffn 256 heads 4 bf16"])
        self.assertEqual(run["config"], {"batch": 2, "seq": 32, "hidden": 64, "ffn": 256, "heads": 4})


def table_row(report, name):
    for line in report.splitlines():
        if line.startswith(f"| {name} |"):
            return [cell.strip() for cell in line.strip("|").split("|")]
    raise AssertionError(f"no row for {name} in:\n{report}")


class SummarizeTest(unittest.TestCase):
    def setUp(self):
        self.report = summarize.summarize(summarize.parse(RUN.splitlines()))
        c = summarize.QUICKSTART
        self.gemm, self.attn = summarize.gemm_flops(c), summarize.attention_flops(c)

    def test_fp8_row_uses_the_fp8_ceiling_for_gemms(self):
        row = table_row(self.report, "v6_te_transformer_fp8")
        # variant, timed by, ms, TFLOP/s, x floor, x best peer, client ms, client/server, MiB
        self.assertEqual(row[1], "server")
        self.assertEqual(row[2], "10.32")
        self.assertEqual(row[3], f"{(self.gemm + self.attn) / (10.32 * 1e9):.0f}")
        floor_ms = self.gemm / (1600 * 1e9) + self.attn / (800 * 1e9)
        self.assertEqual(row[4], f"{10.32 / floor_ms:.2f}")
        self.assertEqual(row[5], f"{10.32 / 17.2:.2f}")  # best peer: JAX cuDNN, 17.2 ms
        self.assertEqual(row[7], f"{10.5 / 10.32:.3f}")
        self.assertEqual(row[8], "2100")

    def test_bf16_row_uses_the_bf16_ceiling(self):
        row = table_row(self.report, "v1_flax_bf16")
        floor_ms = (self.gemm + self.attn) / (800 * 1e9)
        self.assertEqual(row[4], f"{30.0 / floor_ms:.2f}")

    def test_chain_is_labelled_and_client_only_falls_back(self):
        self.assertEqual(table_row(self.report, "v3_te_unfused_bf16")[1], "server (sum of 2 modules)")
        row = table_row(self.report, "v5_te_fused_fp8")
        self.assertEqual(row[1], "client")
        self.assertEqual(row[2], "12.00")
        self.assertEqual(row[7], "-")

    def test_failures_and_peers_are_rows(self):
        self.assertIn("FAILED INTERNAL: cuDNN said no", table_row(self.report, "v7_te_transformer_bf16")[1])
        self.assertIn("FAILED", table_row(self.report, "jax_bf16_xla_attention")[1])
        self.assertEqual(table_row(self.report, "stage torch_peers")[1], "TIMED OUT after 170 s")
        peer = table_row(self.report, "peer: jax_bf16_cudnn_attention")
        self.assertEqual(peer[5], "1.00")
        self.assertEqual(peer[8], "2273")
        # Peers are listed fastest first.
        self.assertLess(self.report.index("peer: jax_bf16_cudnn_attention"),
                        self.report.index("peer: torch_bf16_eager_sdpa"))

    def test_targets(self):
        self.assertIn(f"- v6_te_transformer_fp8: {10.32 / 17.2:.2f} x the best peer (target <= 0.75): met",
                      self.report)
        self.assertIn("v7_te_transformer_bf16: - x the best peer (target <= 1.0): not measured", self.report)
        self.assertIn("client / server time: 1.017 (target <= 1.03): met", self.report)

    def test_missing_ceiling_falls_back_and_says_so(self):
        lines = [l for l in RUN.splitlines() if not l.startswith("CEIL fp8")]
        report = summarize.summarize(summarize.parse(lines))
        self.assertIn("no CEIL fp8 line in this run", report)
        floor_ms = self.gemm / (1492 * 1e9) + self.attn / (800 * 1e9)
        self.assertEqual(table_row(report, "v6_te_transformer_fp8")[4], f"{10.32 / floor_ms:.2f}")

    def test_no_peers(self):
        report = summarize.summarize(summarize.parse(["OURS v6_te_transformer_fp8 10 11 -"]))
        self.assertIn("Best peer: none measured.", report)
        self.assertEqual(table_row(report, "v6_te_transformer_fp8")[5], "-")


class MultiClientTest(unittest.TestCase):
    def point(self, clients, steps, fairness):
        return {"clients": clients, "steps_per_s": steps, "latency_ms": {"p50": 100.0},
                "fairness": {"slowest_over_fastest": fairness}, "errors": {}}

    def test_throughput_and_fairness_targets(self):
        report = {"layer": "transformer", "op": "forward_backward", "fp8": "delayed",
                  "points": [self.point(8, 96.0, 0.9), self.point(1, 100.0, 1.0)]}
        text = "\n".join(summarize.multi_client_lines(report))
        self.assertIn("8 clients' aggregate throughput / 1 client's: 0.960 (target >= 0.95): met", text)
        self.assertIn("8 clients' slowest / fastest: 0.900 (target >= 0.8): met", text)
        report["points"][0] = self.point(8, 50.0, 0.5)
        text = "\n".join(summarize.multi_client_lines(report))
        self.assertIn("0.500 (target >= 0.95): missed", text)
        self.assertIn("slowest / fastest: 0.500 (target >= 0.8): missed", text)


class MainTest(unittest.TestCase):
    def test_writes_bench_md_under_out(self):
        with tempfile.TemporaryDirectory() as out:
            log = os.path.join(out, "run.txt")
            with open(log, "w") as f:
                f.write(RUN)
            te_bench = os.path.join(out, "te_bench.json")
            with open(te_bench, "w") as f:
                json.dump({"layer": "transformer", "op": "forward_backward", "fp8": "delayed", "points": [
                    {"clients": 1, "steps_per_s": 80.0, "latency_ms": {"p50": 12.0},
                     "fairness": {"slowest_over_fastest": 1.0}, "errors": {}}]}, f)
            old = os.environ.get("OUT")
            os.environ["OUT"] = out
            try:
                stdout = io.StringIO()
                with redirect_stdout(stdout):
                    self.assertEqual(summarize.main([log, "--te_bench_json", te_bench]), 0)
            finally:
                if old is None:
                    del os.environ["OUT"]
                else:
                    os.environ["OUT"] = old
            with open(os.path.join(out, "bench.md")) as f:
                written = f.read()
            self.assertEqual(written, stdout.getvalue())
            self.assertIn("| v6_te_transformer_fp8 |", written)
            self.assertIn("1 clients 80.0 steps/s", written)


if __name__ == "__main__":
    unittest.main()
