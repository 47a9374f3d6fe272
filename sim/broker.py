"""RabbitMQ, simulated: durable queues, manual ACK, delay tiers, private queues.

What the engine relies on, and nothing else:
- durable queues of persistent messages (they survive a broker kill); consumers with a
  prefetch window and manual ACK/NACK; a round-robin among the consumers with credit;
- a connection that closes (its process died, the broker died, `consumer_timeout`) hands
  its unacknowledged messages back to the front of their queues, `redelivered` set;
- one delay queue per (tier, bucket) with a queue-level TTL that dead-letters to the work
  queue; as in RabbitMQ, a message expires only when it reaches its queue's head, which
  matters once messages of one queue carry different TTLs (the `per_message_ttl`
  mutant's shared queue, `chaos.insim.mutants`);
- each worker's exclusive private queue, bound to the control fanout and deleted with
  its connection: a mandatory publish to it then comes back unroutable;
- dead-lettering is not confirmed: with `dead_letter_loss` > 0 a seeded draw drops some;
- the events topic exchange routes each event to the durable queues bound to its routing
  key (the harness's consumer of `evaluation.completed`); with none bound, publishing
  there only costs a round trip.

Frames of one connection arrive in order (TCP): each direction keeps the arrival time of
its last frame, and a later frame never overtakes it. `BrokerClient` is one process's
robust connection: publishes wait for a confirm, are retried with aio-pika's backoff
while disconnected (60 attempts), and the connection comes back every
`reconnect_interval_s` once the broker is up, with its private queue and consumers.

A worker's connection goes through its proxy (`sim.network`; nothing changes while it is
calm). A cut or reset connection is dropped by the broker at once (its unacked deliveries
requeued) and the robust client reconnects every interval while the proxy refuses. A
silent stream (a timeout toxic) is noticed only by AMQP heartbeats
(`BrokerClient.silence`): the broker after 2 to 3 intervals without data from the client,
the client after (H + 1) * 3 s without data from the broker; an ACK into the silence is
lost (redelivered after the drop), a publish waits `read_timeout_s` for its confirm and
is retried on the same channel, as the engine does (`engine.runtime.broker`).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import simpy

from engine.shell.effects import Unroutable
from sim.network import DOWN, UP, Conn, Link, size_of

WORK_QUEUE = "evaluation.execute"
SHARED_DELAY_QUEUE = "evaluation.retry.shared"
EVENTS = "evaluation.events"
CONTROL = "evaluation.control"


class Message:
    __slots__ = ("body", "expires_at", "message_id", "persistent", "redelivered", "routing_key")

    def __init__(
        self,
        body: dict[str, Any],
        message_id: str | None,
        routing_key: str = "",
        *,
        persistent: bool = True,
    ) -> None:
        self.body = body
        self.message_id = message_id
        self.routing_key = routing_key  # the key it was published with (its queue's name
        # for the default exchange: only the events' consumer reads it)
        self.persistent = persistent  # delivery mode 2: it survives a broker kill
        self.redelivered = False
        self.expires_at = 0.0


class Queue:
    __slots__ = ("consumers", "delay", "messages", "name", "owner", "rr", "timer", "ttl")

    def __init__(self, name: str, *, delay: bool = False, ttl: float | None = None) -> None:
        self.name = name
        self.messages: deque[Message] = deque()
        self.consumers: list[Consumer] = []
        self.rr = 0
        self.delay = delay  # a delay queue: no consumer, messages expire to the work queue
        self.ttl = ttl  # queue-level TTL (s); None on the shared per-message-TTL queue
        self.owner: Connection | None = None  # exclusive queues die with their connection
        self.timer: simpy.Event | None = None


class Consumer:
    __slots__ = ("conn", "handler", "prefetch", "queue", "unacked")

    def __init__(
        self, queue: Queue, conn: Connection, prefetch: int, handler: Callable[[Delivery], None]
    ) -> None:
        self.queue = queue
        self.conn = conn
        self.prefetch = prefetch
        self.handler = handler
        self.unacked = 0


class Connection:
    __slots__ = ("consumers", "in_at", "name", "net", "on_lost", "open", "out_at", "unacked")

    def __init__(self, name: str, on_lost: Callable[[Connection], None] | None) -> None:
        self.name = name
        self.open = True
        self.on_lost = on_lost  # told when the broker side closes it
        self.consumers: list[Consumer] = []
        self.unacked: dict[int, tuple[Message, Consumer]] = {}
        self.out_at = 0.0  # client -> broker: arrival of the last frame
        self.in_at = 0.0  # broker -> client
        self.net: Conn | None = None  # through a worker's proxy (sim.network)


class Delivery:
    """One delivery of a message to a consumer: what aio-pika's IncomingMessage is."""

    __slots__ = (
        "body",
        "conn",
        "delivery_mode",
        "message_id",
        "queue",
        "redelivered",
        "routing_key",
        "settled",
        "tag",
    )

    def __init__(self, conn: Connection, tag: int, message: Message, queue: str) -> None:
        self.conn = conn
        self.tag = tag
        self.queue = queue  # the consumer's queue
        self.body = message.body
        self.message_id = message.message_id
        self.routing_key = message.routing_key
        self.delivery_mode = 2 if message.persistent else 1
        self.redelivered = message.redelivered
        self.settled = False


