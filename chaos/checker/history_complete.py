"""`history_complete`: the history holds every event its sources recorded. Every line of
the file parsed (the runner keeps an unreadable line as a `history_unreadable` event; one
on the file's last line is a write torn by a kill, the one allowed exception), and each
source's `seq` runs 1, 2, ... with no gap and no repeat. Where the history is incomplete,
every verdict that reads it is "unknown", never "pass" (see `chaos.checker.check`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from chaos.checker.context import Context, Outcome, as_int, listed, timeline
from chaos.checker.records import Violation

NAME = "history_complete"
#: The event `engine.history.read_history(..., keep_unreadable=True)` leaves for a line
#: that does not parse.
UNREADABLE = "history_unreadable"


def _first_break(counts: Mapping[int, int]) -> tuple[int, str] | None:
    """The first seq at which a source's numbering breaks, and how. A source restarted
    under the same name numbers from 1 again, so with c[s] the events numbered s, an
    unbroken history has c[1] >= c[2] >= ... >= c[max] >= 1."""
    prev = 0
    for s in sorted(counts):  # as many steps as distinct numbers, whatever their size
        if s != prev + 1:
            return prev + 1, f"seq {prev + 1} is missing"
        if prev and counts[s] > counts[prev]:
            return s, f"seq {s} appears {counts[s]} time(s) but seq {prev} {counts[prev]}"
        prev = s
    return None


def check_history_complete(cx: Context) -> Outcome:
    """One case per unreadable line and per source whose events carry a `seq` (a
    hand-built history without any is not judged). A violation per unreadable line other
    than the last, per source with a gap or a repeat, per source with events lacking a
    `seq` among numbered ones."""
    out: list[Violation] = []
    cases = 0
    torn = 0
    by_src: dict[str, list[dict]] = defaultdict(list)
    for e in cx.events:
        if e.get("ev") == UNREADABLE:
            cases += 1
            if e.get("last") is True:
                torn += 1
                continue
            out.append(
                Violation(
                    NAME,
                    "-",
                    None,
                    f"history line {e.get('line')} does not parse and is not the last line: "
                    f"{str(e.get('text', ''))[:60]!r}",
                    timeline([e], cx.events),
                )
            )
            continue
        by_src[str(e.get("src", ""))].append(e)
    gaps = 0
    for src, evs in sorted(by_src.items()):
        numbered: list[dict] = []
        unnumbered: list[dict] = []
        counts: dict[int, int] = {}  # events numbered s, by s
        for e in evs:
            s = as_int(e.get("seq"), 0)
            if s >= 1:
                numbered.append(e)
                counts[s] = counts.get(s, 0) + 1
            else:
                unnumbered.append(e)
        if not numbered:
            continue
        cases += 1
        if unnumbered:
            out.append(
                Violation(
                    NAME,
                    "-",
                    None,
                    f"{len(unnumbered)} event(s) of {src} carry no seq: "
                    f"{listed(sorted({str(e.get('ev')) for e in unnumbered}), 3)}",
                    timeline(unnumbered[:6], numbered),
                )
            )
        broken = _first_break(counts)
        if broken is None:
            continue
        gaps += 1
        s, how = broken
        near = [e for e in numbered if s - 2 <= as_int(e.get("seq")) <= s + 1]
        out.append(
            Violation(
                NAME,
                "-",
                None,
                f"{src}'s history breaks at seq {s}: {how}; events of {src} may be lost",
                timeline(near),
            )
        )
    cx.stats.update(history_sources=len(by_src), history_torn_lines=torn, history_gaps=gaps)
    return cases, out
