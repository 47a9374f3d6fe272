"""The `pg` design's job queue (`engine.runtime.pgqueue`) on the machine's PostgreSQL: the
late ACK as a visibility lease, delayed jobs, forwards routed by the consumers alive, the
control fanout, and the outbox committing in the order it is read; then a worker on it
(`python -m engine.worker --system pg`) killed mid-rule, its job and evaluation taken over.

The clock is the store's (`PostgresStore(clock=...)`): leases lapse when the test moves
time, never by waiting.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import orjson
import pytest

from engine.config import EngineConfig
from engine.plan import load_plan
from engine.runtime.pgqueue import Job, PgQueue
from engine.runtime.pgstore import PostgresStore
from engine.shell.effects import Unroutable
from engine.submit import EngineClient
from tests.live.test_pgstore_live import ROOT, TENANT_A, PgSandbox, sandbox

pytestmark = [pytest.mark.live, pytest.mark.slow]

LEASE_MS = 1_000


@pytest.fixture(scope="module")
def pg() -> Iterator[PgSandbox]:
    with sandbox() as box:
        yield box


class Consumers:
    """Queues of one namespace on one clock, one per worker id, consuming by hand."""

    def __init__(self, pg: PgSandbox) -> None:
        self.now = [1_000_000]
        self.config = EngineConfig(
            namespace=f"q{uuid.uuid4().hex[:8]}.",
            store="postgres",
            broker="postgres",
            stale_ms=LEASE_MS,
            time_scale=0.001,
        )
        self.pg = pg
        self.queues: dict[str, PgQueue] = {}

    def queue(self, worker: str) -> PgQueue:
        if worker not in self.queues:
            store = PostgresStore(
                self.config, url=self.pg.url, tenant_id=TENANT_A, clock=lambda: self.now[0]
            )
            q = PgQueue(self.config, store)
            q.worker_id = worker
            self.queues[worker] = q
        return self.queues[worker]

    async def register(self, worker: str) -> None:
        await self.queue(worker).batch.call(["renew", worker, []])

    async def claim(self, worker: str, n: int = 10) -> tuple[list[Job], int | None]:
        q = self.queue(worker)
        *raw, due = await q.batch.call(["claim", worker, q.work_queue_name, n, n])
        jobs = []
        for r in raw:
            q._held.pop(r[0], None)
            jobs.append(_job(q, r))
        return jobs, due

    async def close(self) -> None:
        for q in self.queues.values():
            await q.store.close()


def _job(q: PgQueue, raw: list[Any]) -> Job:
    import base64

    job_id, token, message_id, body, queue = raw
    return Job(job_id, int(token), base64.b64decode(body), message_id, queue, "", q)


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_claim_holds_a_job_until_its_lease_lapses_then_it_is_redelivered(pg: PgSandbox) -> None:
    async def scenario() -> dict[str, Any]:
        c = Consumers(pg)
        try:
            a, b = c.queue("wa"), c.queue("wb")
            a.worker_id, b.worker_id = "wa", "wb"
            await a.publish_work({"type": "execute", "attempt_id": "x"}, "x")
            out: dict[str, Any] = {}
            (first,), _ = await c.claim("wa")
            out["first"] = (first.message_id, first.redelivered)
            out["held_meanwhile"] = (await c.claim("wb"))[0]
            c.now[0] += LEASE_MS  # the last ms of the lease
            out["at_the_edge"] = (await c.claim("wb"))[0]
            c.now[0] += 1  # lapsed: wa died without settling
            (second,), _ = await c.claim("wb")
            out["second"] = (second.message_id, second.redelivered)
            out["late_ack"] = await a.settle(first)  # wa's token is stale
            out["ack"] = await b.settle(second)
            c.now[0] += 10 * LEASE_MS
            out["after"] = (await c.claim("wa"))[0]
            return out
        finally:
            await c.close()

    out = _run(scenario())
    assert out["first"] == ("x", False)
    assert out["held_meanwhile"] == [] and out["at_the_edge"] == []
    assert out["second"] == ("x", True)
    assert out["late_ack"] is False and out["ack"] is True
    assert out["after"] == []


def test_the_work_queue_and_the_private_queue_each_have_their_prefetch(pg: PgSandbox) -> None:
    """A window full of work still takes a forward (RabbitMQ: a consumer's own credit)."""

    async def scenario() -> tuple[Any, ...]:
        c = Consumers(pg)
        try:
            a = c.queue("wa")
            await c.register("wb")
            for n in range(3):
                await a.publish_work({"n": n}, f"work{n}")
            await a.forward(c.config.name("worker.wb"), b"{}", "fwd")
            b = c.queue("wb")
            *raw, _ = await b.batch.call(["claim", "wb", b.work_queue_name, 0, 1])
            work_full = [r[2] for r in raw]
            *raw, _ = await b.batch.call(["claim", "wb", b.work_queue_name, 2, 0])
            return work_full, [r[2] for r in raw]
        finally:
            await c.close()

    mine, work = _run(scenario())
    assert mine == ["fwd"] and work == ["work0", "work1"]


def test_a_consumer_cut_off_past_its_lease_takes_its_own_job_again(pg: PgSandbox) -> None:
    """Its claim lapsed while nobody else took the job: the next claim renews it (a new
    token, the delivery it holds kept), and the ACK with that token lands."""

    async def scenario() -> tuple[Any, ...]:
        c = Consumers(pg)
        try:
            a = c.queue("wa")
            await a.publish_work({"n": 1}, "m1")
            held = await a.batch.call(["claim", "wa", a.work_queue_name, 1, 1])
            c.now[0] += LEASE_MS + 1
            again = await a.batch.call(["claim", "wa", a.work_queue_name, 1, 1])
            job = _job(a, held[0])
            a._held[job.id] = job
            a._deliver(again[0])  # the client keeps its delivery, with the new token
            return held[0][1], again[0][1], job.token, await a.settle(job)
        finally:
            await c.close()

    first, second, token, acked = _run(scenario())
    assert (first, second, token, acked) == (1, 2, 2, True)


def test_a_nack_makes_a_job_visible_again_at_once(pg: PgSandbox) -> None:
    async def scenario() -> tuple[Any, ...]:
        c = Consumers(pg)
        try:
            a = c.queue("wa")
            await a.publish_work({"n": 1}, "m1")
            (job,), _ = await c.claim("wa")
            nacked = await a.settle(job, ack=False)
            (again,), _ = await c.claim("wb")
            return nacked, again.message_id, again.redelivered
        finally:
            await c.close()

    assert _run(scenario()) == (True, "m1", True)


def test_a_delayed_retry_is_claimed_at_its_tier_and_not_before(pg: PgSandbox) -> None:
    async def scenario() -> tuple[Any, ...]:
        c = Consumers(pg)
        try:
            a = c.queue("wa")
            (tier, bucket), delay = next(iter(a._delay_ms.items()))
            await a.publish_retry(tier, bucket, {"type": "retry"}, "r1")
            early, due = await c.claim("wa")
            c.now[0] += delay - 1
            still_early, _ = await c.claim("wa")
            c.now[0] += 1
            on_time, _ = await c.claim("wa")
            return delay, early, due, still_early, [j.message_id for j in on_time]
        finally:
            await c.close()

    delay, early, due, still_early, on_time = _run(scenario())
    assert delay > 0 and early == [] and still_early == []
    assert due == 1_000_000 + delay  # the claim says when to look again
    assert on_time == ["r1"]


def test_forwards_go_to_consumers_alive_and_a_dead_ones_work_is_taken_as_work(
    pg: PgSandbox,
) -> None:
    async def scenario() -> dict[str, Any]:
        c = Consumers(pg)
        try:
            a = c.queue("wa")
            out: dict[str, Any] = {}
            try:
                await a.forward(c.config.name("worker.wb"), b"{}", "f0")
            except Unroutable:
                out["never_consumed"] = "unroutable"
            await c.register("wb")
            await a.forward(c.config.name("worker.wb"), b'{"x": 1}', "f1")
            out["not_for_wa"] = (await c.claim("wa"))[0]
            c.now[0] += LEASE_MS + 1  # wb's consumer row goes stale: wb is dead
            try:
                await a.forward(c.config.name("worker.wb"), b"{}", "f2")
            except Unroutable:
                out["dead"] = "unroutable"
            out["taken_as_work"] = [j.message_id for j in (await c.claim("wa"))[0]]
            return out
        finally:
            await c.close()

    out = _run(scenario())
    assert out["never_consumed"] == "unroutable" and out["dead"] == "unroutable"
    assert out["not_for_wa"] == []
    assert out["taken_as_work"] == ["f1"]


def test_a_cancel_reaches_each_consumer_alive_once(pg: PgSandbox) -> None:
    async def scenario() -> tuple[Any, ...]:
        c = Consumers(pg)
        try:
            await c.register("wa")
            await c.register("wb")
            c.now[0] += LEASE_MS + 1
            await c.register("wc")  # wa and wb stale, wc alive
            await c.register("wa")  # wa renewed: alive again
            await c.queue("wa").publish_control({"type": "cancel", "attempt_id": "x"})
            got = {w: [j.body for j in (await c.claim(w))[0]] for w in ("wa", "wb", "wc")}
            return got["wa"], got["wb"], got["wc"]
        finally:
            await c.close()

    wa, wb, wc = _run(scenario())
    assert len(wa) == 1 and len(wc) == 1 and wb == []


def test_the_outbox_commits_events_in_the_order_it_is_read(pg: PgSandbox) -> None:
    """A second publisher waits for the first one's commit: its event, numbered after, can
    never be read before the first's (a reader past it would miss the first for good)."""

    async def scenario() -> tuple[Any, ...]:
        ns = f"o{uuid.uuid4().hex[:8]}."
        first = await asyncpg.connect(pg.url)
        second = await asyncpg.connect(pg.url)
        owner = await pg.owner()
        try:
            tx = first.transaction()
            await tx.start()
            await first.execute("SELECT set_config('app.tenant_id', $1, true)", TENANT_A)
            await first.execute(
                "SELECT eai.event_publish($1, 'evaluation.started', 'e1', '{}')", ns
            )
            pid = second.get_server_pid()
            publish = asyncio.ensure_future(
                second.fetchval(
                    "SELECT eai.queue_apply($1, $2, 1000, $3::jsonb)",
                    TENANT_A,
                    ns,
                    '[["event", "evaluation.started", "e2", {}]]',
                )
            )
            waiting = None
            for _ in range(500):  # until the second publisher waits for the lock
                waiting = await owner.fetchval(
                    "SELECT wait_event_type FROM pg_stat_activity WHERE pid = $1", pid
                )
                if waiting == "Lock":
                    break
                await asyncio.sleep(0.01)
            await tx.commit()
            await publish
            rows = await owner.fetch(
                "SELECT message_id FROM eai.run_events WHERE namespace = $1 ORDER BY seq", ns
            )
            return waiting, [r["message_id"] for r in rows]
        finally:
            for conn in (first, second, owner):
                await conn.close()

    waiting, order = _run(scenario())
    assert waiting == "Lock"
    assert order == ["e1", "e2"]


def test_an_event_and_the_flag_that_records_it_land_in_one_transaction(pg: PgSandbox) -> None:
    """The outbox (migration 0004): `done` and `mark_pass_published` carry the event they
    flag; its row is written by the transaction that writes the flag (one `xmin`), and a
    flag refused by the fence, a zombie's, writes no event."""
    from engine.core import RuleResult
    from engine.runtime.store import LeaseLost
    from tests.live.test_pgstore_live import TINY

    a = f"ob{uuid.uuid4().hex[:8]}"

    async def scenario() -> dict[str, Any]:
        c = Consumers(pg)
        store = c.queue("w1").store
        owner = await pg.owner()
        out: dict[str, Any] = {}

        async def written_with_run(message_id: str) -> list[bool]:
            rows = await owner.fetch(
                "SELECT e.xmin::text = r.xmin::text AS same FROM eai.run_events e "
                "JOIN eai.runs r ON r.id = e.run_id WHERE e.message_id = $1",
                message_id,
            )
            return [r["same"] for r in rows]

        try:
            begun = await store.begin(a, "w1", TINY.order, TINY)
            await store.write_result(a, RuleResult("compiles", "pass", 0.9, 10), (), begun.fence)
            passed = ("evaluation.pass_result", f"{a}:pass:p1", {"attempt_id": a})
            try:
                await store.mark_pass_published(a, "p1", "pass", "stale", event=passed)
            except LeaseLost:
                out["zombie"] = "refused"
            out["zombie_rows"] = await written_with_run(f"{a}:pass:p1")
            await store.mark_pass_published(a, "p1", "pass", begun.fence, event=passed)
            out["pass_rows"] = await written_with_run(f"{a}:pass:p1")
            await store.finish(a, "completed", {}, [], begun.fence)
            done = ("evaluation.completed", f"{a}:completed", {"attempt_id": a})
            out["done"] = await store.done(a, "w1", event=done)
            out["done_rows"] = await written_with_run(f"{a}:completed")
            return out
        finally:
            await owner.close()
            await c.close()

    out = _run(scenario())
    assert out == {
        "zombie": "refused",
        "zombie_rows": [],
        "pass_rows": [True],
        "done": True,
        "done_rows": [True],
    }


def test_an_event_is_written_by_the_change_it_announces(pg: PgSandbox) -> None:
    """The outbox (migration 0005): `begin` writes `evaluation.started` (with `resumed` from
    what it found), the final state (`finish`, a cancel's `set_state`) `evaluation.completed`
    and its flag, each in its own transaction (one `xmin` with the run's row), and only when
    the operation took effect: no row for a begin that found a holder, a final state that
    lost to another, a zombie's finish."""
    from engine.core import RuleResult
    from engine.runtime.store import LeaseLost
    from tests.live.test_pgstore_live import TINY

    a, b = f"oa{uuid.uuid4().hex[:8]}", f"ob{uuid.uuid4().hex[:8]}"

    def started(x: str, worker: str) -> tuple[str, str, dict[str, Any]]:
        body = {"attempt_id": x, "plan": "tiny", "resumed": False, "worker": worker}
        return "evaluation.started", f"{x}:started", body

    def completed(x: str, status: str) -> tuple[str, str, dict[str, Any]]:
        body = {"attempt_id": x, "status": status, "verdicts": {}}
        return "evaluation.completed", f"{x}:completed", body

    async def scenario() -> dict[str, Any]:
        c = Consumers(pg)
        store = c.queue("w1").store
        owner = await pg.owner()
        out: dict[str, Any] = {}

        async def rows(message_id: str) -> list[tuple[bool, Any]]:
            """Each row of the event, in order: whether it was written by the transaction
            that last wrote the run's row (the newest only can be), and its `resumed`."""
            got = await owner.fetch(
                "SELECT e.xmin::text = r.xmin::text AS same, e.data::text AS data"
                " FROM eai.run_events e JOIN eai.runs r ON r.id = e.run_id"
                " WHERE e.message_id = $1 ORDER BY e.seq",
                message_id,
            )
            return [(r["same"], orjson.loads(r["data"]).get("resumed")) for r in got]

        async def published(x: str) -> bool:
            return (await store.record(x)).final_published

        try:
            begun = await store.begin(a, "w1", TINY.order, TINY, event=started(a, "w1"))
            out["started"] = await rows(f"{a}:started")
            held = await store.begin(a, "w2", TINY.order, TINY, event=started(a, "w2"))
            out["held"] = (held.holder, await rows(f"{a}:started"))
            await store.write_result(a, RuleResult("compiles", "pass", 0.9, 10), (), begun.fence)
            again = await store.begin(a, "w1", TINY.order, TINY, event=started(a, "w1"))
            out["resumed"] = await rows(f"{a}:started")
            try:
                await store.finish(a, "completed", {}, [], "1:zombie", event=completed(a, "x"))
            except LeaseLost:
                out["zombie"] = (await rows(f"{a}:completed"), await published(a))
            kept = await store.finish(
                a, "completed", {}, [], again.fence, event=completed(a, "completed")
            )
            out["finish"] = (kept[0], await rows(f"{a}:completed"), await published(a))
            lost = await store.set_state(a, "cancelled", event=completed(a, "cancelled"))
            out["cancel_lost"] = (lost, await rows(f"{a}:completed"))
            await store.begin(b, "w1", TINY.order, TINY)
            won = await store.set_state(b, "cancelled", event=completed(b, "cancelled"))
            out["cancel"] = (won, await rows(f"{b}:completed"), await published(b))
            return out
        finally:
            await owner.close()
            await c.close()

    out = _run(scenario())
    assert out == {
        "started": [(True, False)],
        "held": ("w1", [(True, False)]),
        "resumed": [(False, False), (True, True)],
        "zombie": ([], False),
        "finish": (None, [(True, None)], True),
        "cancel_lost": ("completed", [(True, None)]),
        "cancel": (None, [(True, None)], True),
    }


def test_a_worker_killed_mid_rule_hands_its_job_and_evaluation_over(
    pg: PgSandbox, tmp_path: Any
) -> None:
    """`--system pg` end to end: the first worker dies in the middle of a rule; a second
    one takes the evaluation over when the lease lapses, and no finished rule runs again."""
    ns = f"k{uuid.uuid4().hex[:8]}."
    env = dict(os.environ, EAI_DATABASE_URL=pg.url, EAI_TENANT_ID=TENANT_A)
    config = EngineConfig(
        namespace=ns,
        store="postgres",
        broker="postgres",
        database_url=pg.url,
        tenant_id=TENANT_A,
        time_scale=0.001,
        stale_ms=600,
        heartbeat_ms=100,
        sweep_ms=100,
    )
    plan = load_plan(ROOT / "plans" / "tiny.yaml")

    def worker(name: str, latency_ms: int, scale: float = 0.001) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "engine.worker", "--system", "pg", "--namespace", ns]
        argv += ["--time-scale", str(scale), "--stale-ms", "600", "--heartbeat-ms", "100"]
        argv += ["--sweep-ms", "100", "--worker-id", name, "--history", str(tmp_path / name)]
        argv += ["--agent", f'{{"latency_ms": {latency_ms}}}']
        return subprocess.Popen(argv, env=env, stderr=subprocess.PIPE)

    def started(name: str) -> bool:
        path = tmp_path / name
        return path.exists() and '"rule_started"' in path.read_text()

    first = worker("w1", 3_600_000, scale=1.0)  # an hour a call: killed in the middle of one
    second = None
    try:

        async def submit() -> None:
            async with EngineClient(config) as client:
                await client.submit(plan, "kill-1")

        _run(submit())
        for _ in range(3000):
            if started("w1") or first.poll() is not None:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert started("w1"), "the first worker never started a rule"
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        bad = _submit_cli(pg, ns, "--resume", "kill-1", "--from-checkpoint", "chk_0001")
        assert bad.returncode == 2, bad.stderr
        assert bad.stderr.endswith("has no chk_0001 (its last: none yet)\n")
        second = worker("w2", 1)

        async def wait() -> dict[str, str | None]:
            async with EngineClient(config) as client:
                return await client.wait(["kill-1"], 60)

        assert _run(wait()) == {"kill-1": "completed"}
        import json

        took = [json.loads(line) for line in (tmp_path / "w2").read_text().splitlines()]
        begun = [e for e in took if e.get("ev") == "evaluation_started"]
        assert begun and begun[0]["fence"] == "2:w2"  # w2 took over what w1 had begun
        delivered = [e for e in took if e.get("ev") == "delivered"]
        assert delivered[0]["reason"] == "stale_heartbeat"  # the sweeper saw w1 dead
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(10)


