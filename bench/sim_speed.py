"""Speed of the simulator, as ratios against simpy's raw event rate measured in this run.

    python bench/sim_speed.py [--seeds 10000] [--jobs 0]
    python bench/sim_speed.py --against /tmp/before [--rounds 5] [--seeds 10000] [--jobs 0]
    python bench/sim_speed.py --cluster local:2 [--rounds 5] [--seeds 10000]
    python bench/sim_speed.py --compiled-ab [--rounds 5] [--seeds 10000]

Prints: simpy's raw rate (a process yielding timeouts, nothing else), simulated evaluations
per second of the example plan under faults (one process), the seeds per second of
`chaos sim` on a one-evaluation, 13-rule scenario with a crash (every core), and the time
10,000 such seeds take (target: at most 15 s on 2 cores, issue 30's; issue 9's was 20 s),
measured whole by default: what `chaos sim --seeds 10000` waits for, its pool's start-up
(spawned processes importing the harness) paid once. With another `--seeds`, the time is
projected from it, the start-up (measured apart, one seed a process) counted once.

With `--against`, another checkout (an export of the commit before a change) runs the
same seeds too, each round a fresh interpreter on each checkout in turn (the order
alternating), and the median rates are compared: the cost of a change measured on the
same machine in the same minutes. On this shared machine rates drift by half within
minutes, so read the ratio of medians, never one round.

With `--compiled-ab`, this checkout's compiled checker (`python -m chaos compile`) against
its source (`CHAOS_COMPILED=0`), rounds interleaved the same way. Without it, the bench
runs the checker as explorations do: compiled when this source is built (the first line
says which).

With `--cluster local:W` (or a scheduler's tcp:// address), the same seeds on the Dask
cluster (`chaos sim --cluster`) against `--jobs W` processes, rounds interleaved the same
way, each a fresh interpreter: seeds/s measured whole (the LocalCluster's start, version
check and close counted, as the pool's start-up is) and once connected; the goal is a
ratio of at least 0.9 measured whole. Figures: docs/cluster.md.

Where it stands (2026-12-02, 08:32 to 08:40 UTC, a quiet machine, load 0.3 to 2, with the
checker's cuts below and the engine's shell and core cuts of `bench/rules_per_second.py`
merged): two plain runs took 15.4 s and 13.9 s for 10,000 seeds measured whole (651 and 720
seeds/s; the pool's start-up 0.42 s); `--against` the session's starting commit 1203731, 5
rounds of 10,000 seeds: median 575 against 475 seeds/s (1.21x), 17.4 s against 21.1 s
(rounds 407 to 614 seeds/s here, 404 to 519 there; a first run of 3 rounds, the host
noisier, gave 424 against 468, rounds 404 to 717 against 367 to 485: read several rounds'
medians, never one). Target met: at most 20 s.

2026-12-02, commit 54c8d50 against this one (`--against`, 2 processes), on a busy 2-core
machine (other engineers' test runs, load average 1 to 7): 2,000 seeds, 7 rounds, median
278 against 234 seeds/s (ratio 1.19, rounds 1.04 to 1.37), and again 227 against 197 (1.15,
rounds 0.97 to 1.40); 10,000 seeds measured whole, 3 rounds: 25.1 s against 28.6 s (1.14).
Deterministic, under callgrind (one process, 100 seeds after 20): 23.1 M instructions a
seed against 26.6 M (1.15x), 22.3 M with the pool processes' garbage-collector settings
(1.19x). What went: validating each seed's variant and reading its plan again (6 % of a
seed; a scenario has few variants), the agent calls the fault-free reference drew a second
time, the checker's event lists rebuilt at each question, young-generation collections
traversing each seed's live simulation many times over, and redis-py in the pool's start-up
(0.8 to 0.7 s; the simulator uses no client). Not reached: at 03:50 the same day, quiet,
54c8d50 printed 29.6 s (338 seeds/s), and 10,000 seeds measured whole took 25.1 s here on
the busy machine. Later that day, on the same machine quiet
(load average under 0.3, nothing else running), with the Sentinel models of the day
merged in too, `--against` 54c8d50, 5 rounds of 2,000 seeds, twice: median 441 against 364
seeds/s (1.21x; projected 22.7 s against 27.5 s) and 450 against 401 (1.12x; 22.2 s against
24.9 s); the plain run printed 25.1 s, 23.2 s with the start-up counted once. Where a seed's
time goes now (py-spy, one process): about half the
simulated run (simpy, the engine's shell generators, `sim/`), a quarter the checker (no
invariant above 4 % of a seed), a twentieth the reference (the engine's core alone), the
rest the run's set-up and the history's hash. Left to gain there: the engine's shell and
core (frozen dataclasses built per effect and action, a sixteenth of the run) and the
checker's invariants, each a few per cent.

2026-12-02, second session (branch simfast against 1203731): the default is 10,000 seeds
measured whole (it was 2,000 times five, which counted the pool's start-up, about 0.4 s,
five times: that morning, quiet, 1203731 printed 481 seeds/s, "20.8 s", 19.2 s with the
start-up once). Deterministic, under callgrind (one process, 100 seeds after 20): 22.8 M
instructions a seed before, 20.8 M after (-8.8 %), all of it in the checker and the
reference: the invariants every seed runs over every (evaluation, rule) pair read its
events in one pass instead of asking the index kind by kind (no_completed_rerun,
idempotent_results, attempts_monotonic, retry_budget, pass_results_correct, rounds),
reruns_explained works out deaths and fault windows only once a rule ran twice, the
context indexes the history with fewer lookups, and the reference's cache key is what it
reads (seed, policy, agent settings, max_parallel, plans), not the scenario as JSON.
Histories, verdicts, stats and evidence are the same on every shipped scenario (30 seeds
each), under every mutant (12 seeds of four scenarios) and on 300 seeds of
crash_after_ack. On the morning's quiet figure this projects 18.8 s x 0.912 + 0.4 s =
17.5 s for 10,000 seeds. Measured at 08:11 to 08:16 on a busy machine (other helpers'
test runs, load average 2.4 to 4.4), not a quiet one: `--against` 1203731, 5 rounds of
10,000 seeds, median 493 against 465 seeds/s (1.06; 20.3 s against 21.5 s), the rounds
0.43 to 1.58 apart, the two best of this checkout 566 and 558 seeds/s (17.7 and 17.9 s)
against 550 (18.2 s); the plain run printed 23.2 s (431 seeds/s), start-up 0.41 s. The
quiet-machine figure is still to be taken. Also: reruns_explained scanned an evaluation's whole
history for each unexplained rerun, quadratic on a long one: a seed of
transient_llm_errors under reset_attempts_on_recovery (115,000 events) took 148 s to
check, 12 s now (bisection). Tried, no gain: the garbage collector off altogether (21.42 M
against 21.40 M: with the pool's settings it costs nothing now); one shared default
`SimOptions`. Where a seed's time goes now (py-spy, one process): the engine's shell and
core about 40 % (`Evaluation._advance` 7 % with the reference's share, frozen dataclasses'
`__init__` 4.5 %, `FakeAgent.draw` 4 %, `Stepper.advance` 2.5 % of its own), simpy 8 %,
`sim/` about 20 %, the checker about 20 %, the set-up (`SimRun`, the seed's variant) 5 %,
the history's hash 2.4 %; the pool's start-up (0.4 s) is a fortieth of a 10,000-seed run.

2026-12-02, third session (branch simq against f790e26): under callgrind (one process, the
slope between 40 and 160 seeds of `_ROUND`), 18.39 M instructions a seed before, 17.57 M
after (-4.5 %): swarm's document copy without deepcopy's dispatch, pass_results_correct
reading only the three kinds it needs, the final state's TTLs in one look a key, no salt
generator seeded without a mutant, no retry policy built twice a seed, and `Record`
effects without a keyword dict. Histories, verdicts and evidence the same on 200 seeds of
four scenarios and under every mutant. What is left is flat: sha256 of the history (1.9 %
of a seed: the hash is the evidence, kept), seeding the seed's four `random.Random`
(0.6 %), simpy, and the checker's invariants at 1 to 3 % each, every one a single pass.

2026-12-06 (issue 30, item 0; a slower host than 12-02's: simpy's raw rate 640k to 700k
events/s): callgrind (one process, the slope between 40 and 140 seeds of the bench
scenario after 30) found a seed at 32.5 M instructions, against 18.2 M at 8f0766c (12-02):
the simulated run made the same calls (the same simpy steps to 8 %), the checker cost three
times as much (the invariants added since: history_well_formed, the leases, the sessions
of cancel_respected and reruns_explained, each over the whole history, several asking for
the same sessions, deaths and fault windows). Cut to 26.3 M (-19 %): the sessions, deaths
and fault windows worked out once a history, a session's death found once, not once an
event, a well-formed event judged by one compiled check per kind, questions about several
kinds answered from the index. `--against` the session's start (3 rounds of 4,000 seeds,
a quiet host): median 246 against 200 seeds/s (1.23x); two plain runs 40.7 s and 41.6 s
for 10,000 seeds (245 and 241 seeds/s), history events / raw simpy 0.018 and 0.016; 8f0766c
ran 425 seeds/s in the same minutes (23.5 s). Verdicts, cases, stats and violations the
same on every shipped scenario (6 seeds) and every mutant (2 seeds of four scenarios).
Issue 30's goals are not met: 0.05x raw simpy, 10,000 seeds in 15 s. Where a seed goes
now (cProfile, relative): the simulated run a bit over half (simpy's steps, the shell's
`Stepper.advance`, the orchestrator's generators, simulated Redis), the checker a little
under two fifths, spread over thirty invariants (history_well_formed the largest at 7 %),
each a pass of its own; what is left to gain is one pass over the history feeding every
invariant, and fewer simpy events a store call (two timeouts each now).

2026-12-06, later (a quiet host, simpy's raw rate 1.44 to 1.50 M events/s): 19.8 and 20.5
s for 10,000 seeds (0.014 to 0.015x the raw rate), the pool's start-up 0.44 to 0.49 s
(0.58 s before: a process without a mutant imports no `chaos.mutants`, so none of the live
worker and its clients). A store call's landing that schedules its reply itself (one
resumption of the caller fewer) kept the histories and gained nothing measurable: 26 calls
a seed. bench/README.md has the day's figures; neither goal is met.

2026-12-07 (a slow host, simpy's raw rate 546k to 782k events/s): the checker compiled with
mypyc (`python -m chaos compile`): 22.16 M instructions a seed against 25.24 M (callgrind,
-12.2 %), `--compiled-ab` 1.15x seeds/s (3 rounds of 4,000), the same judgement everywhere
(tests/test_compiled.py). Projected on the quiet host's 16.6 s: about 14.6 s; measured the
same evening on a quiet host, 20.7 and 20.9 s, `--compiled-ab` 1.076x (bench/README.md).
Left as source by design: `sim/` (the mutants patch its classes, which a compiled class
refuses) and the engine (what is simulated must be what runs live).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from chaos import compiled  # noqa: E402  (first: before any module of the checker)

#: The checker as explorations run it: compiled when this source was (`chaos compile`)
#: and `CHAOS_COMPILED` is not 0, in this process too (the evaluations' rate).
BUILD = compiled.wanted()
if BUILD is not None:
    compiled.activate(BUILD)

import simpy  # noqa: E402

from chaos.explore import document, explore, load_document, swarm  # noqa: E402
from chaos.insim import run_scenario  # noqa: E402
from chaos.scenario import load_scenario  # noqa: E402

#: The target of issue 30: `chaos sim` explores 10,000 seeds in at most 15 s on 2 cores
#: (issue 9's was 20 s).
TARGET_SEEDS = 10_000
TARGET_S = 15.0


def simpy_rate(n: int = 300_000) -> float:
    env = simpy.Environment()

    def ticker(env: simpy.Environment) -> object:
        for _ in range(n):
            yield env.timeout(1)

    env.process(ticker(env))
    t0 = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t0)


def evaluations_rate(seconds: float = 3.0) -> tuple[float, float]:
    """Simulated evaluations per second, and history events per second, under faults."""
    names = ["crash_after_ack", "worker_kill_storm", "transient_llm_errors"]
    loaded = [load_scenario(ROOT / "scenarios" / f"{n}.yaml") for n in names]
    evaluations = events = 0
    seed = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for sc in loaded:
            outcome = run_scenario(sc, seed=seed)
            evaluations += len(outcome.attempt_ids)
            events += len(outcome.history)
        seed += 1
    took = time.perf_counter() - t0
    return evaluations / took, events / took


def _bench_document() -> dict:
    data = document(load_scenario(ROOT / "scenarios" / "crash_after_ack.yaml"))
    data["plans"][0]["evaluations"] = 1
    load_document(swarm(data, 0))  # fail here, not in a pool, if the variant is invalid
    return data


def seeds_time(seeds: int, jobs: int) -> float:
    """Seconds `explore` takes over `seeds` seeds, its pool's start-up included (what
    `chaos sim --seeds N` waits for)."""
    data = _bench_document()
    t0 = time.perf_counter()
    explore(data, range(seeds), jobs=jobs)
    return time.perf_counter() - t0


def startup_s(jobs: int) -> float:
    """What a pool costs before its first seed: one seed a process, start-up included."""
    data = _bench_document()
    cores = jobs or os.cpu_count() or 1
    t0 = time.perf_counter()
    explore(data, range(10**6, 10**6 + cores), jobs=jobs)
    return time.perf_counter() - t0


#: One round of `--against`: `seeds_rate` in a fresh interpreter, on the checkout its
#: working directory and PYTHONPATH name (only names every version of chaos.explore has).
_ROUND = """
import sys, time
from pathlib import Path
from chaos.explore import document, explore, load_document, swarm
from chaos.scenario import load_scenario

