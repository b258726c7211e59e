"""A pytest plugin for scripts/e2b-suite.sh: E2B's own test files run unchanged; this only records each test's
outcome and, in the second phase, keeps the tests that need a server and skips the ones named with a reason.

Env: CLADE_SUITE_OUT (JSON file of {nodeid: [outcome, reached]} written at the end; `reached`: a failure that
came from trying E2B's own servers, *.e2b.app, which is what the first phase runs without), CLADE_SUITE_ONLY
(a file of nodeids: run only these), CLADE_SUITE_SKIP (a JSON file of {"nodeid prefix": "reason"})."""

import json
import os

import pytest

_outcomes = {}


def _is_worker(config):
    return hasattr(config, "workerinput")


def pytest_collection_modifyitems(config, items):
    only_file = os.environ.get("CLADE_SUITE_ONLY")
    if only_file:
        with open(only_file) as f:
            only = {line.strip() for line in f if line.strip()}
        keep = [i for i in items if i.nodeid in only]
        dropped = [i for i in items if i.nodeid not in only]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    skip_file = os.environ.get("CLADE_SUITE_SKIP")
    if skip_file:
        with open(skip_file) as f:
            skips = json.load(f)
        for item in items:
            for prefix, reason in skips.items():
                if item.nodeid.startswith(prefix):
                    item.add_marker(pytest.mark.skip(reason=reason))
                    break


def _reached(report):
    return report.failed and ("e2b.app" in str(report.longrepr) or "e2b.dev" in str(report.longrepr))


def pytest_runtest_logreport(report):
    # setup failures count as failures, a skip at setup as a skip; the call decides otherwise.
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes[report.nodeid] = [report.outcome, _reached(report)]
    elif report.when == "teardown" and report.outcome == "failed" and _outcomes.get(report.nodeid, [""])[0] == "passed":
        _outcomes[report.nodeid] = ["failed", _reached(report)]


def pytest_collectreport(report):
    if report.outcome == "failed":
        _outcomes[report.nodeid + "::(collection)"] = ["failed", False]


def pytest_sessionfinish(session):
    out = os.environ.get("CLADE_SUITE_OUT")
    if out and not _is_worker(session.config):
        with open(out, "w") as f:
            json.dump(_outcomes, f, indent=1, sort_keys=True)
