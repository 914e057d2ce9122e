"""kernel_trace_report.py on a hand-made trace whose busy time, idle and gaps are known."""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

# Two steps, each between the ends of two cudaStreamSynchronize calls:
# step 1 spans 1000..2000 ns with kernels 1100-1400 and 1500-1900 (busy 700,
# idle 300: a 100 ns start gap, a 100 ns gap before the GEMM, 100 at the end);
# step 2 spans 2000..3000 with one kernel 2000-3000 (busy 1000, no idle).
TRACE = """kind,name,start_ns,end_ns,stream,correlation
runtime,cudaStreamSynchronize_v3020,900,1000,1,1
kernel,te::cuda::NormForwardKernel<te::cuda::BF16>,1100,1400,7,2
runtime,cudaLaunchKernel_v7000,1420,1490,1,3
kernel,nvjet_sm90_tst_128x128_gemm,1500,1900,7,3
runtime,cudaStreamSynchronize_v3020,1900,2000,1,4
kernel,cudnn_generated_fort_native_sdpa_sm90_flash_fprop,2000,3000,7,5
runtime,cudaStreamSynchronize_v3020,2990,3000,1,6
"""


class ReportTest(unittest.TestCase):
    def run_report(self, *args, trace=TRACE):
        with tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False) as f:
            f.write(trace)
        try:
            return subprocess.run([sys.executable, os.path.join(HERE, "kernel_trace_report.py"),
                                   f.name, *args], check=True, capture_output=True,
                                  text=True).stdout
        finally:
            os.unlink(f.name)

    def test_busy_and_idle_of_both_steps(self):
        out = self.run_report("--steps", "2", "--min-gap-us", "0")
        # Per step on average: wall 1000 ns, busy 850, idle 150.
        self.assertIn("step wall 0.001 ms, device busy 0.001 ms (0.850 of the step)", out)
        self.assertIn("steps: 2 (the last of 2)", out)

    def test_classes_and_gap_attribution(self):
        out = self.run_report("--steps", "1", "--min-gap-us", "0")
        self.assertIn("(1.000 of the step)", out)  # the last step alone: no idle
        lines = self.run_report("--steps", "2", "--min-gap-us", "0").splitlines()
        for label in ("attention (cuDNN)", "gemm", "norm"):
            self.assertTrue(any(l.strip().startswith(label) for l in lines), label)
        # The gap before the GEMM is attributed to it, with the launch made in it.
        self.assertTrue(any("0.5  nvjet_sm90_tst_128x128_gemm" in l for l in lines))
        self.assertTrue(any("cudaLaunchKernel" in l for l in lines))

    def test_timeline_lists_the_busiest_reported_step_in_order(self):
        out = self.run_report("--steps", "2", "--timeline")
        _, body = out.split("the busiest reported step")
        self.assertTrue(body.startswith(" (the 2. from the end)"), body[:40])
        rows = body.splitlines()[1:]
        # Step 1 (two kernels against step 2's one): 0.1 us idle before each.
        self.assertEqual(len(rows), 2)
        self.assertEqual(rows[0].split()[:3], ["0.1", "0.3", "norm"])
        self.assertEqual(rows[1].split()[:3], ["0.1", "0.4", "gemm"])
        # Step 2 alone: the cuDNN kernel, no idle before it, 1.0 us long.
        rows = self.run_report("--steps", "1", "--timeline").split("the busiest reported step")[1]
        rows = rows.splitlines()[1:]
        self.assertEqual(len(rows), 1)
        self.assertEqual(rows[0].split()[:3], ["0.0", "1.0", "attention"])
        self.assertIn("sdpa_sm90_flash_fprop", rows[0])
        out = self.run_report("--steps", "2")
        self.assertNotIn("launch order", out)

    def test_step_starts_spans_a_pipelined_step_between_its_first_kernels(self):
        # Two steps that each start with an embedding lookup, with a
        # synchronisation in the middle of each (a pipelined loop's loss
        # read): by synchronisations the steps would be halves.
        trace = """kind,name,start_ns,end_ns,stream,correlation
kernel,te::cuda::EmbedForwardKernel<F32>,1000,1100,7,1
runtime,cudaEventSynchronize_v3020,1000,1500,2,2
kernel,nvjet_sm90_tst_128x128_gemm,1200,1800,7,3
kernel,te::cuda::EmbedForwardKernel<F32>,2000,2100,7,4
runtime,cudaEventSynchronize_v3020,2000,2500,2,5
kernel,nvjet_sm90_tst_128x128_gemm,2100,2900,7,6
kernel,te::cuda::EmbedForwardKernel<F32>,3000,3100,7,7
"""
        out = self.run_report("--steps", "2", "--min-gap-us", "0", "--step-starts",
                              "EmbedForwardKernel", trace=trace)
        # Step 1: 1000..2000, busy 700 (a 100 ns gap before the GEMM, 200 at
        # its end); step 2: 2000..3000, busy 900 (100 at its end).
        self.assertIn("steps: 2 (the last of 2)", out)
        self.assertIn("(0.800 of the step)", out)
        self.assertIn("2 kernels per step", out)
        self.assertIn("(end of step: the next EmbedForwardKernel)", out)
        by_sync = self.run_report("--steps", "2", "--min-gap-us", "0", trace=trace)
        self.assertIn("1 kernels per step", by_sync)
        with self.assertRaises(subprocess.CalledProcessError):
            self.run_report("--step-starts", "NoSuchKernel", trace=trace)

    def test_a_wait_spanning_several_gaps_counts_once(self):
        # One step (between two embedding lookups) with two 100 ns gaps, both
        # inside one 400 ns cudaEventSynchronize (a pipelined loop's wait on
        # the last step's loss): 200 ns of it inside gaps, one call.
        trace = """kind,name,start_ns,end_ns,stream,correlation
kernel,te::cuda::EmbedForwardKernel<F32>,1000,1100,7,1
runtime,cudaEventSynchronize_v3020,1050,1450,2,2
kernel,nvjet_sm90_tst_128x128_gemm,1200,1300,7,3
kernel,nvjet_sm90_tst_128x128_gemm,1400,1500,7,4
kernel,te::cuda::EmbedForwardKernel<F32>,1500,1600,7,5
"""
        out = self.run_report("--steps", "1", "--min-gap-us", "0", "--step-starts",
                              "EmbedForwardKernel", trace=trace)
        _, body = out.split("runtime API time inside those gaps")
        row = next(l for l in body.splitlines() if "cudaEventSynchronize" in l)
        self.assertEqual(row.split()[:2], ["0.000", "1.0"])  # 200 ns; one call, not two

    def test_memsets_name_the_call_and_the_next_kernel_of_their_thread(self):
        # Step 1 given a 4-byte memset (thread 1's cudaMemsetAsync) just
        # before that thread launches the GEMM: a library's own memset.
        trace = TRACE.replace(
            "runtime,cudaLaunchKernel_v7000,1420,1490,1,3\n",
            "runtime,cudaMemsetAsync_v3020,1402,1408,1,9\n"
            "memset,memset_4B,1410,1418,7,9\n"
            "runtime,cudaLaunchKernel_v7000,1420,1490,1,3\n")
        out = self.run_report("--steps", "2", trace=trace)
        _, body = out.split("memsets and memcpys (per step)")
        rows = body.splitlines()[1:]
        self.assertEqual(len(rows), 1, body)
        self.assertEqual(rows[0].split(), ["0.5", "memset_4B", "cudaMemsetAsync",
                                           "nvjet_sm90_tst_128x128_gemm"])
        # Outside the reported step (the last alone), nothing is listed.
        _, body = self.run_report("--steps", "1", trace=trace).split("memsets and memcpys")
        self.assertEqual(body.splitlines()[1:], [])

    def test_by_kernel_splits_each_class_by_name(self):
        # A second norm kernel in step 1, so the norm class has two names.
        trace = TRACE.replace(
            "runtime,cudaLaunchKernel_v7000,1420,1490,1,3\n",
            "kernel,te::cuda::NormBackwardKernel<te::cuda::BF16>,1400,1500,7,8\n"
            "runtime,cudaLaunchKernel_v7000,1420,1490,1,3\n")
        out = self.run_report("--steps", "2", "--by-kernel", "1", trace=trace)
        _, body = out.split("costliest kernels")
        rows = body.split("idle gaps")[0].splitlines()[1:]
        # The norm class (400 ns over 2 steps) lists only its costlier kernel:
        # the forward, 300 ns, 0.5 launches a step.
        norm = rows.index("  norm")
        self.assertEqual(rows[norm + 1].split()[1:], ["0.5", "NormForwardKernel<BF16>"])
        self.assertNotIn("NormBackwardKernel", body.split("idle gaps")[0])
        self.assertNotIn("costliest kernels", self.run_report("--steps", "2"))

    def test_largest_gap_lists_the_host_calls_in_it_by_thread(self):
        out = self.run_report("--steps", "2", "--min-gap-us", "0", "--largest-gap")
        self.assertIn("the last reported step has no idle gap", out)  # step 2 is all busy
        # Step 2 given a 400 ns gap (2000..2400) in which thread 9 launches
        # twice and thread 1 sets memory once (not a synchronisation, which
        # would end a step).
        trace = TRACE.replace(
            "kernel,cudnn_generated_fort_native_sdpa_sm90_flash_fprop,2000,3000,7,5\n",
            "runtime,cudaLaunchKernel_v7000,2100,2110,9,10\n"
            "runtime,cudaLaunchKernel_v7000,2200,2230,9,11\n"
            "runtime,cudaMemsetAsync_v3020,2300,2310,1,12\n"
            "kernel,cudnn_generated_fort_native_sdpa_sm90_flash_fprop,2400,2900,7,5\n")
        out = self.run_report("--steps", "2", "--min-gap-us", "0", "--largest-gap", trace=trace)
        _, body = out.split("longest idle gap: ")
        self.assertTrue(body.startswith("0.4 us, ended by cudnn_generated"), body[:60])
        rows = [r.split() for r in body.splitlines()[1:] if r.strip()]
        self.assertEqual(rows[0], ["0.1", "9", "2x", "0.0", "cudaLaunchKernel_v7000"])
        self.assertEqual(rows[1][1:3], ["1", "1x"])
        self.assertEqual(rows[1][4], "cudaMemsetAsync_v3020")


if __name__ == "__main__":
    unittest.main()
