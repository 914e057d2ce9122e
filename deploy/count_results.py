#!/usr/bin/env python3
"""Counts test cases from Bazel's test.xml files and prints 'N passed, N failed'.

A test target that failed without a test.xml of its own (it failed to build,
crashed, or timed out) counts as one failure, so nothing is silently dropped.
Exit status: 0 when nothing failed and something ran, else 1.
"""
import os
import re
import sys
import xml.etree.ElementTree as ET


def main(testlogs, log_path):
    log = open(log_path, errors="replace").read() if os.path.exists(log_path) else ""
    # Targets Bazel reported in this run, with their outcome.
    outcomes = dict(re.findall(r"^(//\S+)\s+(?:\(cached\)\s+)?(PASSED|FAILED TO BUILD|FAILED|TIMEOUT|NO STATUS|FLAKY)", log, re.M))
    passed = failed = 0
    for target, outcome in sorted(outcomes.items()):
        target_ok = outcome in ("PASSED", "FLAKY")
        xml = os.path.join(testlogs, target[2:].replace(":", "/"), "test.xml")
        cases_passed = cases_failed = 0
        if os.path.exists(xml) and outcome != "FAILED TO BUILD":
            try:
                for case in ET.parse(xml).getroot().iter("testcase"):
                    if case.find("failure") is not None or case.find("error") is not None:
                        cases_failed += 1
                        print(f"FAILED: {target} {case.get('classname')}.{case.get('name')}")
                    elif case.get("status", "run") == "run" and case.find("skipped") is None:
                        cases_passed += 1
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
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