class SimBroker:
    def __init__(
        self,
        env: simpy.Environment,
        rng: random.Random,
        latency_s: tuple[float, float],
        delay_queues: dict[tuple[int, int], tuple[str, float]],
        *,
        dead_letter_loss: float = 0.0,
        consumer_timeout_s: float | None = None,
        loses: Callable[[str | None], bool] | None = None,
        on_lost: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.env = env
        self.rng = rng
        self.latency_s = latency_s
        self.up = True
        self.dead_letter_loss = dead_letter_loss
        # which dead-lettered message is lost: a draw of its id (the live runner makes the
        # same one), else of the broker's rng; `on_lost` is told of each
        self.loses = loses
        self.on_lost = on_lost
        self.consumer_timeout_s = consumer_timeout_s
        self.queues: dict[str, Queue] = {WORK_QUEUE: Queue(WORK_QUEUE)}
        self.tier_ttl: dict[tuple[int, int], float] = {}  # (tier, bucket) -> its TTL (s)
        self.delay_route: dict[tuple[int, int], str] = {}  # (tier, bucket) -> queue name
        for key, (name, ttl) in delay_queues.items():
            self.queues[name] = Queue(name, delay=True, ttl=ttl)
            self.delay_route[key] = name
            self.tier_ttl[key] = ttl
        self.private: dict[str, Queue] = {}  # bound to the control fanout, in creation order
        self.event_bindings: list[tuple[str, str]] = []  # (routing key, durable queue)
        self.connections: list[Connection] = []
        self._tag = 0
        self.dead_letters_lost = 0

    def latency(self) -> float:
        lo, hi = self.latency_s
        return self.rng.uniform(lo, hi)

    # --- connections ------------------------------------------------------------------

    def connect(self, name: str, on_lost: Callable[[Connection], None] | None) -> Connection:
        conn = Connection(name, on_lost)
        self.connections.append(conn)
        return conn

    def bind_events(self, queue: str, routing_key: str) -> None:
        """Declare a durable queue (it survives a broker kill) and bind it to the events
        exchange for one exact routing key."""
        self.queues.setdefault(queue, Queue(queue))
        if (routing_key, queue) not in self.event_bindings:
            self.event_bindings.append((routing_key, queue))

    def declare_private(self, conn: Connection, name: str) -> None:
        q = Queue(name)
        q.owner = conn
        self.queues[name] = q
        self.private[name] = q

    def consume(
        self, conn: Connection, queue: str, prefetch: int, handler: Callable[[Delivery], None]
    ) -> None:
        q = self.queues[queue]
        c = Consumer(q, conn, prefetch, handler)
        q.consumers.append(c)
        conn.consumers.append(c)
        self._dispatch(q)

    def cancel_consumers(self, conn: Connection) -> None:
        """basic.cancel of every consumer of `conn`: nothing more is delivered to it; what
        it has not acknowledged stays its own until settled or the connection drops."""
        for c in conn.consumers:
            if c in c.queue.consumers:
                c.queue.consumers.remove(c)
        conn.consumers = []

    def drop(self, conn: Connection, *, exclusive_too: bool = True, tell: bool = False) -> None:
        """The broker closes `conn`: its unacked messages go back, its queues away."""
        if not conn.open:
            return
        conn.open = False
        if conn in self.connections:
            self.connections.remove(conn)
        touched: list[Queue] = []
        for c in conn.consumers:
            c.queue.consumers.remove(c)
        back: dict[str, list[Message]] = {}
        for msg, c in conn.unacked.values():  # in delivery order
            back.setdefault(c.queue.name, []).append(msg)
            c.unacked -= 1
        conn.unacked.clear()
        for name, msgs in back.items():
            q = self.queues.get(name)
            if q is None:  # an exclusive queue deleted meanwhile: its messages go with it
                continue
            for msg in reversed(msgs):
                msg.redelivered = True
                q.messages.appendleft(msg)
            touched.append(q)
        if exclusive_too:
            for name in [n for n, q in self.private.items() if q.owner is conn]:
                del self.private[name]
                del self.queues[name]
        conn.consumers = []
        for q in touched:
            if q.name in self.queues:
                self._dispatch(q)
        if tell and conn.on_lost is not None:
            conn.on_lost(conn)
        if conn.net is not None:  # the proxy sees the broker's side go, and closes
            conn.net.close("server")

    def kill(self) -> int:
        """SIGKILL the node: every connection drops (its unacknowledged deliveries go back to
        their queues, its exclusive queues away); durable queues stay with their persistent
        messages and lose the others (RabbitMQ holds a transient message in memory only,
        even in a durable queue). Returns how many messages the node held."""
        self.up = False
        for conn in list(self.connections):
            self.drop(conn, tell=True)
        held = 0
        for q in self.queues.values():
            q.timer = None  # no TTL runs while the node is down
            held += len(q.messages)
            if not all(m.persistent for m in q.messages):
                q.messages = deque(m for m in q.messages if m.persistent)
        return held

    def restart(self) -> int:
        """The node back; returns how many messages it found on disk."""
        self.up = True
        held = sum(len(q.messages) for q in self.queues.values())
        for q in self.queues.values():
            if q.delay:
                self._arm(q)  # messages that expired meanwhile dead-letter now
        return held

    # --- frames arriving at the broker ------------------------------------------------

    def publish_arrive(
        self,
        exchange: str,
        key: str,
        body: dict[str, Any],
        message_id: str | None,
        persistent: bool = True,
    ) -> bool:
        """Route one published message; False when nothing took it (unroutable: the default
        exchange with the name of no queue, as RabbitMQ, which drops it, or returns it
        when the publish is mandatory)."""
        if exchange == EVENTS:  # not mandatory: routed to the bound queues, if any
            for bound_key, name in self.event_bindings:
                if bound_key == key:
                    msg = Message(body, message_id, key, persistent=persistent)
                    self._enqueue(self.queues[name], msg)
            return True
        if exchange == CONTROL:
            for q in self.private.values():
                self._enqueue(q, Message(body, message_id, persistent=persistent))
            return True
        q = self.queues.get(key)
        if q is None:
            return False
        msg = Message(body, message_id, persistent=persistent)
        if q.delay:  # published to a tier queue by name: its queue-level TTL applies
            self.hold(q, msg, q.ttl or 0.0)
            return True
        self._enqueue(q, msg)
        return True

    def publish_delay(
        self, route: tuple[int, int], body: dict[str, Any], msg_id: str, persistent: bool = True
    ) -> bool:
        """A retry to delay queue (tier, bucket), under the tier's TTL; False (unroutable)
        when no such queue was declared."""
        name = self.delay_route.get(route)
        q = self.queues.get(name) if name is not None else None
        if q is None:
            return False
        self.hold(q, Message(body, msg_id, persistent=persistent), self.tier_ttl[route])
        return True

    def hold(self, q: Queue, msg: Message, ttl: float) -> None:
        """`msg` in delay queue `q` for `ttl` seconds, behind its head."""
        msg.expires_at = self.env.now + ttl
        q.messages.append(msg)
        if len(q.messages) == 1:
            self._arm(q)

    def settle_arrive(self, conn: Connection, tag: int, ack: bool) -> None:
        entry = conn.unacked.pop(tag, None)
        if entry is None or not conn.open:
            return
        msg, c = entry
        c.unacked -= 1
        q = c.queue
        if not ack:
            msg.redelivered = True
            q.messages.appendleft(msg)
        self._dispatch(q)

    # --- queues -----------------------------------------------------------------------

    def _enqueue(self, q: Queue, msg: Message) -> None:
        q.messages.append(msg)
        self._dispatch(q)

    def _dispatch(self, q: Queue) -> None:
        if not self.up or q.delay:
            return
        consumers = q.consumers
        while q.messages and consumers:
            n = len(consumers)
            for i in range(n):
                c = consumers[(q.rr + i) % n]
                if c.unacked < c.prefetch or not c.prefetch:  # 0: no limit, as in AMQP
                    break
            else:
                return
            q.rr = (q.rr + i + 1) % n
            self._deliver(c, q.messages.popleft())

    def _deliver(self, c: Consumer, msg: Message) -> None:
        self._tag += 1
        tag = self._tag
        conn = c.conn
        c.unacked += 1
        conn.unacked[tag] = (msg, c)
        delivery = Delivery(conn, tag, msg, c.queue.name)
        now = self.env.now
        at: float | None = now + self.latency()
        net = conn.net
        if net is not None and not net.link.calm:  # lost: unacked until the conn drops
            at = net.pass_(DOWN, size_of(msg.body), at)  # type: ignore[arg-type]
        if at is not None:
            at = max(at, conn.in_at)
            conn.in_at = at

            def arrive(_: simpy.Event) -> None:
                if conn.open and tag in conn.unacked:
                    c.handler(delivery)

            self.env.timeout(at - now).callbacks.append(arrive)
        if self.consumer_timeout_s is not None:

            def overdue(_: simpy.Event) -> None:
                if conn.open and tag in conn.unacked:
                    # the channel is closed with PRECONDITION_FAILED; the robust client opens
                    # a new one (the private queue belongs to the connection and stays)
                    self.drop(conn, exclusive_too=False, tell=True)

            self.env.timeout(self.consumer_timeout_s).callbacks.append(overdue)

    def _arm(self, q: Queue) -> None:
        """The TTL timer of a delay queue: its head's expiry (the only one RabbitMQ checks)."""
        if q.timer is not None or not q.messages or not self.up:
            return
        timer = self.env.timeout(max(0.0, q.messages[0].expires_at - self.env.now))
        q.timer = timer
        timer.callbacks.append(lambda _: self._expire(q, timer))

    def _expire(self, q: Queue, timer: simpy.Event) -> None:
        if q.timer is not timer:
            return  # the node was killed meanwhile: the restart re-armed it
        q.timer = None
        now = self.env.now
        work = self.queues[WORK_QUEUE]
        while q.messages and q.messages[0].expires_at <= now:
            msg = q.messages.popleft()
            if self.dead_letter_loss and (
                self.loses(msg.message_id)
                if self.loses is not None
                else self.rng.random() < self.dead_letter_loss
            ):
                self.dead_letters_lost += 1
                if self.on_lost is not None:
                    self.on_lost(msg.body)
                continue
            # dead-lettered with its properties: a transient message stays transient
            self._enqueue(work, Message(msg.body, msg.message_id, persistent=msg.persistent))
        self._arm(q)


class BrokerClient:
    """One process's robust AMQP connection (see the module docstring)."""

    #: Events are not rows of the store (`sim.drive`): `PgQueueClient`'s are.
    outbox = False

    ATTEMPTS = 60
    #: The delivery mode of the engine's publishes (`engine.runtime.wire`): 2, persistent.
    DELIVERY_MODE = 2

    def __init__(
        self,
        env: simpy.Environment,
        broker: SimBroker,
        name: str,
        *,
        reconnect_interval_s: float = 0.5,
        on_reconnected: Callable[[], None] | None = None,
        spawn: Callable[[Generator], Any] | None = None,
        link: Link | None = None,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        heartbeat_s: float = 60.0,
        delivery_mode: int | None = None,
    ) -> None:
        self.env = env
        self.broker = broker
        self.name = name
        # the engine's (`DELIVERY_MODE`) unless given: the runner's clients give theirs
        self.delivery_mode = self.DELIVERY_MODE if delivery_mode is None else delivery_mode
        self.reconnect_interval_s = reconnect_interval_s
        self.on_reconnected = on_reconnected
        self._spawn = spawn
        self.link = link  # the worker's proxy to the broker (None: the runner's clients)
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s  # a publish's confirm
        self.heartbeat_s = heartbeat_s  # negotiated: the client's (aiormq sets it)
        self.conn: Connection | None = None
        self._reviving: Connection | None = None  # the lost connection being replaced
        self.closed = False
        self._private: str | None = None
        self._consumers: list[tuple[str, int, Callable[[Delivery], None]]] = []

    # --- the connection -------------------------------------------------------------------

    def connect(self) -> Generator[simpy.Event, Any, bool]:
        """Open the connection (a few round trips); False when the broker is down."""
        link = self.link
        if link is not None and not link.calm:
            return (yield from self._connect_through(link))
        yield self.env.timeout(3 * self.broker.latency())
        if not self.broker.up:
            return False
        self.conn = self.broker.connect(self.name, self._lost)
        if link is not None:
            self._attach(link.open(self))
        return True

    def _attach(self, net: Conn | None) -> None:
        assert self.conn is not None
        self.conn.net = net
        if net is not None:
            net.tag = self.conn

    def _connect_through(self, link: Link) -> Generator[simpy.Event, Any, bool]:
        """The handshake's round trips through the proxy, within `connect_timeout_s`
        (aio-pika's `timeout`); refused at once by a disabled proxy."""
        env, broker = self.env, self.broker
        start = env.now
        net = link.open(self)
        if net is None:
            yield env.timeout(broker.latency())
            return False
        t: float | None = start
        for _ in range(3):
            t = net.pass_(UP, 64, t + broker.latency())  # type: ignore[operator]
            if t is None:
                break
            t = net.pass_(DOWN, 64, t + broker.latency())
            if t is None:
                break
        if t is None or t - start > self.connect_timeout_s:
            yield env.timeout(self.connect_timeout_s)
            net.close("client")
            return False
        yield env.timeout(t - start)
        if not net.open or not broker.up:
            net.close("client")
            return False
        self.conn = broker.connect(self.name, self._lost)
        self._attach(net)
        return True

    # --- what the network does to the connection (sim.network.Ends) ------------------------

    def client_lost(self, net: Conn) -> None:
        """The client sees its connection closed: the robust connection reconnects."""
        if isinstance(net.tag, Connection):
            self._lost(net.tag)

    def server_lost(self, net: Conn) -> None:
        """The broker sees it closed: it requeues what was not acknowledged."""
        if isinstance(net.tag, Connection):
            self.broker.drop(net.tag)

    def silence(self, net: Conn, stream: str, silent: bool) -> None:
        """A stream passes nothing now: AMQP heartbeats notice it.

        RabbitMQ (`rabbit_heartbeat`) checks the bytes it received every heartbeat
        interval H and closes the connection after two checks in a row saw none: 2 to
        3 H after the last data. aiormq 7 (`Connection.__heartbeat`) sends a heartbeat
        every max(1, H // 2) s and, at each of those ticks, gives up once nothing came
        for (H + 1) * 3 s. Either closing is seen by the other side through the proxy
        (a close passes a timeout toxic). An upstream silence is the broker's to notice,
        a downstream one the client's; the other direction's heartbeats keep flowing.
        """
        if not silent:
            return
        env, h = self.env, self.heartbeat_s
        gen, now, opened = net.quiet[stream], env.now, net.opened_at
        if stream == UP:
            first = opened + (int((now - opened) // h) + 1) * h  # its next check
            at, by = first + 2 * h, "server"
        else:
            step = max(1, int(h // 2))
            bound = now + 3 * (h + 1)
            at, by = opened + (int((bound - opened) // step) + 1) * step, "client"

        def give_up(_: simpy.Event) -> None:
            if net.open and net.silent[stream] and net.quiet[stream] == gen:
                net.close(by)

        env.timeout(at - now).callbacks.append(give_up)

    def consume_private(
        self, queue: str, prefetch: int, handler: Callable[[Delivery], None]
    ) -> None:
        assert self.conn is not None
        self._private = queue
        self.broker.declare_private(self.conn, queue)
        self._consumers.append((queue, prefetch, handler))
        self.broker.consume(self.conn, queue, prefetch, handler)

    def consume(self, queue: str, prefetch: int, handler: Callable[[Delivery], None]) -> None:
        assert self.conn is not None
        self._consumers.append((queue, prefetch, handler))
        self.broker.consume(self.conn, queue, prefetch, handler)

    def _lost(self, conn: Connection) -> None:
        if (
            conn is self.conn
            and not self.closed
            and self._spawn is not None
            and self._reviving is not conn
        ):
            self._reviving = conn
            self._spawn(self._reconnect())

    def _reconnect(self) -> Generator[simpy.Event, Any, None]:
        """aio-pika's connect_robust: try again every interval, then restore the topology."""
        while not self.closed:
            yield self.env.timeout(self.reconnect_interval_s)
            if self.closed:
                return
            if not (yield from self.connect()):
                continue
            conn = self.conn
            assert conn is not None
            for queue, prefetch, handler in self._consumers:
                if queue == self._private:
                    kept = self.broker.queues.get(queue)
                    if kept is None:  # deleted with the old connection: declared again
                        self.broker.declare_private(conn, queue)
                    else:  # a closed channel (consumer_timeout): the queue stays, ours
                        kept.owner = conn
                self.broker.consume(conn, queue, prefetch, handler)
            if self.on_reconnected is not None:
                self.on_reconnected()
            return

    def stop_consuming(self) -> Generator[simpy.Event, Any, None]:
        """Cancel every consumer (aio-pika's `queue.cancel`, awaited: the cancel reaches the
        broker, its CancelOk comes back); deliveries sent before the cancel arrived still
        arrive. A reconnect no longer restores them."""
        self._consumers = []
        conn = self.conn
        if conn is None or not conn.open:
            return
        yield self._frame(conn)
        self.broker.cancel_consumers(conn)
        yield self.env.timeout(self.broker.latency())

    def close_now(self) -> None:
        """The process died: the kernel closes the socket; the broker notices after the
        frames already on their way."""
        self.closed = True
        conn = self.conn
        if conn is None or not conn.open:
            return
        self._frame(conn).callbacks.append(lambda _: self.broker.drop(conn))

    def close(self) -> Generator[simpy.Event, Any, None]:
        """A clean close: the broker requeues what was not acknowledged."""
        self.closed = True
        conn = self.conn
        if conn is None or not conn.open:
            return
        yield self._frame(conn)
        self.broker.drop(conn)

    def _frame(self, conn: Connection) -> simpy.Event:
        now = self.env.now
        at = max(now + self.broker.latency(), conn.out_at)
        conn.out_at = at
        return self.env.timeout(at - now)

    # --- messages -------------------------------------------------------------------------

    def settle(self, d: Delivery, *, ack: bool = True) -> bool:
        """ACK (or NACK with requeue); False when the delivery's channel is gone."""
        if d.settled or not d.conn.open:
            return False
        d.settled = True
        conn, broker = d.conn, self.broker
        net = conn.net
        if net is not None and not net.link.calm:
            frame = self._frame_through(conn, net, 24)
            if frame is not None:  # else lost: the broker redelivers once the conn drops
                frame.callbacks.append(lambda _: broker.settle_arrive(conn, d.tag, ack))
            return True
        self._frame(conn).callbacks.append(lambda _: broker.settle_arrive(conn, d.tag, ack))
        return True

    def _frame_through(self, conn: Connection, net: Conn, size: int) -> simpy.Event | None:
        """A frame to the broker through the proxy's toxics; None when it is lost."""
        now = self.env.now
        at = net.pass_(UP, size, now + self.broker.latency())
        if at is None:
            return None
        at = max(at, conn.out_at)
        conn.out_at = at
        return self.env.timeout(at - now)

    def publish(
        self,
        exchange: str,
        key: str,
        body: dict[str, Any],
        message_id: str | None,
        *,
        mandatory: bool,
        delay_route: tuple[int, int] | None = None,
    ) -> Generator[simpy.Event, Any, None]:
        """A confirmed publish; `Unroutable` when a mandatory one comes back."""
        env, broker = self.env, self.broker
        persistent = self.delivery_mode == 2
        backoff = 0.05
        for attempt in range(self.ATTEMPTS):
            conn = self.conn
            net = conn.net if conn is not None else None
            if conn is not None and net is not None and conn.open and not net.link.calm:
                if (
                    yield from self._publish_through(
                        conn, net, exchange, key, body, message_id, mandatory, delay_route
                    )
                ):
                    return
            elif conn is not None and conn.open:
                box: list[bool] = []

                def arrive(_: simpy.Event, conn: Connection = conn, box: list[bool] = box) -> None:
                    if conn.open and broker.up:
                        if delay_route is not None:
                            box.append(
                                broker.publish_delay(delay_route, body, message_id, persistent)
                            )
                        else:
                            box.append(
                                broker.publish_arrive(exchange, key, body, message_id, persistent)
                            )

                request = self._frame(conn)
                request.callbacks.append(arrive)
                yield request
                if box:
                    yield env.timeout(broker.latency())  # the confirm, or the return
                    if conn.open:
                        if mandatory and not box[0]:
                            raise Unroutable(f"unroutable: routing key {key!r}")
                        return
            if attempt == self.ATTEMPTS - 1:
                raise ConnectionError("broker unreachable (simulated)")
            yield env.timeout(backoff)
            backoff = min(backoff * 2, 1.0)

    def _publish_through(
        self,
        conn: Connection,
        net: Conn,
        exchange: str,
        key: str,
        body: dict[str, Any],
        message_id: str | None,
        mandatory: bool,
        delay_route: tuple[int, int] | None,
    ) -> Generator[simpy.Event, Any, bool]:
        """One attempt through the proxy: True once confirmed. A confirm that does not
        come within `read_timeout_s` fails the attempt (the engine retries it on the same
        channel); so does the connection closing."""
        env, broker = self.env, self.broker
        persistent = self.delivery_mode == 2
        confirm = env.event()
        frame = self._frame_through(conn, net, size_of(body))
        if frame is not None:

            def arrive(_: simpy.Event) -> None:
                if not conn.open or not broker.up:
                    return
                if delay_route is not None:
                    routed = broker.publish_delay(delay_route, body, message_id, persistent)
                else:
                    routed = broker.publish_arrive(exchange, key, body, message_id, persistent)
                t = env.now
                back = net.pass_(DOWN, 24, t + broker.latency())
                if back is None:
                    return  # published, its confirm lost: a retry publishes it again

                def confirmed(_: simpy.Event) -> None:
                    if conn.open and not confirm.triggered:
                        confirm.succeed(routed)

                env.timeout(back - t).callbacks.append(confirmed)

            frame.callbacks.append(arrive)
        yield confirm | net.closed() | env.timeout(self.read_timeout_s)
        if not confirm.triggered:
            return False
        if mandatory and not confirm.value:
            raise Unroutable(f"unroutable: routing key {key!r}")
        return True

    def publish_work(self, body: dict[str, Any], message_id: str) -> Generator:
        return self.publish("", WORK_QUEUE, body, message_id, mandatory=True)

    def publish_retry(
        self, tier: int, bucket: int, body: dict[str, Any], message_id: str
    ) -> Generator:
        route = (tier, bucket)
        queue = self.broker.delay_route[route]  # KeyError, as live, for a route not declared
        return self.publish("", queue, body, message_id, mandatory=True, delay_route=route)

    def forward(self, queue: str, body: dict[str, Any], message_id: str | None) -> Generator:
        return self.publish("", queue, body, message_id, mandatory=True)

    def publish_event(self, routing_key: str, body: dict[str, Any], message_id: str) -> Generator:
        return self.publish(EVENTS, routing_key, body, message_id, mandatory=False)

    def publish_control(self, body: dict[str, Any]) -> Generator:
        return self.publish(CONTROL, "", body, None, mandatory=False)
