"""A pytest plugin (tests/conftest.py loads it): a test skipped for any reason but a missing
GPU fails. A module-level importorskip of a test dependency that setup forgot once hid the
checkpoint suite from CI for weeks; now it is a red run."""
import re

import pytest

# The only reasons a test may skip: the machine lacks a GPU, a second GPU or a GPU generation.
ALLOWED_SKIP = re.compile(r"\b(GPUs?|CUDA|sm_?\d+)\b", re.IGNORECASE)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def fail_unless_allowed_skip(report) -> None:
    """A skip whose reason is not a missing GPU becomes a failure saying why."""
    if report.skipped and not hasattr(report, "wasxfail") and not ALLOWED_SKIP.search(skip_reason(report)):
        report.outcome = "failed"
        report.longrepr = (f"Skipped for a reason other than a missing GPU: {skip_reason(report)}. "
                           "Only GPU tests may skip (a skipped test is a missing test).")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    fail_unless_allowed_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield  # (a module-level importorskip skips at collection)
    fail_unless_allowed_skip(outcome.get_result())
