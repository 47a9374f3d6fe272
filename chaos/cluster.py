"""`chaos sim --cluster`: seeds explored on a Dask cluster instead of local processes.

What it guarantees, and why:

- The same results as `--jobs`. A seed's result depends only on the scenario document,
  the seed and the mutant (`explore._one` is pure), so a worker anywhere computes the same
  `SeedResult`; they are handed back in seed order, as the process pool's `map` does, and
  `on_result` sees each as its batch comes back (the progress line).
- The same code. A worker that imports another version of the harness would give other
  verdicts under the same seed; at connect time every worker's `fingerprint` (the source of
  `engine`, `sim`, `chaos`, `reports`) must equal ours, and every worker must read the
  scenario's plan files as we do, else nothing runs (one line naming the workers).
- Nothing left behind. Our futures are cancelled and our client closed on every way out
  (Ctrl-C included); the scattered scenario goes with the client. `local:W` starts a
  `LocalCluster` on 127.0.0.1 (no dashboard) whose processes carry the stack's owner mark
  (`explore._marked_spawns`), so an interrupt or `chaos clean` finds them even if this
  process dies, and whose scratch dir is a harness temp dir (`chaos-dask-...`).

Dask is imported here only: `chaos` imports without it (`pip install -e '.[cluster]'`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import math
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from chaos.explore import Exploration, SeedResult, _marked_spawns, _one, simulate

#: How long connecting to a scheduler (and its first answer) may take.
CONNECT_TIMEOUT_S = 5.0
#: The packages whose source a worker must share with us (`fingerprint`).
PACKAGES = ("engine", "sim", "chaos", "reports")
_SOURCE_SUFFIXES = (".py", ".sql")
#: The libraries whose version can change a seed's result: the event loop and the validation.
RUNTIME = ("simpy", "pydantic")
#: Batches each worker thread should get (`batch_size`), and the most seeds a batch runs.
BATCHES_PER_THREAD = 4
MAX_BATCH = 200


#: Dask's settings for our LocalCluster's workers (a Nanny hands its config to its worker
#: process): the statistical profiler walks the running seed's stack every 10 ms and the
#: memory monitor reads the process's size every 100 ms, each taking the interpreter lock
#: from the seeds; a seed's memory is freed at its end. A user's `dask worker` takes them
#: as environment variables (docs/cluster.md).
WORKER_SETTINGS = {
    "distributed.worker.profile.enabled": False,
    "distributed.worker.memory.monitor-interval": "1s",
    "distributed.admin.system-monitor.interval": "1s",
}


class ClusterError(RuntimeError):
    """The cluster cannot run the exploration (unreachable, another version of the code,
    Dask missing, lost mid-run): one line, `chaos sim` exits 3."""


@dataclass
class ClusterSession:
    """A connected client, and the `LocalCluster` behind it when `local:W` started one."""

    client: Any  # distributed.Client
    address: str
    local: Any = None  # distributed.LocalCluster, ours to close
    #: Plan files (path, sha256 here) every worker was found to read alike (`check_files`).
    files_checked: set[frozenset[tuple[str, str]]] = field(default_factory=set)

    @property
    def threads(self) -> int:
        """Tasks the cluster runs at once: its workers' threads."""
        return max(1, sum(self.client.nthreads().values()))


def batch_size(seeds: int, threads: int) -> int:
    """Seeds a task runs: `ceil(seeds / (threads x BATCHES_PER_THREAD))` within
    [1, MAX_BATCH]. A task costs the scheduler and the network milliseconds, a seed 1.5 to
    6 ms: one seed a task would spend as much on scheduling as on seeds. Several batches a
    thread keep every worker busy to the end (a slow or late worker takes fewer, the others
    the rest) and the progress line moving; at most 200 seeds (0.3 to 1.2 s of work), since
    the run ends when its last batch does (a worker idles at most one batch) and a lost
    worker's batches are run again; the next task waits on the worker meanwhile, so its
    cost is hidden. A million seeds are then 5,000 tasks, seconds of a scheduler's time."""
    return max(1, min(MAX_BATCH, math.ceil(seeds / (threads * BATCHES_PER_THREAD))))


# --- the version check ----------------------------------------------------------------------


