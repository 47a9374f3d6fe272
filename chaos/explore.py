"""Exploration and shrinking in the simulator: many seeds, then the smallest failing case.

Swarm testing (Groce et al.): each seed does not only replay the scenario with other
random draws, it also draws *which* faults take part and where, within the scenario's
bounds: every fault is kept or left out on a coin flip, a failpoint fires on a hit drawn
up to twice the scenario's, a timed fault at a time drawn around the scenario's. Runs that
leave faults out reach states that the full schedule masks.

A failing seed is then shrunk, Hypothesis-style, on concrete data: the variant's faults
are first made explicit (every repetition and random draw written out), then removed one
at a time, then made earlier and smaller, then the run itself made smaller (fewer
evaluations, fewer workers), keeping each step only if the same invariant still breaks
under the same seed. The result is written as a scenario file that `chaos run` replays,
in the simulator and live.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import gc
import itertools
import multiprocessing
import os
import random
import signal
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from chaos.lifetime import die_with_parent
from chaos.scenario import LoadedScenario, ScenarioError, fault_schedule, scenario_from_dict
from chaos.scenario.schema import TARGETED_ACTIONS
from engine.policy import MAX_SEED
from reports.measure import measure as measure_cost

if TYPE_CHECKING:
    from chaos.cluster import ClusterSession


@dataclass(frozen=True)
class SeedResult:
    seed: int
    ok: bool
    failed: tuple[str, ...]  # invariants (and "budgets", "exercised") that failed
    history_hash: str = ""
    message: str = ""
    crashed: int = 0  # `crash` events: did an armed failpoint fire?
    unknown: tuple[str, ...] = ()  # invariants that judged nothing (or a broken history)
    measures: dict[str, Any] | None = None  # what faults cost (`reports.sweep.measure`)


@dataclass
class Exploration:
    results: list[SeedResult] = field(default_factory=list)

    @property
    def failures(self) -> list[SeedResult]:
        return [r for r in self.results if not r.ok]


# --- scenario documents ---------------------------------------------------------------------


def document(loaded: LoadedScenario, plan_dir: Path | None = None) -> dict[str, Any]:
    """The scenario as a plain document, plan paths absolute (or relative to `plan_dir`)."""
    data = loaded.spec.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    data["seed"] = loaded.spec.seed
    data.pop("plan", None)
    data.pop("evaluations", None)
    plans = []
    for (plan, count), path in zip(loaded.plans, loaded.plan_paths, strict=True):
        where = Path(path).resolve()
        shown = os.path.relpath(where, plan_dir) if plan_dir is not None else str(where)
        plans.append({"path": shown, "evaluations": count})
        _ = plan
    data["plans"] = plans
    return data


def load_document(data: dict[str, Any], source: str = "<variant>") -> LoadedScenario:
    return scenario_from_dict(copy.deepcopy(data), source=source)


#: Variants already validated in this process, by `_variant_key`: a scenario has few
#: (crash_after_ack: seven), and validating one costs as much as a tenth of its run.
_variants: dict[tuple[Any, ...], LoadedScenario] = {}
_VARIANTS_KEPT = 256


def load_variant(data: dict[str, Any]) -> LoadedScenario:
    """`load_document` of a seed's variant, validated and its plans read once per process
    for every seed that draws the same variant: each other seed gets a copy with its own
    seed (the spec's, the agent profile's and the retry policy's, which are all that the
    seed changes of a loaded scenario; no check of the document reads it)."""
    key = _variant_key(data)
    if key is None:
        return load_document(data)
    seed = data["seed"]
    known = _variants.get(key)
    if known is None:
        known = load_document(data)
        if len(_variants) >= _VARIANTS_KEPT:
            _variants.pop(next(iter(_variants)))
        _variants[key] = known
        return known
    if known.spec.seed == seed:
        return known
    spec = known.spec.model_copy(update={"seed": seed})
    # `spec.agent_profile()`, without validating the same profile again: the seed is the
    # scenario's unless `agent` sets its own
    agent = known.agent if "seed" in spec.agent else dataclasses.replace(known.agent, seed=seed)
    return dataclasses.replace(known, spec=spec, agent=agent, retry_policy=spec.retry_policy())


def _variant_key(data: dict[str, Any]) -> tuple[Any, ...] | None:
    """The document without its seed, and what its plan files are now (an edited file is
    another variant); None where only `load_document` can tell (an odd seed or plan
    entry: it says what is wrong)."""
    seed = data.get("seed")
    plans = data.get("plans")
    if type(seed) is not int or not 0 <= seed <= MAX_SEED or "plan" in data:
        return None
    if not isinstance(plans, list) or not plans:
        return None
    try:
        cwd = os.getcwd()  # where a relative plan path is looked for
    except OSError:  # removed under us
        return None
    files = []
    for ref in plans:
        path = ref.get("path") if isinstance(ref, dict) else None
        if not isinstance(path, str):
            return None
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        files.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    # repr, not JSON: it tells 1 from 1.0 and True, a tuple from a list, NaN from None
    doc = repr({k: v for k, v in data.items() if k != "seed"})
    return (doc, cwd, tuple(files))


def swarm(data: dict[str, Any], seed: int) -> dict[str, Any]:
    """This seed's variant of the scenario: which faults, and where, within its bounds."""
    rng = random.Random(f"swarm:{seed}")
    out = _copied(data, {})
    faults = []
    for fault in out.get("faults", []):
        if rng.random() < 0.5:
            continue
        if "failpoint" in fault:
            fault["hit"] = rng.randint(1, 2 * int(fault.get("hit", 1)))
        elif "at_s" in fault:
            at = float(fault["at_s"])
            fault["at_s"] = round(rng.uniform(0.5 * at, 1.5 * at), 3)
        if int(fault.get("count", 1)) > 1:
            fault["count"] = rng.randint(1, int(fault["count"]))
        faults.append(fault)
    out["faults"] = faults
    # a drawn hit or trigger may never come: whether a fault fires is chance, not a promise
    exercised = out.get("exercised")
    if isinstance(exercised, dict):
        exercised.pop("faults_fired", None)
    left_out = out.get("not_checked")
    left_out = left_out if isinstance(left_out, list) else []
    # (a shrunk regression scenario lists it already: twice is an invalid scenario)
    out["not_checked"] = left_out if "faults_fired" in left_out else [*left_out, "faults_fired"]
    _swarm_services(out, rng)
    out["seed"] = seed
    return out


