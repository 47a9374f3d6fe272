"""What stops a scenario without a verdict: the harness's own failures, one line each."""

from __future__ import annotations


class HarnessError(RuntimeError):
    """The harness itself failed in a scenario (a fault injector could not carry out its
    fault): the scenario has no verdict. One line says why; the run goes on to the next."""


class RunRefused(ValueError):
    """The scenario cannot run in this mode or on this system (a kill fault against a shared
    service, a service the design does not have)."""
