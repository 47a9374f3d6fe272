"""Scenario files: what `python -m chaos run|validate` reads.

A scenario names the plans to submit, how the fake agent and the engine behave, the faults
to inject, the invariants to check and the budgets a run must stay within. It is YAML (read
with `yaml.safe_load` only), validated whole before anything starts, and every way a file
can be wrong ends in one `ScenarioError` line naming the file, the field path and what was
expected, ready for the CLI to print:

    scenarios/x.yaml: faults[2].action: expected one of kill_worker, ...; got 'explode'

A small example (every field but `name` and the plans has a default; `scenarios/schema.json`
is the JSON Schema, generated from the models of `schema.py` by `write_schema`):

    name: crash_after_ack
    seed: 7                       # every random draw of the run comes from it
    plan: plans/tiny.yaml         # shorthand for plans: [{path: ..., evaluations: ...}]
    evaluations: 3
    agent: {error_rate: 0.2}      # engine.agent.AgentProfile.from_dict; seed defaults to 7
    workers: 2
    faults:
      - failpoint: after_ack      # armed inside the worker processes
        action: crash
        workers: all
      - at_s: 1.5                 # a runner fault: SIGKILL worker 1 at 1.5 s, restart 0.5 s later
        action: kill_worker
        target: 1
    invariants: [no_completed_rerun, all_terminal]
    budgets: {max_reruns: 4}

Plan paths are resolved against the scenario file's directory first, then the current
directory. Runner times (`at_s`, `random_at_s`, `every_s`, `restart_after_s`,
`deadline_s`) are seconds of the run's wall clock: `time_scale` scales the engine's own
delays (retry tiers, agent latency), not them. `budgets.max_retry_latency_s` is in engine
time (before `time_scale`), so it reads like the retry tiers whatever the scale.

What `validate` accepts, `run` runs: every number is bounded by what the engine holds (the
bounds of engine.policy, which the worker's flags meet too: 64-bit seeds, no lease or
retry wait that outlives the 7-day state keys, finite floats), a key given twice in one
mapping is an error (engine.yamlfile), and each plan file is listed once with a plan id
of its own, since a run's attemptIds are made of plan ids.

One file a role: `schema.py` (the models, their bounds and checks), `messages.py` (a
pydantic error as one line), `loading.py` (reading a file and its plans), `loaded.py` (what
runs are made of a loaded scenario), `faults.py` (the fault plan both runners carry out)
and `published.py` (the JSON Schema).
"""

from chaos.scenario.faults import EventTriggers, PlannedFault, fault_schedule
from chaos.scenario.loaded import LoadedScenario, Submission
from chaos.scenario.loading import (
    expected_refusal,
    load_scenario,
    refusal_problem,
    scenario_from_dict,
)
from chaos.scenario.published import SCHEMA_PATH, schema_text, write_schema
from chaos.scenario.schema import (
    INVARIANT_NAMES,
    LINK_ACTIONS,
    LINKS,
    RULELESS_FAILPOINTS,
    RUNNER_ACTIONS,
    WORKER_ACTIONS,
    FailpointFault,
    RunnerFault,
    Scenario,
    ScenarioError,
)

__all__ = [
    "INVARIANT_NAMES",
    "LINKS",
    "LINK_ACTIONS",
    "RULELESS_FAILPOINTS",
    "RUNNER_ACTIONS",
    "SCHEMA_PATH",
    "WORKER_ACTIONS",
    "EventTriggers",
    "FailpointFault",
    "LoadedScenario",
    "PlannedFault",
    "RunnerFault",
    "Scenario",
    "ScenarioError",
    "Submission",
    "expected_refusal",
    "fault_schedule",
    "load_scenario",
    "refusal_problem",
    "scenario_from_dict",
    "schema_text",
    "write_schema",
]