#: What `_copied` shares rather than copies, as `copy.deepcopy` does: immutable leaves.
_ATOMS = frozenset({str, int, float, bool, type(None)})


def _copied(value: Any, memo: dict[int, Any]) -> Any:
    """`copy.deepcopy(value, memo)`, its dicts and lists copied here (an object met twice,
    a YAML alias, is copied once, as there; `value` outlives `memo`, so its ids stay its
    own): every seed copies the scenario's document, and deepcopy's dispatch cost a
    sixtieth of a seed."""
    t = type(value)
    if t in _ATOMS:
        return value
    if t is dict:
        done = memo.get(id(value))
        if done is None:
            done = memo[id(value)] = {}
            for k, v in value.items():
                done[k if type(k) is str else copy.deepcopy(k, memo)] = _copied(v, memo)
        return done
    if t is list:
        done = memo.get(id(value))
        if done is None:
            done = memo[id(value)] = []
            done.extend([_copied(v, memo) for v in value])
        return done
    return copy.deepcopy(value, memo)


def _swarm_services(out: dict[str, Any], rng: random.Random) -> None:
    """The scenario's broker and Redis faults (`broker:`, `redis:`) take part like the
    others: each kept on a coin flip, at a strength drawn up to the scenario's. Drawn after
    the faults, so a scenario without them keeps the variants it always had."""
    for section, key in (
        ("broker", "consumer_timeout_s"),
        ("broker", "dead_letter_loss"),
        ("redis", "lose_last_writes"),
    ):
        settings = out.get(section)
        if not isinstance(settings, dict) or not settings.get(key):
            continue
        value = settings[key]
        if rng.random() < 0.5:
            del settings[key]
        elif key == "lose_last_writes":
            settings[key] = rng.randint(1, int(value))
        elif key == "dead_letter_loss":
            settings[key] = round(rng.uniform(0.5 * value, value), 3)
        else:  # a timeout: around the scenario's, never below the schema's floor
            settings[key] = round(max(0.1, rng.uniform(0.5 * value, 1.5 * value)), 3)
        if not settings:
            del out[section]


#: A runner fault's fields that `concrete` writes out per firing, as drawn.
_DRAWN_FIELDS = frozenset(
    {
        "at_s",
        "random_at_s",
        "after",
        "count",
        "every_s",
        "target",
        "restart_after_s",
        "pause_s",
        "name",
    }
)
#: The actions whose firing may restart what it stopped (`restart_after_s`).
RESTARTED_ACTIONS = frozenset(
    {
        "kill_worker",
        "restart_worker",
        "kill_redis",
        "kill_broker",
        "stop_redis",
        "stop_broker",
        "kill_sentinel",
    }
)


