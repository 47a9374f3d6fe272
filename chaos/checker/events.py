"""The history's events in time order, indexed by kind at the first question (`Events`).

A module of its own: a subclass of `list`, which mypyc compiles only as a class of the
interpreter's (`chaos.compiled` leaves this module out), while `context` and the
invariants that ask it are compiled."""

from __future__ import annotations

from collections.abc import Iterable
from operator import itemgetter
from typing import Any


class Events(list[dict]):
    """Events in time order that answer `of` from an index by kind, built at the first
    question (the checks ask the same lists for the same kinds hundreds of times a run)
    and again after the list grew. Each answer is a fresh list (callers extend them)."""

    __slots__ = ("_index",)

    def __init__(self, events: Iterable[dict] = ()) -> None:
        super().__init__(events)
        # (length indexed, events by kind, their positions, answers about several kinds)
        self._index: _Index | None = None

    def of(self, kinds: tuple[str, ...]) -> list[dict]:
        index = self._index
        if index is None or index[0] != len(self):
            by_kind: dict[Any, list[dict]] = {}
            at: dict[Any, list[int]] = {}
            for i, e in enumerate(self):
                ev = e.get("ev")
                got = by_kind.get(ev)
                if got is None:
                    by_kind[ev], at[ev] = [e], [i]
                else:
                    got.append(e)
                    at[ev].append(i)
            index = self._index = (len(self), by_kind, at, {})
        if len(kinds) == 1:
            return list(index[1].get(kinds[0], ()))
        merged = index[3].get(kinds)
        if merged is None:  # the kinds' own lists put back in order: no scan of the whole
            by_kind, at = index[1], index[2]
            pairs = [
                p for k in set(kinds) if k in by_kind for p in zip(at[k], by_kind[k], strict=True)
            ]
            pairs.sort(key=itemgetter(0))  # positions are unique: no two events compared
            merged = index[3][kinds] = [e for _, e in pairs]
        return list(merged)


#: `Events`' index: its length when built, events by kind, their positions, and the
#: answers to questions about several kinds.
_Index = tuple[int, dict[Any, list[dict]], dict[Any, list[int]], dict[tuple[str, ...], list[dict]]]
