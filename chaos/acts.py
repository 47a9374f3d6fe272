"""What the runner asks of its world, as plain values (`chaos.conductor` yields them).

The live runner carries each act out on processes, Redis and RabbitMQ (`chaos.runner`),
the simulated one on simpy (`chaos.insim.run`); either sends the reply back into the
conductor, or throws the error in. Worker acts name a `Slot`, whose process is the
runner's own kind (`chaos.supervision.Process`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chaos.proxy.model import ToxicSpec
    from chaos.supervision import Slot
    from engine.plan import Plan


@dataclass(frozen=True, slots=True)
class Now:
    """The runner's clock in seconds: monotonic live, simulated in sim."""


@dataclass(frozen=True, slots=True)
class Sleep:
    seconds: float


@dataclass(frozen=True, slots=True)
class Record:
    """A history event of the runner."""

    event: str
    fields: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Show:
    """The progress moved (`Conductor.progress`): live, the display redraws it."""


@dataclass(frozen=True, slots=True)
class Spawn:
    """Run `step` alongside (a fault loop, a fault undone later); it is stopped where it
    waits by `StopSpawned`. Its error is the run's: a failing nemesis is a harness bug."""

    step: Generator[Any, Any, Any]


@dataclass(frozen=True, slots=True)
class StopSpawned:
    pass


@dataclass(frozen=True, slots=True)
class StartWorker:
    """A new worker process for `slot`, with these failpoints armed ("": none); the
    process is sent back."""

    slot: Slot[Any]
    failpoints: str


@dataclass(frozen=True, slots=True)
class WaitReady:
    """Until each slot's worker has said it is ready, or has died."""

    slots: tuple[Slot[Any], ...]


@dataclass(frozen=True, slots=True)
class KillWorker:
    """SIGKILL the slot's worker (its whole process group)."""

    slot: Slot[Any]


@dataclass(frozen=True, slots=True)
class TerminateWorker:
    """SIGTERM the slot's worker, SIGKILL if it has not stopped within `timeout_s`."""

    slot: Slot[Any]
    timeout_s: float


@dataclass(frozen=True, slots=True)
class PauseWorker:
    """SIGSTOP the slot's worker; `ResumeWorker` after `pause_s` (the simulator freezes it
    for that long at once)."""

    slot: Slot[Any]
    pause_s: float


@dataclass(frozen=True, slots=True)
class ResumeWorker:
    slot: Slot[Any]


#: The key of `KillService`'s answer that says the system fails over by itself.
FAILS_OVER = "fails_over"


@dataclass(frozen=True, slots=True)
class KillService:
    """SIGKILL a service of the system (`graceful`: stop it cleanly, SIGTERM or `docker
    stop`; the simulator, where nothing acknowledged is lost either way, kills it). Sent
    back: what the kill's record carries besides the service, where the system can count
    it (`messages`: what the broker held), and `FAILS_OVER` when the system promotes a
    replica by itself (Redis behind Sentinel): the fault heals once that is done."""

    name: str
    graceful: bool = False


@dataclass(frozen=True, slots=True)
class RestartService:
    """Bring a service back ("redis" losing `redis.lose_last_writes` writes first). Sent
    back: what the restart's record carries besides the service, where the system can
    count it (`lost_writes`: the acknowledged writes it lost; `messages`: what the broker
    found on disk)."""

    name: str


@dataclass(frozen=True, slots=True)
class PauseService:
    """SIGSTOP "redis" (behind Sentinel: the primary) or "broker" (`docker pause` in
    containers mode) with its sockets open: it neither answers nor fails, what clients
    send waits in its buffers; `ResumeService` after `pause_s`. The simulator pauses
    Redis only (`chaos.insim.run.refusal`)."""

    name: str
    pause_s: float


@dataclass(frozen=True, slots=True)
class ResumeService:
    """SIGCONT the paused server: it runs what waited and answers it. Behind Sentinel, if
    the replica was promoted meanwhile, the old primary answers from data nobody keeps and
    is then made a replica of the new one (as an operator would at once); whether the
    replica was promoted is sent back."""

    name: str


@dataclass(frozen=True, slots=True)
class KillSentinel:
    """SIGKILL sentinel `index` (of three, quorum 2)."""

    index: int


@dataclass(frozen=True, slots=True)
class RestartSentinel:
    index: int


@dataclass(frozen=True, slots=True)
class AwaitFailover:
    """Redis behind Sentinel, its primary killed: wait until a primary serves again, the
    replica promoted by the sentinels or the old primary back first; whether the replica
    was promoted is sent back. A system that counts what the promotion lost (PostgreSQL's
    standby) sends back the failover's record instead: `promoted` and, e.g., `lost_writes`
    (the acknowledged writes the promoted node lacks)."""


@dataclass(frozen=True, slots=True)
class AddToxic:
    """Add `toxic` to the proxy of each of `workers` to `link` ("redis" or "broker"):
    live through the Toxiproxy API, in sim on the simulated link."""

    link: str
    workers: tuple[int, ...]
    toxic: ToxicSpec


@dataclass(frozen=True, slots=True)
class UpdateToxic:
    """Set the toxicity and attributes of the toxic named `toxic.name` (none there: no-op)."""

    link: str
    workers: tuple[int, ...]
    toxic: ToxicSpec


@dataclass(frozen=True, slots=True)
class RemoveToxic:
    """Take the toxic `name` away (none there: no-op)."""

    link: str
    workers: tuple[int, ...]
    name: str