def concrete(data: dict[str, Any]) -> dict[str, Any]:
    """The same run with every runner fault written out: one entry per firing, times and
    targets as drawn from the seed. A shrinker can then drop one firing without shifting
    the random draws of the others."""
    loaded = load_document(data)
    seed = loaded.spec.seed
    out = copy.deepcopy(data)
    faults = out.get("faults", [])
    kept = [f for f in faults if "failpoint" in f]
    for planned in fault_schedule(loaded.spec, random.Random(seed)):
        # what the firing does as the fault says it (a network fault's link, workers,
        # toxic and for_s); when and on what, as drawn
        entry: dict[str, Any] = {
            k: v for k, v in faults[planned.fault].items() if k not in _DRAWN_FIELDS
        }
        if planned.action in TARGETED_ACTIONS:
            entry["target"] = planned.target
        if planned.action in RESTARTED_ACTIONS:
            entry["restart_after_s"] = planned.restart_after_s  # None: never restarted
        if planned.pause_s is not None:
            entry["pause_s"] = planned.pause_s
        if planned.at_s is not None:
            entry["at_s"] = planned.at_s  # exact: a rounded kill lands elsewhere
        else:
            assert planned.after is not None
            entry["after"] = planned.after.model_dump(mode="json", exclude_none=True)
        kept.append(entry)
    for i, fault in enumerate(kept):
        fault["name"] = f"fault{i}"
    out["faults"] = kept
    return out


# --- running --------------------------------------------------------------------------------


Simulate = Callable[[dict[str, Any], str | None], SeedResult]


def simulate(data: dict[str, Any], mutant: str | None = None, measure: bool = False) -> SeedResult:
    """One simulated run of a scenario document (`measure`: with what its faults cost)."""
    from chaos.insim import run_scenario

    seed = int(data.get("seed", 0))
    try:
        loaded = load_variant(data)
    except ScenarioError as exc:
        # The harness drew a variant it cannot load: a bug of the explorer, never a pass.
        return SeedResult(seed, False, ("invalid_variant",), message=f"invalid variant: {exc}")
    outcome = run_scenario(loaded, seed=seed, mutant=mutant)
    result = outcome.result
    failed = [k for k, v in result.verdicts.items() if v == "fail"]
    if result.budget_failures:
        failed.append("budgets")
    if result.exercise_failures:  # the scenario judged less than it promised
        failed.append("exercised")
    first = (
        result.violations[0].message
        if result.violations
        else "; ".join(result.budget_failures + result.exercise_failures)
    )
    crashed = sum(1 for e in outcome.history if e["ev"] == "crash")
    unknown = tuple(k for k, v in result.verdicts.items() if v == "unknown")
    measures = None
    if measure:
        # the figures the checker recorded for this seed: the one definition
        measures = measure_cost(outcome.history, loaded.spec.time_scale, result.stats, mutant)
    return SeedResult(
        seed, result.ok, tuple(failed), outcome.history_hash, first, crashed, unknown, measures
    )


def _one(args: tuple[dict[str, Any], int, str | None, bool]) -> SeedResult:
    data, seed, mutant, measure = args
    result = simulate(swarm(data, seed), mutant, measure)
    if _SEEDS_ONLY:
        # the seed's cycles (generators, events, their callbacks) collected as it ends,
        # while they are still in the cache and before the next seed's allocations pile
        # on them: a young collection every twenty seeds or so traversed them cold
        gc.collect(1)
    return result


def explore(
    data: dict[str, Any],
    seeds: Iterable[int],
    jobs: int = 0,
    mutant: str | None = None,
    on_result: Callable[[SeedResult], None] | None = None,
    measure: bool = False,
    cluster: ClusterSession | None = None,
) -> Exploration:
    """Run every seed's swarm variant, on `jobs` processes (0: every core), or on a Dask
    `cluster` (`chaos.cluster.connect`; `jobs` unused): the same results in the same order
    either way; `measure`: each seed also says what its faults cost (`chaos sim --report`)."""
    if cluster is not None:
        from chaos.cluster import explore_on

        return explore_on(cluster, data, seeds, mutant, on_result, measure)
    exploration = Exploration()
    work = ((data, seed, mutant, measure) for seed in seeds)
    for r in map_processes(_one, work, jobs, chunksize=16):
        exploration.results.append(r)
        if on_result:
            on_result(r)
    return exploration