if __name__ == "__main__":
    seeds, jobs = int(sys.argv[1]), int(sys.argv[2])
    data = document(load_scenario(Path("scenarios") / "crash_after_ack.yaml"))
    data["plans"][0]["evaluations"] = 1
    load_document(swarm(data, 0))
    t0 = time.perf_counter()
    explore(data, range(seeds), jobs=jobs)
    print(seeds / (time.perf_counter() - t0))
"""


def _round(root: Path, seeds: int, jobs: int, switch: str | None = None) -> float:
    """`switch`: `CHAOS_COMPILED` for the round ("0": the checker as source)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    if switch is not None:
        env[compiled.SWITCH_ENV] = switch
    out = subprocess.run(
        [sys.executable, "-c", _ROUND, str(seeds), str(jobs)],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.split()[-1])


#: One round of `--cluster`: connect, explore, close, in a fresh interpreter; seeds/s
#: measured whole and once connected.
_CLUSTER_ROUND = """
import sys, time
from pathlib import Path
from chaos.cluster import connect
from chaos.explore import document, explore, load_document, swarm
from chaos.scenario import load_scenario

if __name__ == "__main__":
    seeds, address = int(sys.argv[1]), sys.argv[2]
    data = document(load_scenario(Path("scenarios") / "crash_after_ack.yaml"))
    data["plans"][0]["evaluations"] = 1
    load_document(swarm(data, 0))
    t0 = time.perf_counter()
    with connect(address) as session:
        t1 = time.perf_counter()
        explore(data, range(seeds), cluster=session)
        t2 = time.perf_counter()
    t3 = time.perf_counter()
    print(seeds / (t3 - t0), seeds / (t2 - t1))
"""


