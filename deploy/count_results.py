#!/usr/bin/env python3
"""Counts test cases and prints 'N passed, N failed'.

  count_results.py BAZEL_TESTLOGS BAZEL_LOG [JUNIT_XML ...]

Cases come from Bazel's test.xml files (for the targets the log reports) and
from any further JUnit XML files (pytest's --junitxml); a missing JUnit file
counts as one failure.

A test target that failed without a test.xml of its own (it failed to build,
crashed, or timed out) counts as one failure, so nothing is silently dropped;
so does one that did not run (NO STATUS), whatever test.xml an earlier run
left behind.
Exit status: 0 when nothing failed and something ran, else 1.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET


def count_cases(xml_path, label):
    """(passed, failed) test cases of one JUnit XML file."""
    passed = failed = 0
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            failed += 1
            print(f"FAILED: {label} {case.get('classname')}.{case.get('name')}")
            # Why, in a few lines: CI's log keeps this even when a test's own
            # output is too long to show.
            why = (problem.get("message") or problem.text or "").strip()
            for line in why.splitlines()[:12]:
                print(f"    {line[:300]}")
        elif case.get("status", "run") == "run" and case.find("skipped") is None:
            passed += 1
    return passed, failed


def main(testlogs, log_path, junit_paths):
    log = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
    # Targets Bazel reported in this run, with their outcome.
    outcomes = dict(re.findall(r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED TO BUILD|FAILED|TIMEOUT|NO STATUS|FLAKY)", log, re.M))
    passed = failed = 0
    for target, outcome in sorted(outcomes.items()):
        target_ok = outcome in ("PASSED", "FLAKY")
        xml = os.path.join(testlogs, target[2:].replace(":", "/"), "test.xml")
        cases_passed = cases_failed = 0
        # A target that did not run in this invocation (NO STATUS, FAILED TO
        # BUILD) may still have an earlier run's test.xml: not its result.
        if os.path.exists(xml) and outcome not in ("FAILED TO BUILD", "NO STATUS"):
            try:
                cases_passed, cases_failed = count_cases(xml, target)
            except ET.ParseError:
                pass
        if cases_passed + cases_failed == 0:  # no per-case results: count the target
            cases_passed, cases_failed = (1, 0) if target_ok else (0, 1)
        elif not target_ok and cases_failed == 0:  # crashed or timed out after its cases
            cases_failed = 1
        if not target_ok:
            print(f"FAILED: {target} ({outcome})")
        passed += cases_passed
        failed += cases_failed
    for path in junit_paths:
        try:
            p, f = count_cases(path, os.path.basename(path))
        except (OSError, ET.ParseError):
            p, f = 0, 1
            print(f"FAILED: no readable results in {path}")
        passed += p
        failed += f
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
