"""Scenarios in the simulator: the runner and the checker of `chaos`, on `sim`'s world.

    from chaos.scenario import load_scenario
    from chaos.insim import run_scenario, outputs
    outcome = run_scenario(load_scenario("scenarios/crash_after_ack.yaml"), seed=7)
    outcome.result.ok, outcome.history_hash
    outputs(outcome, "out/sim/crash_after_ack")

`sim` simulates the world (the services, the network, the clock, the worker processes,
running the engine's own core and shell) and knows nothing of scenarios; this package
carries a scenario's fault plan out there (`run.py`), applies mutants the way
`chaos.mutants` does live (`mutants.py`) and judges the history with `chaos.checker`.
"""

from chaos.insim.run import SimOutcome, outputs, run_scenario
from sim.world import SimOptions

__all__ = ["SimOptions", "SimOutcome", "outputs", "run_scenario"]