def _package_dirs() -> list[tuple[str, Path]]:
    """Where the imported packages live (this process's, or a worker's, own)."""
    import importlib

    out = []
    for name in PACKAGES:
        module = importlib.import_module(name)
        assert module.__file__ is not None
        out.append((name, Path(module.__file__).resolve().parent))
    return out


def fingerprint(dirs: Iterable[tuple[str, Path]] | None = None) -> str:
    """sha256 over the sorted relative paths and contents of the packages' .py and .sql
    files (caches and bytecode left out), and the versions of Python and of the libraries
    a seed's run goes through (`RUNTIME`): equal only where the same code runs."""
    from importlib import metadata

    digest = hashlib.sha256()
    digest.update(f"python {sys.version_info[0]}.{sys.version_info[1]}\0".encode())
    for dist in RUNTIME:
        digest.update(f"{dist} {metadata.version(dist)}\0".encode())
    for name, root in dirs if dirs is not None else _package_dirs():
        files = sorted(
            p
            for p in root.rglob("*")
            if p.suffix in _SOURCE_SUFFIXES and p.is_file() and "__pycache__" not in p.parts
        )
        for path in files:
            rel = f"{name}/{path.relative_to(root).as_posix()}"
            digest.update(rel.encode() + b"\0")
            digest.update(path.read_bytes())
            digest.update(b"\0")
    return digest.hexdigest()


