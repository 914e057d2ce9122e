"""kernel_trace_diff.py on two hand-made traces whose per-kernel differences are known."""
import gzip
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))

# A: a GEMM of 2 ms twice and a band kernel of 5 ms; B: the same GEMMs and a
# cast of 1 ms. A - B: band +5 ms, cast -1 ms, GEMM 0.
TRACE_A = """kind,name,start_ns,end_ns,stream,correlation
kernel,nvjet_gemm,0,2000000,7,1
kernel,nvjet_gemm,3000000,5000000,7,2
kernel,RelativeBandKernel,6000000,11000000,7,3
memcpy,memcpy_kind1_4194304B,0,500000,7,4
"""
TRACE_B = """kind,name,start_ns,end_ns,stream,correlation
kernel,nvjet_gemm,0,2000000,7,1
kernel,nvjet_gemm,3000000,5000000,7,2
kernel,CastKernel,6000000,7000000,7,3
"""


class DiffTest(unittest.TestCase):
    def test_differences_largest_first(self):
        with tempfile.TemporaryDirectory() as folder:
            a, b = os.path.join(folder, "a.csv.gz"), os.path.join(folder, "b.csv")
            with gzip.open(a, "wt") as f:
                f.write(TRACE_A)
            with open(b, "w") as f:
                f.write(TRACE_B)
            out = subprocess.run([sys.executable, os.path.join(HERE, "kernel_trace_diff.py"), a, b],
                                 check=True, capture_output=True, text=True).stdout
        kernel = out.split("== memcpy")[0].splitlines()
        self.assertIn("== kernel: A 9.0 ms, B 5.0 ms", kernel[0])
        self.assertIn("RelativeBandKernel", kernel[1])   # +5 first
        self.assertIn("+5.0", kernel[1])
        self.assertIn("CastKernel", kernel[2])           # then -1
        self.assertIn("-1.0", kernel[2])
        self.assertIn("      4.0      2 |       4.0      2 |      +0.0  nvjet_gemm", kernel[3])
        self.assertIn("+0.5  memcpy_kind1_4194304B", out)


if __name__ == "__main__":
    unittest.main()
