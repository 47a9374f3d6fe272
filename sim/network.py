"""The network between a worker and a service: Toxiproxy's proxies and toxics, simulated.

Live, each worker reaches Redis and RabbitMQ through proxies of its own (`chaos.links`:
`w{i}.redis`, `w{i}.broker`), and scenarios add toxics to them or disable them. Here a
`Link` is one such proxy and a `Conn` one TCP connection through it: the clients
(`sim.redis.RedisClient`, `sim.broker.BrokerClient`) pass each message through
`Conn.pass_`, which says when it leaves the proxy, or that it never does.

What Toxiproxy (and `chaos.proxy.toxics`, its port) does, kept:
- connections are numbered per proxy from 0 (`link_no`); toxics chain per stream
  (`upstream`: client to service, `downstream`: back) in the order they were added;
  adding, updating and removing reaches the connections already open;
- whether a toxic applies to a connection, its jitter and its slices come from the draw
  rule of `chaos.proxy.model` (`toxic_rng`: one stream per toxic, stream and link; the
  toxicity draw `u` when the toxic meets the connection, re-tested on an update), handed
  in as a `DrawRule` (`sim` imports nothing of `chaos`), so the live proxy and the
  simulator draw alike;
- latency (+ jitter, order kept per connection: the clients never let a message overtake
  the one before it), bandwidth (a message leaves `size / rate` after the one before it
  has; rate 0 passes nothing), slicer (its pieces `delay` us apart), limit_data (the
  connection closes once `bytes` went through; the byte that does not fit is lost),
  timeout (messages vanish; with timeout > 0 the connection closes once that long passed
  without data, as Go restarts its timer on each chunk; 0 holds it open; removing an
  applying timeout closes the connection, Toxiproxy's `CleanupToxic`), reset_peer (the
  first message vanishes and the connection is reset `timeout` ms later, even if the toxic
  is removed meanwhile), slow_close (a close is seen that late by the side the stream
  leads to; a reset is not delayed), and a disabled proxy (its connections close at once,
  new ones are refused).
- a close always passes, even through a timeout toxic (Toxiproxy's toxics close their
  stub on end of stream), so whoever gives up on a silent connection and closes it is
  seen to by the other side.

Not modelled: message sizes are estimated (`size_of`: the repr of what travels, plus a
frame's header) rather than serialised; the slicer's pieces only delay a message (their
size variation draws, nothing else); a message already on its way when a toxic is added
to a calm link, or when the link is cut, is not affected by it (its bytes are past the
proxy); Redis's connection pool is one connection per worker (the sim's FIFO client).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

import simpy

UP = "upstream"  # client to service
DOWN = "downstream"  # service to client
STREAMS = (UP, DOWN)
HEADER = 32  # bytes of framing a message carries besides its body


def size_of(obj: Any) -> int:
    """A message's rough size in bytes: the length of the repr of what it carries."""
    return HEADER + len(repr(obj))


class DrawRule(Protocol):
    """The seeded draws of the proxies (`chaos.proxy.model` is one)."""

    def toxic_rng(
        self, seed: int, proxy: str, toxic: str, stream: str, link_no: int
    ) -> random.Random: ...

    def toxicity_draw(self, rng: random.Random) -> float: ...

    def applies(self, u: float, toxicity: float) -> bool: ...

    def latency_ms(self, rng: random.Random, latency: int, jitter: int) -> int: ...

    def slice_offsets(
        self, rng: random.Random, size: int, average: int, variation: int
    ) -> list[int]: ...


class Toxic:
    """One toxic, from Toxiproxy's API dict (`name`, `type`, `stream`, `toxicity`,
    `attributes`)."""

    __slots__ = ("attrs", "name", "stream", "toxicity", "type")

    def __init__(self, api: dict[str, Any]) -> None:
        self.type: str = api["type"]
        self.stream: str = api.get("stream") or DOWN
        self.name: str = api.get("name") or f"{self.type}_{self.stream}"
        self.toxicity = float(api.get("toxicity", 1.0))
        self.attrs: dict[str, int] = dict(api.get("attributes") or {})

    def updated(self, api: dict[str, Any]) -> Toxic:
        """Toxiproxy's update: attributes merged, toxicity replaced, the rest kept."""
        attrs = {**self.attrs, **(api.get("attributes") or {})}
        return Toxic(
            {
                "type": self.type,
                "stream": self.stream,
                "name": self.name,
                "toxicity": api.get("toxicity", self.toxicity),
                "attributes": attrs,
            }
        )

    def attr(self, key: str) -> int:
        return int(self.attrs.get(key, 0))


class Ends(Protocol):
    """The client's side of a connection: told when either end sees it closed, and when
    a stream falls silent or speaks again (what AMQP heartbeats notice)."""

    def client_lost(self, conn: Conn) -> None: ...

    def server_lost(self, conn: Conn) -> None: ...

    def silence(self, conn: Conn, stream: str, silent: bool) -> None: ...


