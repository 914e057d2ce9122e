"""count_results.py over a hand-made bazel-testlogs and log: per-case counts for
targets that ran, one failure for a target that did not, never a stale result."""
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def junit(cases):
    """A test.xml with (name, failed) cases."""
    body = "".join(
        f'<testcase classname="T" name="{name}" status="run">'
        + ('<failure message="boom"/>' if failed else "") + "</testcase>"
        for name, failed in cases)
    return f'<?xml version="1.0"?><testsuites><testsuite name="T">{body}</testsuite></testsuites>'


class CountResultsTest(unittest.TestCase):
    def count(self, log, xmls):
        with tempfile.TemporaryDirectory() as root:
            testlogs = os.path.join(root, "bazel-testlogs")
            for target, text in xmls.items():
                folder = os.path.join(testlogs, target[2:].replace(":", "/"))
                os.makedirs(folder)
                with open(os.path.join(folder, "test.xml"), "w") as f:
                    f.write(text)
            log_path = os.path.join(root, "bazel.log")
            with open(log_path, "w") as f:
                f.write(log)
            done = subprocess.run(
                [sys.executable, os.path.join(HERE, "count_results.py"), testlogs, log_path],
                capture_output=True, text=True)
            return done.returncode, done.stdout

    def test_cases_of_targets_that_ran(self):
        rc, out = self.count("//a:one_test    PASSED in 1.0s\n//a:two_test    FAILED in 2.0s\n",
                             {"//a:one_test": junit([("x", False), ("y", False)]),
                              "//a:two_test": junit([("z", False), ("w", True)])})
        self.assertIn("FAILED: //a:two_test T.w", out)
        self.assertTrue(out.rstrip().endswith("3 passed, 1 failed"), out)
        self.assertEqual(rc, 1)

    def test_a_target_that_did_not_run_is_one_failure_not_its_stale_log(self):
        # An earlier run left a failing test.xml; this run never ran the target.
        rc, out = self.count("//a:one_test    PASSED in 1.0s\n//a:stale_test    NO STATUS\n",
                             {"//a:one_test": junit([("x", False)]),
                              "//a:stale_test": junit([("old", True), ("older", False)])})
        self.assertNotIn("T.old", out)
        self.assertIn("FAILED: //a:stale_test (NO STATUS)", out)
        self.assertTrue(out.rstrip().endswith("1 passed, 1 failed"), out)
        self.assertEqual(rc, 1)

    def test_all_passed(self):
        rc, out = self.count("//a:one_test    (cached) PASSED in 1.0s\n",
                             {"//a:one_test": junit([("x", False)])})
        self.assertTrue(out.rstrip().endswith("1 passed, 0 failed"), out)
        self.assertEqual(rc, 0)


if __name__ == "__main__":
    unittest.main()
