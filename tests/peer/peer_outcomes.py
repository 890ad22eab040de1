"""A pytest plugin that writes every test's outcome to ``$TDCKPT_PEER_OUTCOMES`` (JSON lines).

``run_peer.py`` loads it into both runs of tensordict's suite (plain and routed) to compare
them by node id. It routes nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_PATH = "TDCKPT_PEER_OUTCOMES"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(_PATH)
    if not path:
        return
    outcome: str | None = None
    if report.when == "call":
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
    elif report.failed:  # setup / teardown
        outcome = "error"
    elif report.skipped and report.when == "setup":
        outcome = "skipped"
    if outcome is None:
        return
    row: dict[str, Any] = {"node": report.nodeid, "when": report.when, "outcome": outcome}
    if report.failed:
        row["message"] = report.longreprtext.strip().splitlines()[-1:] if report.longrepr else []
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