@dataclass(frozen=True, slots=True)
class CutLink:
    """Disable the proxies: their connections close, new ones are refused."""

    link: str
    workers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RestoreLink:
    link: str
    workers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ResetLinks:
    """Every proxy enabled, every toxic gone (Toxiproxy's `/reset`): the end of a run, so
    that the workers stop as they would on a sound network."""


@dataclass(frozen=True, slots=True)
class Connect:
    """The runner's client of the engine (`engine.submit.EngineClient`), until
    `Disconnect`."""


@dataclass(frozen=True, slots=True)
class Disconnect:
    pass


@dataclass(frozen=True, slots=True)
class BindConsumer:
    """The harness's consumer of `evaluation.completed` and `evaluation.started`, until
    `CloseConsumer`: a durable queue bound to both before the first submit; each delivery
    recorded (`completed_received`, `started_received`), then acknowledged."""


@dataclass(frozen=True, slots=True)
class CloseConsumer:
    pass


@dataclass(frozen=True, slots=True)
class Submit:
    attempt_id: str
    plan: Plan


@dataclass(frozen=True, slots=True)
class Cancel:
    """`EngineClient.cancel`, on a connection of its own: the state it left is sent back."""

    attempt_id: str


@dataclass(frozen=True, slots=True)
class Resume:
    """`EngineClient.resume` from checkpoint number `checkpoint` (None: the last), on a
    connection of its own: the document's answer is sent back."""

    attempt_id: str
    checkpoint: int | None


@dataclass(frozen=True, slots=True)
class PublishRaw:
    """Put `body`, bytes as they are, on the work queue, on a connection of its own (a
    poison message: `chaos.poison`)."""

    body: bytes
    message_id: str


@dataclass(frozen=True, slots=True)
class Settled:
    """How many of `attempt_ids` are terminal and announced (0 while Redis is down)."""

    attempt_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Leases:
    """Which of `attempt_ids` hold a lease (their `owner` key), and the holder's name;
    None while Redis is down."""

    attempt_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Announced:
    """Which of `attempt_ids` Redis marks announced (`final_published`); none while it is
    down."""

    attempt_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Received:
    """The attempt ids whose `evaluation.completed` the consumer holds."""


@dataclass(frozen=True, slots=True)
class Tail:
    """The history events appended since `cursor` (None: the start), whole ones only, and
    the cursor after them."""

    cursor: Any


@dataclass(frozen=True, slots=True)
class ReadFinal:
    """The final state (`chaos.checker.FinalState`), with Redis brought back if it is down."""


Act = (
    Now
    | Sleep
    | Record
    | Show
    | Spawn
    | StopSpawned
    | StartWorker
    | WaitReady
    | KillWorker
    | TerminateWorker
    | PauseWorker
    | ResumeWorker
    | KillService
    | RestartService
    | PauseService
    | ResumeService
    | KillSentinel
    | RestartSentinel
    | AwaitFailover
    | AddToxic
    | UpdateToxic
    | RemoveToxic
    | CutLink
    | RestoreLink
    | ResetLinks
    | Connect
    | Disconnect
    | BindConsumer
    | CloseConsumer
    | Submit
    | Cancel
    | Resume
    | PublishRaw
    | Settled
    | Leases
    | Announced
    | Received
    | Tail
    | ReadFinal
)
Step = Generator[Act, Any, Any]
Handler = Callable[[Any, Any], Any]
#: Every act, in the order above.
ACTS: tuple[type, ...] = Act.__args__  # type: ignore[attr-defined]


#: The acts a system under test carries out (`chaos.systems`): its services, its client,
#: its consumer, what it holds. The others are the interpreter's own, whatever the design:
#: time, the history, the workers' processes, the proxies.
SYSTEM_ACTS: frozenset[type] = frozenset(
    {
        KillService,
        RestartService,
        PauseService,
        ResumeService,
        KillSentinel,
        RestartSentinel,
        AwaitFailover,
        Connect,
        Disconnect,
        BindConsumer,
        CloseConsumer,
        Submit,
        Cancel,
        Resume,
        PublishRaw,
        Settled,
        Leases,
        Announced,
        ReadFinal,
    }
)


def handler_name(act: type) -> str:
    """`on_<act>`: `on_stop_spawned` for `StopSpawned`."""
    return "on_" + re.sub(r"(?<!^)(?=[A-Z])", "_", act.__name__).lower()


def handlers(
    driver: type, system: type, waits: Callable[[Callable[..., Any]], bool]
) -> tuple[dict[type, Handler], dict[type, Handler]]:
    """A driver's tables for `engine.shell.effects.Stepper`: each act to its method
    `on_<act>` on the interpreter (`driver`), or on its system under test (`driver.system`,
    an instance of `system`) for `SYSTEM_ACTS`, called as `handler(act, driver)`; the acts
    carried out at once, then those `waits(method)` says are waited for. A driver or a
    system that lacks one fails here, when the pair is first used."""
    now: dict[type, Handler] = {}
    later: dict[type, Handler] = {}
    for act in ACTS:
        name = handler_name(act)
        owner = system if act in SYSTEM_ACTS else driver
        method = getattr(owner, name, None)
        if method is None:
            raise TypeError(f"{owner.__name__} does not carry out {act.__name__} ({name})")
        handler = _of_system(name) if act in SYSTEM_ACTS else _as_handler(name)
        (later if waits(method) else now)[act] = handler
    return now, later


def _as_handler(name: str) -> Handler:
    """The driver's method, looked up on the driver (a subclass may carry an act out its
    own way)."""
    return lambda act, driver: getattr(driver, name)(act)


def _of_system(name: str) -> Handler:
    return lambda act, driver: getattr(driver.system, name)(act)