class Met:
    """One toxic on one stream of one connection: its draws and its state."""

    __slots__ = ("on", "rng", "state", "toxic", "u")

    def __init__(self, toxic: Toxic, rng: random.Random, rule: DrawRule) -> None:
        self.toxic = toxic
        self.rng = rng
        self.u = rule.toxicity_draw(rng)
        self.on = rule.applies(self.u, toxic.toxicity)
        self.state: dict[str, Any] = {}


class Conn:
    """One TCP connection through a `Link` (both its streams)."""

    __slots__ = (
        "closed_at",
        "ends",
        "link",
        "met",
        "no",
        "open",
        "opened_at",
        "quiet",
        "seen",
        "silent",
        "tag",
        "watch",
    )

    def __init__(self, link: Link, no: int, ends: Ends | None) -> None:
        self.link = link
        self.no = no
        self.ends = ends
        self.open = True
        self.opened_at = link.env.now
        self.closed_at: float | None = None
        self.met: dict[str, Met] = {}  # toxic name -> its draws on this connection
        self.silent = {UP: False, DOWN: False}
        self.quiet = {UP: 0, DOWN: 0}  # one more each time a stream's silence changes
        self.tag: Any = None  # the client's own (the broker connection it carries)
        self.seen = False  # the client has seen it closed
        self.watch: simpy.Event | None = None  # triggered then

    # --- toxics meeting it --------------------------------------------------------------

    def meet(self, toxic: Toxic) -> None:
        """`toxic` (new or updated) reaches this connection: its toxicity decided."""
        m, link = self.met.get(toxic.name), self.link
        if m is None:
            rng = link.rule.toxic_rng(link.seed, link.name, toxic.name, toxic.stream, self.no)
            m = self.met[toxic.name] = Met(toxic, rng, link.rule)
        else:  # an update re-tests the same draw, and restarts the toxic
            m.toxic = toxic
            m.on = link.rule.applies(m.u, toxic.toxicity)
        if m.on and toxic.type == "timeout":
            self._arm_timeout(m)
        self._resound()

    def forget(self, name: str) -> None:
        m = self.met.pop(name, None)
        if m is not None and m.on and m.toxic.type == "timeout":
            self.close("proxy")  # Toxiproxy's CleanupToxic: the stream it broke closes
        self._resound()

    def _arm_timeout(self, m: Met) -> None:
        ms = m.toxic.attr("timeout")
        if ms <= 0:
            return
        gen = m.state["gen"] = m.state.get("gen", 0) + 1

        def fire(_: simpy.Event) -> None:
            if self.met.get(m.toxic.name) is m and m.on and m.state.get("gen") == gen:
                self.close("proxy")

        self.link.env.timeout(ms / 1000).callbacks.append(fire)

    def _resound(self) -> None:
        """Tell the client which streams pass nothing at all any more (or again)."""
        for stream in STREAMS:
            silent = any(
                m.on
                and m.toxic.stream == stream
                and (
                    m.toxic.type == "timeout"
                    or (m.toxic.type == "bandwidth" and m.toxic.attr("rate") <= 0)
                )
                for m in self.met.values()
            )
            if silent != self.silent[stream]:
                self.silent[stream] = silent
                self.quiet[stream] += 1
                if self.ends is not None and self.open:
                    self.ends.silence(self, stream, silent)

    # --- messages -----------------------------------------------------------------------

    def pass_(self, stream: str, size: int, t: float) -> float | None:
        """A message of `size` bytes reaching the proxy at `t` on `stream`: when it leaves
        it, after every toxic of the chain; None when it never does."""
        if not self.open:
            return None
        rule = self.link.rule
        for toxic in list(self.link.toxics.values()):
            m = self.met.get(toxic.name)
            if toxic.stream != stream or m is None or not m.on:
                continue
            kind = toxic.type
            if kind == "latency":
                t += (
                    max(0, rule.latency_ms(m.rng, toxic.attr("latency"), toxic.attr("jitter")))
                    / 1000
                )
            elif kind == "bandwidth":
                rate = toxic.attr("rate")
                if rate <= 0:
                    return None
                t = max(t, m.state.get("busy", 0.0)) + size / (rate * 1000)
                m.state["busy"] = t
            elif kind == "slicer":
                cuts = rule.slice_offsets(
                    m.rng, size, max(1, toxic.attr("average_size")), toxic.attr("size_variation")
                )
                t += max(0, len(cuts) - 2) * toxic.attr("delay") / 1e6
            elif kind == "limit_data":
                limit, sent = toxic.attr("bytes"), m.state.get("sent", 0)
                room = max(0, limit - sent)
                m.state["sent"] = sent + min(size, room)
                if m.state["sent"] >= limit:
                    self._at(t, lambda: self.close("proxy"))
                if size > room:
                    return None  # cut short: the client cannot use half a message
            elif kind == "timeout":
                self._arm_timeout(m)  # Go's timer restarts on each chunk dropped
                return None
            elif kind == "reset_peer":
                if "armed" not in m.state:
                    m.state["armed"] = True
                    self._at(t + toxic.attr("timeout") / 1000, lambda: self.close("proxy", True))
                return None
        return t

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        env = self.link.env
        if t <= env.now:
            fn()
        else:
            env.timeout(t - env.now).callbacks.append(lambda _: fn())

    # --- closing ------------------------------------------------------------------------

    def slow_close_s(self, stream: str) -> float:
        """How late a close is seen at the end `stream` leads to (slow_close toxics)."""
        return sum(
            m.toxic.attr("delay") / 1000
            for m in self.met.values()
            if m.on and m.toxic.type == "slow_close" and m.toxic.stream == stream
        )

    def close(self, by: str, reset: bool = False) -> None:
        """Closed by `by` ("proxy", "client" or "server"): the closer knows at once, the
        other end once the close has come through (slow_close; a reset at once)."""
        if not self.open:
            return
        self.open = False
        self.closed_at = self.link.env.now
        self.link.conns.remove(self)
        to_client = 0.0 if by == "client" or reset else self.slow_close_s(DOWN)
        to_server = 0.0 if by == "server" or reset else self.slow_close_s(UP)
        if by != "client":
            self._at(self.closed_at + to_server, self._tell_server)
            self._at(self.closed_at + to_client, self._tell_client)
        else:
            self._tell_client()
            self._at(self.closed_at + to_server, self._tell_server)

    def discard(self) -> None:
        """The client's process is gone: nothing is told, what it sent still lands."""
        if self.open:
            self.seen = True
            self.open = False
            self.link.conns.remove(self)

    def closed(self) -> simpy.Event:
        """An event triggered when the client sees this connection closed."""
        if self.watch is None:
            self.watch = self.link.env.event()
            if self.seen:
                self.watch.succeed()
        return self.watch

    def _tell_client(self) -> None:
        self.seen = True
        if self.watch is not None and not self.watch.triggered:
            self.watch.succeed()
        if self.ends is not None:
            self.ends.client_lost(self)

    def _tell_server(self) -> None:
        if self.ends is not None:
            self.ends.server_lost(self)


