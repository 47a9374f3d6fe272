"""`python -m engine.submit`: submit a plan for an attemptId, cancel one, or wait for them.

    python -m engine.submit plans/code_review.yaml --attempt-id cand-42 --wait
    python -m engine.submit plans/code_review.yaml --count 20 --prefix load- --wait
    python -m engine.submit --cancel cand-42
    python -m engine.submit --status cand-42

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

from engine.config import EngineConfig, env_config
from engine.core.states import TERMINAL_EVALUATION_STATUSES, EvaluationStatus
from engine.plan import Plan, PlanError, load_plan
from engine.runtime.broker import Broker
from engine.runtime.store import RedisStore, now_ms

TERMINAL = {s.value for s in TERMINAL_EVALUATION_STATUSES}


class EngineClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.store = RedisStore(config)
        self.broker = Broker(config)

    async def __aenter__(self) -> EngineClient:
        await self.broker.connect(prefetch=1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.broker.close()
        await self.store.close()

    async def submit(self, plan: Plan, attempt_id: str) -> None:
        body = {
            "type": "execute",
            "attempt_id": attempt_id,
            "plan": plan.to_dict(),
            "reason": "submit",
            "published_ms": now_ms(),
        }
        await self.broker.publish_work(body, attempt_id)

    async def cancel(self, attempt_id: str) -> str:
        """Make `cancelled` the final state unless another one won; return the final state."""
        kept = await self.store.set_state(attempt_id, EvaluationStatus.CANCELLED.value)
        if kept is not None:
            return kept
        body = {"attempt_id": attempt_id, "status": "cancelled", "verdicts": {}}
        await self.broker.publish_event("evaluation.completed", body, f"{attempt_id}:completed")
        await self.store.mark_final_published(attempt_id)
        await self.broker.publish_control({"type": "cancel", "attempt_id": attempt_id})
        return EvaluationStatus.CANCELLED.value

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
            states = await self.store.redis.mget([f"attempt:{a}:state" for a in pending])
            for a, s in zip(pending, states, strict=True):
                final[a] = s
            if all(final[a] in TERMINAL for a in pending) or time.monotonic() >= deadline:
                return final
            await asyncio.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.submit", description=__doc__.split("\n")[0])
    p.add_argument("plan", nargs="?", help="plan file (YAML)")
    p.add_argument("--attempt-id", help="the candidate submission's attemptId")
    p.add_argument("--count", type=int, default=1, help="submit this many evaluations")
    p.add_argument("--prefix", default="", help="attemptId prefix with --count")
    p.add_argument("--cancel", metavar="ATTEMPT_ID")
    p.add_argument("--status", metavar="ATTEMPT_ID")
    p.add_argument("--wait", action="store_true", help="wait until every one is terminal")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--namespace")
    p.add_argument("--redis-url")
    p.add_argument("--amqp-url")
    args = p.parse_args(argv)
    config = env_config(namespace=args.namespace, redis_url=args.redis_url, amqp_url=args.amqp_url)
    if not (args.plan or args.cancel or args.status):
        p.error("give a plan to submit, --cancel ID or --status ID")
    plan = None
    if args.plan:
        try:
            plan = load_plan(args.plan)
        except PlanError as exc:
            print(exc, file=sys.stderr)
            return 2
    try:
        return asyncio.run(_run(config, plan, args))
    except (OSError, ConnectionError) as exc:
        print(f"engine.submit: cannot reach the services: {type(exc).__name__}", file=sys.stderr)
        return 3


async def _run(config: EngineConfig, plan: Plan | None, args: argparse.Namespace) -> int:
    async with EngineClient(config) as client:
        if args.cancel:
            print(
                json.dumps({"attempt_id": args.cancel, "state": await client.cancel(args.cancel)})
            )
            return 0
        if args.status:
            print(
                json.dumps({"attempt_id": args.status, "state": await client.status(args.status)})
            )
            return 0
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
