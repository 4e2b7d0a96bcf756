import collections
import os

import pytest

# CPU tests run on 8 fake host devices; this must happen before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked slow (CI runs the full suite)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="slow: `pytest --full` runs it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """One line per distinct skip reason, with its count (not one per test)."""
    reasons = collections.Counter()
    for rep in terminalreporter.stats.get("skipped", []):
        if isinstance(rep.longrepr, tuple):
            reasons[rep.longrepr[2].removeprefix("Skipped: ")] += 1
    if reasons:
        terminalreporter.write_sep("-", f"{sum(reasons.values())} skipped")
        for reason, n in reasons.most_common():
            terminalreporter.write_line(f"{n:4d}  {reason[:150]}")