# --- resume from a checkpoint --------------------------------------------------------------


def _submit_cli(pg: PgSandbox, ns: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, EAI_DATABASE_URL=pg.url, EAI_TENANT_ID=TENANT_A)
    argv = [sys.executable, "-m", "engine.submit", "--system", "pg", "--namespace", ns, *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


def test_a_run_resumed_from_a_checkpoint_keeps_what_came_before_and_redoes_the_rest(
    pg: PgSandbox, tmp_path: Any
) -> None:
    """The document's resume, on a live owner: from chk_0002 the first two results are kept
    and never run again, later ones are deleted; the owner is fenced off, another
    acquisition finishes the run; the answer names the checkpoint and the attempt."""
    import json

    ns = f"r{uuid.uuid4().hex[:8]}."
    env = dict(os.environ, EAI_DATABASE_URL=pg.url, EAI_TENANT_ID=TENANT_A)
    config = EngineConfig(
        namespace=ns,
        store="postgres",
        broker="postgres",
        database_url=pg.url,
        tenant_id=TENANT_A,
    )
    plan = load_plan(ROOT / "plans" / "code_review.yaml")
    history = tmp_path / "w1"
    argv = [sys.executable, "-m", "engine.worker", "--system", "pg", "--namespace", ns]
    argv += ["--worker-id", "w1", "--history", str(history), "--max-parallel", "1"]
    argv += ["--agent", '{"latency_ms": 100}']
    # The fourth rule stalls until its owner is fenced off (the heartbeat then abandons the
    # evaluation, cancelling the stall): the run is still running when the resume comes,
    # however long the command takes to start.
    argv += ["--failpoint", "rule_before_call=stall:600000,hit=4"]
    worker = subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)

    async def checkpoints() -> list[tuple[int, str]]:
        store = PostgresStore(config, url=pg.url, tenant_id=TENANT_A)
        try:
            return await store.checkpoints("res-1")
        finally:
            await store.close()

    try:

        async def until_checkpoints(n: int) -> list[tuple[int, str]]:
            async with EngineClient(config) as client:
                await client.submit(plan, "res-1")
            for _ in range(6000):
                got = await checkpoints()
                if len(got) >= n:
                    return got
                await asyncio.sleep(0.01)
            raise AssertionError(f"fewer than {n} checkpoints")

        before = _run(until_checkpoints(3))
        done = _submit_cli(pg, ns, "--resume", "res-1", "--from-checkpoint", "chk_0002")
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)

        async def finish() -> tuple[Any, ...]:
            async with EngineClient(config) as client:
                final = await client.wait(["res-1"], 60)
            return final, await checkpoints()

        final, after = _run(finish())
        again = _submit_cli(pg, ns, "--resume", "res-1")
        unknown = _submit_cli(pg, ns, "--resume", "nobody")
    finally:
        worker.terminate()
        worker.wait(10)
    assert answer["run_id"] == "res-1" and answer["state"] == "running"
    assert answer["resume"] == {"checkpoint_id": "chk_0002", "attempt": 2}
    kept = {rule for n, rule in before if n <= 2}
    assert after[:2] == before[:2]  # kept, with their numbers
    assert set(answer["discarded"]).isdisjoint(kept) and answer["discarded"]
    assert final == {"res-1": "completed"}
    events = [json.loads(line) for line in history.read_text().splitlines()]
    starts = [e["rule_id"] for e in events if e.get("ev") == "rule_started"]
    assert all(starts.count(r) == 1 for r in kept)  # nothing at or before chk_0002 ran again
    fences = {e.get("fence") for e in events if e.get("ev") == "evaluation_started"}
    assert fences == {"1:w1", "3:w1"}  # 2:resume fenced the first acquisition off
    assert again.returncode == 1 and again.stderr.count("\n") == 1
    assert "completed" in again.stderr
    assert unknown.returncode == 2 and "no run 'nobody'" in unknown.stderr
