"""`python -m engine.submit`: submit a plan for an attemptId, cancel one, ask its state, or
remove what a namespace left behind.

    python -m engine.submit plans/code_review.yaml --attempt-id cand-42 --wait
    python -m engine.submit plans/code_review.yaml --count 20 --prefix load- --wait
    python -m engine.submit --cancel cand-42
    python -m engine.submit --status cand-42
    python -m engine.submit --namespace try. --purge cand- load-
    python -m engine.submit --system pg --resume cand-42 [--from-checkpoint chk_0003]
    python -m engine.submit --system pg --heartbeats

`--purge PREFIX...` deletes every Redis key `attempt:{PREFIX}*` (results, statuses and the
engine's own keys of those evaluations) and, with a namespace, the namespace's index keys and
the RabbitMQ queues and exchanges its workers and clients declared (they are noted in
`{namespace}engine:topology`); it refuses, deleting nothing, while a worker still consumes.

`--store postgres` talks to the PostgreSQL store instead (`EAI_DATABASE_URL`, the tenant
`EAI_TENANT_ID`), as `python -m engine.worker --store postgres` does: there `--purge`
deletes the namespace's evaluations whose attemptId starts with PREFIX.

Exit codes: 0 done; 1 `--status`/`--cancel` of an attemptId the engine has never seen (the
store holds neither its state nor its plan), `--wait` ended before every evaluation was
terminal, or `--purge` refused; 2 bad input; 3 the store (Redis or PostgreSQL) or RabbitMQ
unreachable, refusing the credentials, or a PostgreSQL the store cannot use. Errors are one
line on stderr, with passwords masked.

On the PostgreSQL store (`--system pg` or `pg-store`), `--resume RUN` resumes a run as the
durable design has it (`AgentLoop.resume`): its checkpoints are numbered in the order they
became durable (chk_0001, ...); everything up to `--from-checkpoint` (default: the last)
is kept, nothing after it is trusted, the lease is taken from whoever holds it and the run
is published again. It prints `{"run_id", "state", "resume": {"checkpoint_id", "attempt"}}`;
a finished or cancelled run is refused (exit 1), an unknown run or checkpoint is bad input
(exit 2). `--heartbeats` lists the runs whose owner stopped renewing for longer than
`EAI_HEARTBEAT_STALE_SECONDS` (the lease, `ENGINE_STALE_MS`, by default), one JSON line each.

`EngineClient` is the same thing as a library, used by the tests and the chaos runner.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Iterable
from typing import Any

import asyncpg
from aio_pika.exceptions import AMQPError
from redis.exceptions import RedisError

from engine.config import (
    STORES,
    SYSTEMS,
    EngineConfig,
    OneLineParser,
    ServiceUnavailable,
    env_config,
    of_system,
)
from engine.core.messages import RESUME_REASON, SUBMIT_REASON
from engine.core.states import TERMINAL_EVALUATION_STATUSES, EvaluationStatus
from engine.keys import checkpoint_id, checkpoint_number
from engine.plan import Plan, PlanError, load_plan, plan_from_dict
from engine.runtime.broker import Broker, QueueInUse, amqp_unavailable
from engine.runtime.context import open_broker, open_store, store_address, store_unavailable
from engine.runtime.pgqueue import PgQueue
from engine.runtime.pgstore import PostgresStore
from engine.runtime.store import now_ms
from engine.shell.orchestrator import completed_event

#: What a store raises when it is lost (after its client's retries).
STORE_ERRORS = (RedisError, asyncpg.PostgresError, asyncpg.InterfaceError)

TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}


class ResumeRefused(Exception):
    """A resume that cannot be done, in one line, with the exit code it means."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class EngineClient:
    """Submits, cancels and waits. Entering it checks both services first: an unreachable
    one, or wrong credentials, is one `ServiceUnavailable` within the connect timeout."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.store = open_store(config)
        self.broker = open_broker(config, self.store)

    async def __aenter__(self) -> EngineClient:
        try:
            await self.store.probe()
            await self.broker.connect(prefetch=1)
            await self.store.remember_topology(self.broker.declared)
        except BaseException as exc:
            await self.broker.close()
            await self.store.close()
            if isinstance(exc, STORE_ERRORS):
                raise store_unavailable(self.config, exc) from None
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.broker.close()
        await self.store.close()

    async def submit(self, plan: Plan, attempt_id: str) -> None:
        body = {
            "type": "execute",
            "attempt_id": attempt_id,
            "plan": plan.to_dict(),
            "reason": SUBMIT_REASON,
            "published_ms": now_ms(),
        }
        await self.broker.publish_work(body, attempt_id)

    async def cancel(self, attempt_id: str) -> str:
        """Make `cancelled` the final state unless another one won; return the final state.

        The state write takes the evaluation out of the retries index; once the cancel is
        announced it leaves the running index too (`RedisStore.done`), so that no sweeper
        re-publishes it, even when its owner is dead. The owner sees the state before its
        next rule start; the broadcast only makes that sooner.
        """
        cancelled = EvaluationStatus.CANCELLED.value
        event = completed_event(attempt_id, cancelled, {})
        if self.broker.outbox and isinstance(self.store, PostgresStore):
            # its row is written by the state's transaction, if it wins
            outboxed = (event.routing_key, event.message_id, dict(event.body))
            kept = await self.store.set_state(attempt_id, cancelled, event=outboxed)
        else:
            kept = await self.store.set_state(attempt_id, cancelled)
        if kept is not None:
            return kept
        if not self.broker.outbox:
            await self.broker.publish_event(event.routing_key, event.body, event.message_id)
        await self.store.done(attempt_id, "")  # flagged, unindexed; nobody's lease released
        await self.broker.publish_control({"type": "cancel", "attempt_id": attempt_id})
        return EvaluationStatus.CANCELLED.value

    async def resume(
        self, attempt_id: str, checkpoint: str | None = None, reason: str | None = None
    ) -> dict[str, Any]:
        """Resume a run from `checkpoint` (`chk_NNNN`; None: its last) and publish it again;
        the document's answer. `ResumeRefused` (with its exit code) when it cannot be."""
        if not isinstance(self.store, PostgresStore):
            raise ResumeRefused("--resume needs the PostgreSQL store (--system pg or pg-store)", 2)
        try:
            number = None if checkpoint is None else checkpoint_number(checkpoint)
        except ValueError as exc:
            raise ResumeRefused(f"--from-checkpoint: {exc}", 2) from None
        done = await self.store.resume(attempt_id, number, reason or RESUME_REASON)
        if done.kind == "unknown":
            raise ResumeRefused(f"--resume: no run {attempt_id!r} in this namespace", 2)
        if done.kind == "terminal":
            raise ResumeRefused(f"--resume: run {attempt_id} is {done.state}: nothing to resume", 1)
        if done.kind == "nocheckpoint":
            last = checkpoint_id(done.checkpoint) if done.checkpoint else "none yet"
            raise ResumeRefused(
                f"--from-checkpoint: run {attempt_id} has no {checkpoint} (its last: {last})", 2
            )
        body = {
            "type": "execute",
            "attempt_id": attempt_id,
            "reason": RESUME_REASON,
            "published_ms": now_ms(),
        }
        await self.broker.publish_work(body, f"{attempt_id}:resume:{done.attempt}")
        chk = checkpoint_id(done.checkpoint) if done.checkpoint else None
        return {
            "run_id": attempt_id,
            "state": "running",
            "resume": {"checkpoint_id": chk, "attempt": done.attempt},
            "discarded": list(done.deleted),
        }

    async def status(self, attempt_id: str) -> str | None:
        return (await self.store.record(attempt_id)).state

    async def wait(
        self, attempt_ids: Iterable[str], timeout_s: float, poll_s: float = 0.05
    ) -> dict[str, str | None]:
        """Poll until every evaluation is terminal or the timeout passes."""
        ids = list(attempt_ids)
        final: dict[str, str | None] = dict.fromkeys(ids)
        deadline = time.monotonic() + timeout_s
        while True:
            pending = [a for a in ids if final[a] not in TERMINAL]
            if not pending:
                return final
            if isinstance(self.store, PostgresStore):
                states = await self.store.states(pending)
            else:
                states = await self.store.redis.mget([f"attempt:{a}:state" for a in pending])
            for a, s in zip(pending, states, strict=True):
                final[a] = s
            if all(final[a] in TERMINAL for a in pending) or time.monotonic() >= deadline:
                return final
            await asyncio.sleep(poll_s)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m engine.submit", description=OneLineParser.summary(__doc__))
    p.add_argument("plan", nargs="?", help="plan file (YAML)")
    p.add_argument("--attempt-id", help="the candidate submission's attemptId")
    p.add_argument("--count", type=int, default=1, help="submit this many evaluations")
    p.add_argument("--prefix", default="", help="attemptId prefix with --count")
    p.add_argument(
        "--cancel", metavar="ATTEMPT_ID", help="cancel an evaluation; prints its final state"
    )
    p.add_argument(
        "--status", metavar="ATTEMPT_ID", help="an evaluation's state, and its rules' verdicts"
    )
    p.add_argument(
        "--purge",
        nargs="*",
        metavar="PREFIX",
        help="delete the keys of attemptIds starting with PREFIX, and the namespace's queues",
    )
    p.add_argument("--resume", metavar="RUN", help="resume a run (PostgreSQL store)")
    p.add_argument(
        "--from-checkpoint",
        metavar="CHK",
        help="with --resume: keep up to chk_NNNN (default: last)",
    )
    p.add_argument("--reason", help="with --resume: why (kept in the run's events)")
    p.add_argument(
        "--heartbeats", action="store_true", help="list the runs whose owner stopped renewing"
    )
    p.add_argument("--wait", action="store_true", help="wait until every one is terminal")
    p.add_argument(
        "--timeout", type=float, default=60.0, help="seconds --wait waits at most (default 60)"
    )
    p.add_argument(
        "--namespace", help="prefix of queues, exchanges and index keys ($ENGINE_NAMESPACE)"
    )
    p.add_argument(
        "--store",
        choices=STORES,
        help="the workers' store (default $ENGINE_STORE or redis); postgres reads "
        "$EAI_DATABASE_URL and $EAI_TENANT_ID",
    )
    p.add_argument(
        "--system",
        choices=list(SYSTEMS),
        help="the workers' design (as engine.worker --system): pg keeps the jobs in PostgreSQL",
    )
    p.add_argument("--redis-url", help="default: $REDIS_URL or redis://127.0.0.1:6379/0")
    p.add_argument("--amqp-url", help="default: $AMQP_URL or amqp://guest:***@127.0.0.1:5672/")
    return p