def _cluster_round(seeds: int, address: str) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-c", _CLUSTER_ROUND, str(seeds), address],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=True,
        capture_output=True,
        text=True,
    )
    whole, connected = out.stdout.split()[-2:]
    return float(whole), float(connected)


def _cluster_compare(args: argparse.Namespace) -> int:
    """Rounds alternating `--cluster` and the pool (`--jobs`, by default as many processes
    as `local:W` has workers); the medians and their ratio."""
    address = args.cluster
    jobs = args.jobs or (int(address.removeprefix("local:")) if address.startswith("local:") else 0)
    pool: list[float] = []
    whole: list[float] = []
    connected: list[float] = []
    for i in range(args.rounds):
        for step in ("pool", "cluster") if i % 2 == 0 else ("cluster", "pool"):
            if step == "pool":
                pool.append(_round(ROOT, args.seeds, jobs))
            else:
                w, c = _cluster_round(args.seeds, address)
                whole.append(w)
                connected.append(c)
        print(
            f"round {i + 1}: --cluster {address} {whole[-1]:6.0f} seeds/s "
            f"({connected[-1]:.0f} once connected), --jobs {jobs} {pool[-1]:6.0f}"
        )
    mine, theirs = statistics.median(whole), statistics.median(pool)
    print(
        f"median seeds/s over {args.seeds:,} seeds: --cluster {address} {mine:.0f} "
        f"({statistics.median(connected):.0f} once connected), --jobs {jobs} {theirs:.0f}"
    )
    verdict = "OK" if mine / theirs >= 0.9 else "BELOW GOAL"
    print(f"ratio cluster/jobs: {mine / theirs:.3f} (goal >= 0.9) {verdict}")
    return 0