class Link:
    """One proxy: a worker's link to one service."""

    __slots__ = ("calm", "conns", "count", "enabled", "env", "name", "rule", "seed", "toxics")

    def __init__(self, env: simpy.Environment, seed: int, rule: DrawRule, name: str) -> None:
        self.env = env
        self.seed = seed
        self.rule = rule
        self.name = name
        self.enabled = True
        self.toxics: dict[str, Toxic] = {}  # in the order added
        self.conns: list[Conn] = []  # open, in the order opened
        self.count = 0  # connections accepted so far: the next link_no
        self.calm = True  # enabled and without toxics: the clients' fast path

    def _settle(self) -> None:
        self.calm = self.enabled and not self.toxics

    def open(self, ends: Ends | None) -> Conn | None:
        """A new connection; None when the proxy is disabled (refused)."""
        if not self.enabled:
            return None
        conn = Conn(self, self.count, ends)
        self.count += 1
        self.conns.append(conn)
        for toxic in list(self.toxics.values()):
            conn.meet(toxic)
        return conn

    def add(self, api: dict[str, Any]) -> None:
        """Add a toxic (one of that name already there is updated instead, as live)."""
        toxic = Toxic(api)
        if toxic.name in self.toxics:
            self.update(api)
            return
        self.toxics[toxic.name] = toxic
        self._settle()
        for conn in list(self.conns):
            conn.meet(toxic)

    def update(self, api: dict[str, Any]) -> None:
        old = self.toxics.get(api.get("name", ""))
        if old is None:
            return
        toxic = self.toxics[old.name] = old.updated(api)
        for conn in list(self.conns):
            conn.meet(toxic)

    def remove(self, name: str) -> None:
        if self.toxics.pop(name, None) is None:
            return
        self._settle()
        for conn in list(self.conns):
            conn.forget(name)

    def cut(self) -> None:
        """Disable the proxy: its connections close, new ones are refused."""
        self.enabled = False
        self._settle()
        for conn in list(self.conns):
            conn.close("proxy", reset=True)

    def restore(self) -> None:
        self.enabled = True
        self._settle()

    def reset(self) -> None:
        for name in list(self.toxics):
            self.remove(name)
        self.restore()


class Network:
    """Every worker's links, by (worker index, service): they outlive incarnations, as
    the live proxies outlive the processes that use them."""

    def __init__(self, env: simpy.Environment, seed: int, rule: DrawRule) -> None:
        self.env = env
        self.seed = seed
        self.rule = rule
        self.links: dict[tuple[int, str], Link] = {}

    def link(self, worker: int, service: str) -> Link:
        key = (worker, service)
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = Link(self.env, self.seed, self.rule, f"w{worker}.{service}")
        return link

    def reset(self) -> None:
        """Toxiproxy's reset: every proxy enabled, every toxic gone."""
        for link in self.links.values():
            link.reset()