def _bad_input(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, in one line (None: nothing)."""
    actions = [a for a in (args.plan, args.cancel, args.status, args.resume, args.heartbeats) if a]
    actions += [1] if args.purge is not None else []
    one_of = "a plan, --cancel ID, --status ID, --resume RUN, --heartbeats, --purge PREFIX..."
    if not actions:
        return f"give one of: {one_of}"
    if len(actions) > 1:
        return f"give only one of: {one_of}"
    if (args.from_checkpoint or args.reason) and not args.resume:
        return "--from-checkpoint and --reason go with --resume RUN"
    if args.purge is not None and any(not prefix for prefix in args.purge):
        return "--purge: an empty prefix would match every evaluation; give a real one"
    if args.count < 1:
        return f"--count: expected at least 1; got {args.count}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _bad_input(args)
    if problem is not None:
        print(f"engine.submit: {problem}", file=sys.stderr)
        return 2
    try:
        store, broker = of_system(args.system, args.store)
        config = env_config(
            namespace=args.namespace,
            redis_url=args.redis_url,
            amqp_url=args.amqp_url,
            store=store,
            broker=broker,
        )
    except ValueError as exc:
        print(f"engine.submit: {exc}", file=sys.stderr)
        return 2
    if args.purge == [] and not config.namespace:
        print(
            "engine.submit: --purge: give attemptId prefixes, a namespace "
            "(--namespace or ENGINE_NAMESPACE), or both",
            file=sys.stderr,
        )
        return 2
    plan = None
    if args.plan:
        try:
            plan = load_plan(args.plan)
        except PlanError as exc:
            print(exc, file=sys.stderr)
            return 2
    try:
        return asyncio.run(_run(config, plan, args))
    except ServiceUnavailable as exc:
        print(f"engine.submit: {exc}", file=sys.stderr)
        return 3
    except STORE_ERRORS as exc:  # lost after the first contact (the store retried meanwhile)
        lost = store_unavailable(config, exc)
        print(f"engine.submit: {lost}", file=sys.stderr)
        return 3
    except (AMQPError, OSError) as exc:
        lost = amqp_unavailable(exc, config.amqp_url, config.connect_timeout_s)
        print(f"engine.submit: {lost}", file=sys.stderr)
        return 3


async def _heartbeats(config: EngineConfig) -> int:
    store = open_store(config)
    if not isinstance(store, PostgresStore):
        print("engine.submit: --heartbeats needs the PostgreSQL store", file=sys.stderr)
        return 2
    try:
        await store.probe()
        for attempt_id, owner, age in await store.stale_heartbeats(config.stale_ms):
            print(json.dumps({"run_id": attempt_id, "owner": owner, "stale_ms": age}))
    finally:
        await store.close()
    return 0


def _unknown(config: EngineConfig, attempt_id: str) -> int:
    print(
        f"engine.submit: no evaluation {attempt_id!r}: {store_address(config)} holds "
        "neither its state nor its plan (never submitted, not started yet, or expired)",
        file=sys.stderr,
    )
    return 1


async def _known(config: EngineConfig, attempt_id: str) -> tuple[bool, str | None]:
    """Whether the engine has seen `attempt_id`, and its state; the store only."""
    known, state, _ = await _status(config, attempt_id, rules=False)
    return known, state


async def _status(
    config: EngineConfig, attempt_id: str, rules: bool = True
) -> tuple[bool, str | None, dict[str, Any]]:
    """Whether the engine has seen `attempt_id`, its state, and (`rules`) what Redis holds
    of each rule of its stored plan, in the plan's order: the verdict, score and attempt of
    a result, or the status (`failed_attempt_N`, `permanently_failed`, `skipped`), or
    `pending` for a rule with neither."""
    store = open_store(config)
    try:
        await store.probe()
        record = await store.record(attempt_id)
        shown: dict[str, Any] = {}
        if rules and record.plan_json is not None:
            order = plan_from_dict(json.loads(record.plan_json)).order
            snap = await store.snapshot(attempt_id, order)
            for rule_id in order:
                result = snap.results.get(rule_id)
                if result is not None:
                    shown[rule_id] = {
                        "verdict": result.verdict,
                        "score": result.score,
                        "attempt": result.attempt,
                    }
                else:
                    shown[rule_id] = {"status": snap.statuses.get(rule_id, "pending")}
    finally:
        await store.close()
    return record.state is not None or record.plan_json is not None, record.state, shown


async def purge(config: EngineConfig, prefixes: Iterable[str]) -> tuple[int, list[str]]:
    """Delete the keys of the attemptIds starting with `prefixes` and, with a namespace, the
    namespace's index keys, queues and exchanges; return (keys deleted, queues and
    exchanges deleted). `QueueInUse`, with nothing deleted, while a worker consumes."""
    store = open_store(config)
    try:
        await store.probe()
        deleted: list[str] = []
        if config.namespace and config.broker == "postgres":
            assert isinstance(store, PostgresStore)
            await PgQueue(config, store).purge()
        elif config.namespace:
            broker = Broker(config)
            await broker.connect(prefetch=1, declare=False)
            try:
                deleted = await broker.delete_topology(await store.topology())
            finally:
                await broker.close()
        keys = await store.purge(prefixes, namespace=bool(config.namespace))
    finally:
        await store.close()
    return keys, deleted


async def _purge(config: EngineConfig, prefixes: list[str]) -> int:
    try:
        keys, deleted = await purge(config, prefixes)
    except QueueInUse as exc:
        print(f"engine.submit: --purge: {exc}; nothing deleted", file=sys.stderr)
        return 1
    print(json.dumps({"keys_deleted": keys, "deleted": deleted}))
    return 0


async def _run(config: EngineConfig, plan: Plan | None, args: argparse.Namespace) -> int:
    if args.purge is not None:
        return await _purge(config, args.purge)
    if args.resume:
        async with EngineClient(config) as client:
            try:
                answer = await client.resume(args.resume, args.from_checkpoint, args.reason)
            except ResumeRefused as exc:
                print(f"engine.submit: {exc}", file=sys.stderr)
                return exc.code
        print(json.dumps(answer))
        return 0
    if args.heartbeats:
        return await _heartbeats(config)
    if args.status:
        known, state, rules = await _status(config, args.status)
        if not known:
            return _unknown(config, args.status)
        print(json.dumps({"attempt_id": args.status, "state": state, "rules": rules}))
        return 0
    if args.cancel:
        known, _ = await _known(config, args.cancel)
        if not known:
            return _unknown(config, args.cancel)
        async with EngineClient(config) as client:
            state = await client.cancel(args.cancel)
        print(json.dumps({"attempt_id": args.cancel, "state": state}))
        return 0
    async with EngineClient(config) as client:
        assert plan is not None
        if args.attempt_id and args.count == 1:
            ids = [args.attempt_id]
        else:
            prefix = args.prefix or f"{args.attempt_id or uuid.uuid4().hex[:8]}-"
            ids = [f"{prefix}{i}" for i in range(args.count)]
        for attempt_id in ids:
            await client.submit(plan, attempt_id)
        if not args.wait:
            print(json.dumps({"submitted": ids}))
            return 0
        final = await client.wait(ids, args.timeout)
        print(json.dumps(final))
        return 0 if all(s in TERMINAL for s in final.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