def file_digests(paths: Iterable[str]) -> dict[str, str]:
    """sha256 of each file as this process reads it ("missing" when it cannot)."""
    out = {}
    for path in paths:
        try:
            out[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            out[path] = "missing"
    return out


def check_versions(session: ClusterSession) -> None:
    """Refuse workers whose code differs from ours (ClusterError naming them)."""
    ours = fingerprint()
    theirs = _run(session, _worker_fingerprint)
    differing = sorted(w for w, f in theirs.items() if f != ours)
    if differing:
        raise ClusterError(
            f"{len(differing)} worker(s) of {session.address} run another version of the "
            f"code (source fingerprint {ours[:12]} here): {', '.join(differing)}"
        )


def check_files(session: ClusterSession, paths: list[str]) -> None:
    """Refuse workers that read the scenario's plan files otherwise than we do (another
    checkout, another path): they would explore another scenario."""
    if not paths:
        return
    ours = file_digests(paths)
    key = frozenset(ours.items())
    if key in session.files_checked:  # a shrink asks each round: once is enough
        return
    theirs = _run(session, file_digests, paths)
    differing = sorted(w for w, d in theirs.items() if d != ours)
    if differing:
        raise ClusterError(
            f"{len(differing)} worker(s) of {session.address} read other plan files than "
            f"{', '.join(paths)}: {', '.join(differing)}"
        )
    session.files_checked.add(key)


def _worker_fingerprint() -> str:
    """`fingerprint` as the worker's own module defines it (looked up there, by name)."""
    import chaos.cluster

    return chaos.cluster.fingerprint()


def _run(session: ClusterSession, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
    """`client.run` on every worker, a lost scheduler said in one line."""
    if not session.client.nthreads():
        raise ClusterError(f"no worker is connected to {session.address}")
    try:
        return dict(session.client.run(fn, *args))
    except (OSError, TimeoutError) as exc:
        raise ClusterError(f"cluster {session.address}: {_first_line(exc)}") from None


# --- connecting -----------------------------------------------------------------------------


def parse_address(text: str) -> tuple[str, int | str]:
    """`local:W` -> ("local", W); `tcp://HOST:PORT` (or another Dask address) as given.
    A ValueError says what is wrong in one line."""
    if text.startswith("local:"):
        count = text.removeprefix("local:")
        if not count.isdigit() or not 1 <= int(count) <= 256:
            raise ValueError(f"expected local:W with W workers in [1, 256]; got {text[:40]!r}")
        return "local", int(count)
    if "://" not in text:
        raise ValueError(f"expected tcp://HOST:PORT or local:W; got {text[:40]!r}")
    return "remote", text


@contextlib.contextmanager
def connect(address: str) -> Iterator[ClusterSession]:
    """A session on `address` (`local:W` or a scheduler's), its workers' code checked;
    closed at the end, whatever ends it (our LocalCluster, its processes and dir too)."""
    try:
        kind, where = parse_address(address)
    except ValueError as exc:
        raise ClusterError(f"--cluster: {exc}") from None
    try:
        import dask
        import distributed
    except ImportError:
        raise ClusterError("--cluster needs Dask: pip install -e '.[cluster]'") from None
    with _quiet_dask():
        local = scratch = client = None
        try:
            if kind == "local":
                assert isinstance(where, int)
                scratch = _scratch_dir()
                # started unmarked, as for the pool: an interrupt's kill of the marked
                # processes must not take it (a new one would be told of the dead one's
                # semaphores, a traceback each)
                resource_tracker.ensure_running()
                # the scheduler's scratch space too (it reads only the config)
                with (
                    _marked_spawns(),
                    dask.config.set({"temporary-directory": str(scratch), **WORKER_SETTINGS}),
                ):
                    # the worker processes carry the owner mark
                    try:
                        local = distributed.LocalCluster(
                            n_workers=where,
                            threads_per_worker=1,
                            processes=True,
                            host="127.0.0.1",
                            dashboard_address=None,
                            # its HTTP server (health, metrics) on a free port of
                            # 127.0.0.1: the default 8787 may be another's, and Dask
                            # then warns on stderr
                            scheduler_kwargs={"dashboard_address": "127.0.0.1:0"},
                            local_directory=str(scratch),
                            silence_logs=logging.ERROR,
                        )
                    except Exception as exc:  # its own cleanup ran: nothing to close
                        raise ClusterError(
                            f"cannot start a LocalCluster of {where} workers: {_first_line(exc)}"
                        ) from None
                    client = distributed.Client(local, set_as_default=False)
                address_seen = f"local:{where}"
            else:
                assert isinstance(where, str)
                try:
                    client = distributed.Client(
                        where, timeout=CONNECT_TIMEOUT_S, set_as_default=False
                    )
                except (OSError, TimeoutError, ValueError) as exc:
                    raise ClusterError(
                        f"cannot reach the Dask scheduler at {where}: {_first_line(exc)}"
                    ) from None
                address_seen = where
            session = ClusterSession(client, address_seen, local)
            check_versions(session)
            yield session
        finally:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.close(timeout=CONNECT_TIMEOUT_S)
            if local is not None:
                with contextlib.suppress(Exception):
                    local.close(timeout=CONNECT_TIMEOUT_S)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)


def _scratch_dir() -> Path:
    """A harness temp dir (`chaos.stack._DIR_NAME`): `chaos clean` deletes it if we die."""
    from chaos.stack import owner_token

    token = owner_token()
    path = Path(tempfile.mkdtemp(prefix=f"chaos-dask-{token.replace(':', '_')}-"))
    (path / ".owner").write_text(token)
    return path


@contextlib.contextmanager
def _quiet_dask() -> Iterator[None]:
    """Dask's own warnings (a closing stream, a worker reconnecting) are not our lines."""
    logger = logging.getLogger("distributed")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# --- exploring ------------------------------------------------------------------------------


def run_batch(
    fn: Callable[..., Any], shared: Any, items: list[Any], args: tuple[Any, ...]
) -> tuple[str, str, list[Any]]:
    """On a worker: `fn(shared, item, *args)` for each item of the batch (a seed, a
    failpoint, a shrink candidate), the process tuned at its first batch as the pool's are
    (`explore.tune_for_seeds`: the objects already there, the worker's and the imports',
    frozen out of every collection, young collections spaced out) and left so: a worker
    given our batches runs seeds. Tuned for each batch and put back after it, the worker
    explored 3 % fewer seeds a second (`bench/sim_speed.py --cluster`). With the results,
    which worker ran them and its `fingerprint`: a worker that joined after the check at
    connect is checked too."""
    from distributed import get_worker

    from chaos.explore import tune_for_seeds

    checked = _process_fingerprint()
    tune_for_seeds()
    results = [fn(shared, item, *args) for item in items]
    return get_worker().address, checked, results


@functools.cache
def _process_fingerprint() -> str:
    """This worker process's `_worker_fingerprint`, worked out at its first batch."""
    return _worker_fingerprint()


def plan_paths(documents: Iterable[dict[str, Any]]) -> list[str]:
    """The plan files the documents read, each once, in order: what `check_files` asks."""
    paths: dict[str, None] = {}
    for data in documents:
        for plan in data.get("plans", []):
            if isinstance(plan, dict) and "path" in plan:
                paths[str(plan["path"])] = None
    return list(paths)


def map_on(
    session: ClusterSession,
    fn: Callable[..., Any],
    shared: Any,
    items: list[Any],
    *args: Any,
    on_batch: Callable[[list[Any], list[Any]], None] | None = None,
) -> list[Any]:
    """`[fn(shared, item, *args) for item in items]` on the cluster, in the order of
    `items`: what every simulation of `chaos sim --cluster` goes through (seeds, failpoints,
    shrink candidates), so each gets the same batching, version check and clean-up.
    `shared` (a scenario's document) is scattered once to every worker and tasks carry
    only their items, `batch_size` of them; `on_batch(items, results)` sees each batch as it
    comes back (the progress line). Whatever ends it, our futures leave the cluster."""
    from distributed import KilledWorker, as_completed

    if isinstance(shared, dict):  # a scenario: its workers must read its plans as we do
        check_files(session, plan_paths([shared]))
    client = session.client
    size = batch_size(len(items), session.threads)
    futures: list[Any] = []
    by_batch: dict[int, list[Any]] = {}
    try:
        if shared is not None:
            # a list of one: a dict would be scattered value by value, each under its key
            [shared] = client.scatter([shared], broadcast=True, hash=False)
            futures.append(shared)
        batches = {
            client.submit(run_batch, fn, shared, items[i : i + size], args, pure=False): i
            for i in range(0, len(items), size)
        }
        futures += batches
        ours = fingerprint()
        for future in as_completed(list(batches), loop=client.loop):
            worker, theirs, results = future.result()
            if theirs != ours:
                raise ClusterError(
                    f"worker {worker} of {session.address} runs another version of the "
                    f"code (source fingerprint {ours[:12]} here), as a batch of its says"
                )
            start = batches[future]
            by_batch[start] = results
            if on_batch:
                on_batch(items[start : start + size], results)
    except (OSError, TimeoutError, KilledWorker) as exc:
        raise ClusterError(f"cluster {session.address}: {_first_line(exc)}") from None
    finally:
        # done, interrupted or failed: the scenario, the queued batches and the results
        # leave the cluster now, not when the garbage collector finds the futures
        _cancel(client, futures)
        futures.clear()
    return [r for start in sorted(by_batch) for r in by_batch[start]]


def _seed(data: dict[str, Any], seed: int, mutant: str | None, measure: bool) -> SeedResult:
    """On a worker: one seed's swarm variant (`explore._one`)."""
    return _one((data, seed, mutant, measure))


def _simulated(_shared: None, data: dict[str, Any], mutant: str | None) -> SeedResult:
    """On a worker: one document as it is (`explore.simulate`), a shrink candidate."""
    return simulate(data, mutant)


def explore_on(
    session: ClusterSession,
    data: dict[str, Any],
    seeds: Iterable[int],
    mutant: str | None = None,
    on_result: Callable[[SeedResult], None] | None = None,
    measure: bool = False,
) -> Exploration:
    """`explore.explore` on the cluster: the document scattered once to every worker,
    seeds in `batch_size` batches, results in the order of `seeds`."""

    def streamed(_seeds: list[Any], results: list[Any]) -> None:
        if on_result:
            for r in results:
                on_result(r)

    exploration = Exploration()
    exploration.results = map_on(
        session, _seed, data, list(seeds), mutant, measure, on_batch=streamed
    )
    return exploration


def simulate_on(
    session: ClusterSession, documents: list[dict[str, Any]], mutant: str | None = None
) -> list[SeedResult]:
    """`explore.simulate` of each document on the cluster, results in their order: the
    shrinker's candidates of one round (`explore.shrink`'s `run_many`). Nothing is shared
    by them all (each is another document), so each task carries its own."""
    check_files(session, plan_paths(documents))
    return map_on(session, _simulated, None, documents, mutant)


def _cancel(client: Any, futures: list[Any]) -> None:
    with contextlib.suppress(Exception):
        client.cancel(futures, force=True)