def _compiled_compare(args: argparse.Namespace) -> int:
    """Rounds alternating the compiled checker and the source (`CHAOS_COMPILED=0`) on this
    checkout, each a fresh process; the medians and their ratio."""
    if compiled.fresh_build() is None:
        print("no build of this source: python -m chaos compile", file=sys.stderr)
        return 2
    on: list[float] = []
    off: list[float] = []
    for i in range(args.rounds):
        order = (("1", on), ("0", off)) if i % 2 == 0 else (("0", off), ("1", on))
        for switch, rates in order:
            rates.append(_round(ROOT, args.seeds, args.jobs, switch))
        print(f"round {i + 1}: compiled checker {on[-1]:6.0f} seeds/s, source {off[-1]:6.0f}")
    mine, theirs = statistics.median(on), statistics.median(off)
    print(f"median seeds/s: compiled {mine:.0f}, source {theirs:.0f}; ratio {mine / theirs:.3f}")
    print(
        f"{TARGET_SEEDS:,} seeds: {TARGET_SEEDS / mine:.1f} s compiled, "
        f"{TARGET_SEEDS / theirs:.1f} s source (the median rounds, start-up included)"
    )
    return 0


def _compare(args: argparse.Namespace) -> int:
    """Rounds alternating this checkout and `--against`, each a fresh process (its pool's
    start-up counted, as in `seeds_rate`); the medians and their ratio."""
    here: list[float] = []
    there: list[float] = []
    other = args.against.resolve()
    for i in range(args.rounds):
        order = ((ROOT, here), (other, there)) if i % 2 == 0 else ((other, there), (ROOT, here))
        for root, rates in order:
            rates.append(_round(root, args.seeds, args.jobs))
        print(f"round {i + 1}: this checkout {here[-1]:6.0f} seeds/s, against {there[-1]:6.0f}")
    mine, theirs = statistics.median(here), statistics.median(there)
    cores = args.jobs or os.cpu_count() or 1
    print(f"median seeds/s on {cores} processes: this {mine:.0f}, {other}: {theirs:.0f}")
    print(f"ratio this/against: {mine / theirs:.3f} ({(mine / theirs - 1) * 100:+.1f} %)")
    verb = "took" if args.seeds == TARGET_SEEDS else "would take"
    print(
        f"{TARGET_SEEDS:,} seeds {verb} {TARGET_SEEDS / mine:.1f} s here, "
        f"{TARGET_SEEDS / theirs:.1f} s there (the median rounds, start-up included)"
    )
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=TARGET_SEEDS, help="seeds a run explores")
    p.add_argument("--jobs", type=int, default=0, help="processes (default: every core)")
    p.add_argument("--against", type=Path, help="another checkout to compare with (A/B)")
    p.add_argument("--rounds", type=int, default=5, help="A/B rounds, with --against")
    p.add_argument("--cluster", help="local:W or tcp://HOST:PORT: against --jobs (A/B)")
    p.add_argument(
        "--compiled-ab", action="store_true", help="the compiled checker against the source"
    )
    args = p.parse_args()
    if args.compiled_ab:
        return _compiled_compare(args)
    if args.against is not None:
        return _compare(args)
    if args.cluster is not None:
        return _cluster_compare(args)
    raw = simpy_rate()
    evals, events = evaluations_rate()
    took = seeds_time(args.seeds, args.jobs)
    startup = startup_s(args.jobs)
    cores = args.jobs or os.cpu_count() or 1
    rate = args.seeds / took
    shown = f"compiled ({BUILD.name})" if BUILD else "source (no build, or CHAOS_COMPILED=0)"
    print(f"the checker:                                      {shown}")
    print(f"simpy raw event rate (timeouts, one process):     {raw:12,.0f} events/s")
    print(f"simulated evaluations under faults (one process): {evals:12,.0f} evaluations/s")
    print(f"  history events recorded:                        {events:12,.0f} events/s")
    print(f"  ratio history events / raw simpy events:        {events / raw:12.3f}")
    print(f"chaos sim seeds, 13-rule scenario, {cores} processes: {rate:10,.0f} seeds/s")
    if args.seeds == TARGET_SEEDS:
        whole = took
        how = f"took {took:.1f} s, measured whole"
    else:  # a run pays its pool's start-up once, whatever its length
        whole = startup + TARGET_SEEDS * max(0.0, took - startup) / args.seeds
        how = f"would take {whole:.1f} s (projected from {args.seeds:,}, start-up once)"
    verdict = "OK" if whole <= TARGET_S else "OVER TARGET"
    print(f"{TARGET_SEEDS:,} seeds {how} (target <= {TARGET_S:.0f} s on 2 cores) {verdict}")
    print(f"  the pool's start-up (one seed a process, measured apart): {startup:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
