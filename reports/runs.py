"""The runs a report reads: each scenario run's `journal.json` and `history.jsonl`, as
`python -m chaos run` (live or `--mode sim`) writes them."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.history import read_history
from reports.history import sort_key


class ReportError(ValueError):
    """A path that holds no run, or a run that cannot be read: one line, which and why."""


@dataclass(frozen=True)
class Run:
    """One scenario run: its journal and its history, in time order."""

    path: Path  # the folder of `journal.json`
    journal: dict[str, Any]
    history: list[dict[str, Any]]

    @property
    def scenario(self) -> str:
        return str(self.journal.get("scenario") or self.path.name)

    @property
    def mode(self) -> str:
        return str(self.journal.get("mode") or "live")

    @property
    def extra(self) -> dict[str, Any]:
        extra = self.journal.get("extra")
        return extra if isinstance(extra, dict) else {}

    @property
    def settings(self) -> dict[str, Any]:
        """The scenario's timing settings the run recorded (`time_scale`, `tiers_ms`,
        `heartbeat_ms`, `stale_ms`, `sweep_ms`, `sweeper`); empty for older runs."""
        settings = self.extra.get("settings")
        return settings if isinstance(settings, dict) else {}

    @property
    def label(self) -> str:
        seed = self.extra.get("seed")
        mutant = self.extra.get("mutant")
        parts = [self.scenario, self.mode]
        if seed is not None:
            parts.append(f"seed {seed}")
        if mutant:
            parts.append(f"mutant {mutant}")
        return " · ".join(parts)


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Every run under `paths`: a run's folder, or a folder of runs (`chaos run --out`), in
    the order given, then by name."""
    runs: list[Run] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise ReportError(f"{path}: no such file or directory")
        if path.is_file():
            path = path.parent
        journals = [path / "journal.json"] if (path / "journal.json").is_file() else []
        journals += sorted(p for p in path.glob("*/journal.json"))
        if not journals:
            raise ReportError(
                f"{path}: expected a run folder (with journal.json) or a folder of runs"
            )
        runs += [load_run(j.parent) for j in journals]
    return runs


def load_run(folder: Path) -> Run:
    try:
        journal = json.loads((folder / "journal.json").read_text())
    except (OSError, ValueError) as exc:
        raise ReportError(f"{folder / 'journal.json'}: not a readable journal ({exc})") from None
    if not isinstance(journal, dict):
        raise ReportError(f"{folder / 'journal.json'}: expected a JSON object")
    history_path = folder / "history.jsonl"
    if not history_path.is_file():
        raise ReportError(f"{history_path}: missing (the report reads each run's history)")
    history = sorted(read_history(history_path), key=sort_key)
    return Run(folder, journal, history)


@contextlib.contextmanager
def written_whole(out: Path) -> Iterator[Path]:
    """A temporary folder beside `out` to write a report into; it replaces `out` whole once
    the block ends, and is removed if the block fails: nothing is left half-written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".report-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
