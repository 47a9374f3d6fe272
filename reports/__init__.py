"""Reports: what faults cost, read from the journals and histories of runs (live or
simulated): retry latency per level, recovery time, duplicated LLM cost by cause, plotted.

    python -m chaos report RUN_DIR... [--out DIR] [--price-per-1k USD]
"""

from reports.build import build_report
from reports.runs import ReportError, Run, find_runs

__all__ = ["ReportError", "Run", "build_report", "find_runs"]