def map_processes(
    fn: Callable[[Any], Any], work: Iterable[Any], jobs: int = 0, chunksize: int = 1
) -> Iterator[Any]:
    """`fn(item)` for each item of `work`, in its order, on `jobs` processes (0: every
    core; 1: in this one): the pool every local simulation goes through (seeds, the
    failpoints of `--all-failpoints`), marked for `chaos clean` and abandoned whole on an
    interrupt, an error or a caller that stops reading."""
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        yield from map(fn, work)
        return
    # Spawned, not forked: only an exec puts the owner mark where a /proc scan sees it.
    context = multiprocessing.get_context("spawn")
    resource_tracker.ensure_running()  # started unmarked: it must outlive a sweep
    pool = ProcessPoolExecutor(jobs, context, initializer=_pool_worker, initargs=(os.getpid(),))
    try:
        with _marked_spawns():  # map() submits every chunk, so it starts every process
            results = pool.map(fn, work, chunksize=chunksize)
        yield from results
    except BaseException:
        _abandon(pool)  # an interrupt or an error: never wait for thousands of queued seeds
        raise
    pool.shutdown()


@contextlib.contextmanager
def _marked_spawns() -> Iterator[None]:
    """Processes spawned inside carry the stack's marker and owner variables, so that an
    interrupt, the next `chaos run` or `chaos clean` finds them even if this process was
    SIGKILLed; SIGINT is blocked meanwhile, so a terminal's Ctrl-C (it reaches the whole
    process group) finds them ignoring it (`_pool_worker`): the parent alone handles it.
    They load the compiled checker when a build of this source exists (`chaos.compiled`)."""
    # imported here: the pool's processes, which import this module, never need it
    from chaos.compiled import BUILD_ENV, wanted
    from chaos.stack import MARKER_ENV, OWNER_ENV, owner_token

    saved = {k: os.environ.get(k) for k in (MARKER_ENV, OWNER_ENV, BUILD_ENV)}
    os.environ[MARKER_ENV] = f"pool-{uuid.uuid4().hex}"
    os.environ[OWNER_ENV] = owner_token()
    build = wanted()
    if build is None:
        os.environ.pop(BUILD_ENV, None)
    else:
        os.environ[BUILD_ENV] = str(build)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # last: a pending SIGINT lands


def _pool_worker(parent: int) -> None:
    """In each pool process: Ctrl-C is the parent's business, and the process dies with its
    parent (Linux `PR_SET_PDEATHSIG`) rather than wait forever on a queue nobody feeds."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent(parent)
    tune_for_seeds()


#: Whether this process runs seeds and nothing else (`tune_for_seeds`): `_one` then
#: collects each seed's garbage as the seed ends.
_SEEDS_ONLY = False


@functools.cache
def tune_for_seeds() -> None:
    """A process that runs seeds and nothing else (the pool's, a cluster's worker), tuned
    once (a second call does nothing): each seed's simulation is a graph of generators and
    events that dies whole at its end; with the default threshold (a young collection every
    700 allocations) its live objects are traversed many times over before that, and the
    imports' at each full collection: 4 % of a seed's instructions (callgrind). Imported,
    collected and frozen once, then collected every 10,000 allocations and at each seed's
    end (`_one`). A caller's process (`jobs=1`) keeps its settings."""
    import chaos.checker.shared
    import chaos.insim.run  # (what every seed runs: frozen with the rest)

    global _SEEDS_ONLY
    chaos.checker.shared.ALLOWED = False  # a long seed's check: each core has a process
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)
    _SEEDS_ONLY = True


def _abandon(pool: ProcessPoolExecutor) -> None:
    """Drop the queued work and SIGKILL the pool's processes (a seed is pure computation:
    nothing is lost), then reap them."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        with contextlib.suppress(OSError, ValueError):
            proc.kill()
    for proc in processes:
        with contextlib.suppress(OSError, ValueError, AssertionError):
            proc.join(5.0)


# --- shrinking ------------------------------------------------------------------------------


#: Runs a batch of documents under a mutant, results in their order (`chaos.cluster.simulate_on`).
SimulateMany = Callable[[list[dict[str, Any]], str | None], list[SeedResult]]


@dataclass
class ShrinkStats:
    """What a shrink cost: `decisive` counts the simulations its decisions took (a batch's
    candidates up to the first one kept; the same number however the candidates were run),
    `run` those run, a batch's candidates after the one kept too."""

    decisive: int = 0
    run: int = 0


