"""Reports: what faults cost, read from the journals and histories of runs (live or
simulated): retry latency per level, recovery time, duplicated LLM cost by cause, plotted.

    python -m chaos report RUN_DIR... [--out DIR] [--price-per-1k USD]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reports.build import build_report
    from reports.runs import ReportError, Run, find_runs

__all__ = ["ReportError", "Run", "build_report", "find_runs"]

#: Imported when first asked for: the checker reads `reports.cost`, `reports.latency` and
#: `reports.measure` (the one definition of each figure) without the plots' matplotlib.
_LAZY = {
    "build_report": "reports.build",
    "ReportError": "reports.runs",
    "Run": "reports.runs",
    "find_runs": "reports.runs",
}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'reports' has no attribute {name!r}")