def shrink(
    data: dict[str, Any],
    invariant: str,
    mutant: str | None = None,
    run: Simulate = simulate,
    budget: int = 200,
    run_many: SimulateMany | None = None,
    width: int = 1,
    stats: ShrinkStats | None = None,
) -> dict[str, Any]:
    """The smallest variant (fewest faults, earliest, smallest run) that still breaks
    `invariant` under the same seed.

    Greedy: each round keeps the first candidate of `_smaller` (in its order) that still
    breaks it, and starts again from there. `run_many` runs `width` candidates of a round
    at once (on a cluster: `chaos.cluster.simulate_on`); the first of them in order that
    still fails is kept, those after it were run for nothing, and the budget is counted as
    if they had been run one by one, so the result is the one `run` gives, whatever the
    width. Without `run_many`, candidates are run one by one with `run`."""
    stats = stats if stats is not None else ShrinkStats()
    if run_many is None:
        width = 1
    many: SimulateMany = run_many or (lambda documents, m: [run(d, m) for d in documents])
    if invariant != "exercised":
        # The minimum case counts speak of the full run; a smaller one judges fewer cases.
        data = {k: v for k, v in data.items() if k != "exercised"}

    def first_failing(candidates: list[dict[str, Any]]) -> int | None:
        """Index of the first candidate that still breaks `invariant` (None: none does)."""
        results = many(candidates, mutant)
        stats.run += len(candidates)
        for i, result in enumerate(results):
            if invariant in result.failed:
                stats.decisive += i + 1
                return i
        stats.decisive += len(candidates)
        return None

    best = concrete(data)
    if first_failing([best]) is None:  # the written-out schedule must break it too
        best = copy.deepcopy(data)
    improved = True
    while improved and stats.decisive < budget:
        improved = False
        valid = (c for c in _smaller(best) if _loads(c))
        while stats.decisive < budget:
            chunk = list(itertools.islice(valid, min(width, budget - stats.decisive)))
            if not chunk:
                break
            kept = first_failing(chunk)
            if kept is not None:
                best, improved = chunk[kept], True
                break
    return best


def _loads(candidate: dict[str, Any]) -> bool:
    """Whether a shrink candidate is a valid scenario (one that is not is skipped, unrun)."""
    try:
        load_document(candidate)
    except ScenarioError:
        return False
    return True


def _smaller(data: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Candidates one step smaller than `data`, the biggest steps first."""
    faults = data.get("faults", [])
    for i in range(len(faults)):
        out = copy.deepcopy(data)
        del out["faults"][i]
        yield out
    for i, fault in enumerate(faults):
        for key, smaller in (("hit", _halves), ("at_s", _earlier), ("count", _halves)):
            if key in fault:
                for value in smaller(fault[key]):
                    out = copy.deepcopy(data)
                    out["faults"][i][key] = value
                    yield out
    for section in ("broker", "redis"):  # the broker's and Redis's own faults, off
        if data.get(section):
            out = copy.deepcopy(data)
            del out[section]
            yield out
    for j, plan in enumerate(data.get("plans", [])):
        if plan.get("evaluations", 1) > 1:
            for value in _halves(plan["evaluations"]):
                out = copy.deepcopy(data)
                out["plans"][j]["evaluations"] = value
                yield out
    if data.get("workers", 1) > 1:
        for value in _halves(data["workers"]):
            out = copy.deepcopy(data)
            out["workers"] = value
            yield out


def _halves(n: int) -> list[int]:
    """Smaller values, the smallest first: 1, half, one less."""
    n = int(n)
    return sorted({1, n // 2, n - 1} - {n, 0}) if n > 1 else []


def _earlier(t: float) -> list[float]:
    t = float(t)
    return [v for v in (0.0, round(t / 2, 3)) if v < t]


def write_regression(data: dict[str, Any], folder: Path, name: str, description: str) -> Path:
    """Write a shrunk variant as a scenario file, its plan paths relative to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    out = copy.deepcopy(data)
    out["name"] = name
    out["description"] = description
    for plan in out.get("plans", []):
        path = Path(plan["path"])
        if path.is_absolute():
            plan["path"] = os.path.relpath(path, folder)
    path = folder / f"{name}.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(yaml.safe_dump(out, sort_keys=False), encoding="utf-8")
    os.replace(tmp, path)
    return path
