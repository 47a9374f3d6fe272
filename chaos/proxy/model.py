"""What a toxic and a proxy are, and how their random choices are drawn. Pure: no I/O.

The models are the Toxiproxy 2.x wire shapes (`README.md`, "Toxic fields" and "Proxy
fields"), with Toxiproxy's defaults: a toxic's name is `<type>_<stream>`, its stream
`downstream`, its toxicity 1.0, and every attribute 0 (Go's zero values), so a spec that
Toxiproxy takes means the same here. The scenario schema reuses them.

The draw rule (the simulator reproduces it, so keep it and this text in step):

* Connections are numbered per proxy from 0 in accept order (`link_no`); a connection's
  two links, `upstream` (client -> server) and `downstream` (server -> client), share it.
  The count lives as long as the proxy: disabling and re-enabling it does not restart it,
  deleting and re-creating the proxy does.
* Each toxic on each link draws from its own stream,
  `random.Random(f"{seed}:{proxy}:{toxic}:{stream}:{link_no}")` (`toxic_rng`), so what a
  connection draws never depends on how other connections interleave with it.
* The first draw is `u = rng.random()`; the toxic applies to that link while
  `u < toxicity` (`applies`). Updating a toxic's toxicity re-tests the same `u`.
* Then, in the order the link's data meets the toxic: `latency` draws its jitter once per
  chunk, `rng.randrange(2 * jitter) - jitter` (`jitter_ms`, nothing when jitter is 0),
  and `slicer` draws its cut points per chunk (`slice_offsets`, Toxiproxy's recursion).
"""

from __future__ import annotations

import random
import re
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from engine.validation import describe, expected, got, join, render

ToxicType = Literal[
    "latency", "bandwidth", "slow_close", "timeout", "reset_peer", "slicer", "limit_data"
]
Stream = Literal["upstream", "downstream"]
TOXIC_TYPES: tuple[str, ...] = get_args(ToxicType)
STREAMS: tuple[str, ...] = get_args(Stream)

#: The error type of a rule that a model checks itself, rendered `{path}: {detail}`: the
#: scenario schema's own type, so its one-line renderer shows a toxic's errors unchanged.
RULE_ERROR = "scenario_rule"


def _fail(path: str, detail: str) -> PydanticCustomError:
    return PydanticCustomError(RULE_ERROR, "{path}: {detail}", {"path": path, "detail": detail})


# --- attributes, one model per toxic type -----------------------------------------------------


class _Attributes(BaseModel):
    """Whole numbers >= 0 (Go's int64 refuses strings and fractions); no unknown names, so
    a misspelt attribute is an error instead of a silent 0."""

    model_config = ConfigDict(extra="forbid", strict=True)


class LatencyAttributes(_Attributes):
    """`latency` ms added to each chunk, +/- `jitter` ms."""

    latency: int = Field(0, ge=0)
    jitter: int = Field(0, ge=0)


class BandwidthAttributes(_Attributes):
    """`rate` KB/s (1 KB = 1000 bytes); 0 lets nothing through, as in Toxiproxy."""

    rate: int = Field(0, ge=0)


class SlowCloseAttributes(_Attributes):
    """`delay` ms between the end of the data and the close."""

    delay: int = Field(0, ge=0)


class TimeoutAttributes(_Attributes):
    """Drop all data; close after `timeout` ms without data (0: hold it open forever)."""

    timeout: int = Field(0, ge=0)


class ResetPeerAttributes(_Attributes):
    """On the first data, wait `timeout` ms, then close with a TCP RST."""

    timeout: int = Field(0, ge=0)


class SlicerAttributes(_Attributes):
    """Cut each chunk into pieces of `average_size` +/- `size_variation` bytes, `delay`
    microseconds apart. Toxiproxy takes 0 and then crashes on the first chunk (Go's
    `rand.Intn(0)`): an unusable slicer is refused here instead."""

    average_size: int = Field(0, ge=0)
    size_variation: int = Field(0, ge=0)
    delay: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _sizes(self) -> SlicerAttributes:
        if self.average_size < 1:
            raise _fail("average_size", f"expected a value >= 1; got {self.average_size}")
        if self.size_variation >= self.average_size:
            raise _fail(
                "size_variation",
                f"expected a value < average_size ({self.average_size}); got {self.size_variation}",
            )
        return self


class LimitDataAttributes(_Attributes):
    """Close the link once `bytes` bytes went through."""

    bytes: int = Field(0, ge=0)


#: Each toxic type and its attributes: the one table the server, the scenario schema and
#: the documentation read.
ATTRIBUTES: dict[str, type[_Attributes]] = {
    "latency": LatencyAttributes,
    "bandwidth": BandwidthAttributes,
    "slow_close": SlowCloseAttributes,
    "timeout": TimeoutAttributes,
    "reset_peer": ResetPeerAttributes,
    "slicer": SlicerAttributes,
    "limit_data": LimitDataAttributes,
}


def parse_attributes(toxic_type: str, raw: Any) -> dict[str, int]:
    """A toxic's attributes checked against its type, every default filled in; a bad one
    raises a `RULE_ERROR` naming the attribute (`attributes.latency: expected ...`)."""
    model = ATTRIBUTES[toxic_type]
    if not isinstance(raw, dict):
        raise _fail("attributes", f"expected a mapping; got {got(raw)}")
    try:
        return model.model_validate(raw).model_dump()
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        ctx = err.get("ctx") or {}
        if err["type"] == RULE_ERROR:
            raise _fail(join("attributes", str(ctx["path"])), str(ctx["detail"])) from None
        path = join("attributes", render(err["loc"], raw))
        if err["type"] == "extra_forbidden":
            known = ", ".join(model.model_fields)
            detail = f"unknown attribute for a {toxic_type} toxic; expected one of {known}"
        else:
            detail = expected(err)
        raise _fail(path, detail) from None


# --- a toxic and a proxy ----------------------------------------------------------------------


class ToxicSpec(BaseModel):
    """One toxic as the API takes and shows it. `name` defaults to `<type>_<stream>`;
    `attributes` come back complete (every attribute of the type, defaults included)."""

    model_config = ConfigDict(extra="forbid")

    type: ToxicType
    name: str = Field("", max_length=200)
    stream: Stream = "downstream"
    toxicity: float = Field(1.0, ge=0.0, le=1.0, strict=True)
    attributes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _complete(self) -> ToxicSpec:
        self.attributes = parse_attributes(self.type, self.attributes)
        if not self.name:
            self.name = default_toxic_name(self.type, self.stream)
        return self

    def updated(self, changes: dict[str, Any]) -> ToxicSpec:
        """This toxic with Toxiproxy's update applied: `attributes` merged into the current
        ones and `toxicity` replaced; its name, type and stream never change."""
        attributes = changes.get("attributes", {})
        data = self.wire()
        merged = {**self.attributes, **attributes} if isinstance(attributes, dict) else attributes
        data["attributes"] = merged
        if "toxicity" in changes:
            data["toxicity"] = changes["toxicity"]
        return ToxicSpec.model_validate(data)

    def wire(self) -> dict[str, Any]:
        """The JSON Toxiproxy shows for a toxic."""
        return {
            "attributes": dict(self.attributes),
            "name": self.name,
            "type": self.type,
            "stream": self.stream,
            "toxicity": self.toxicity,
        }


_ADDRESS = re.compile(r"^(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\s:\[\]]*)):(?P<port>\d{1,5})$")


def parse_address(text: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` as (host, port). An empty host means 127.0.0.1: this
    server listens on loopback unless told otherwise (Toxiproxy: every interface)."""
    match = _ADDRESS.match(text)
    if match is None or int(match["port"]) > 65535:
        raise ValueError(f"expected host:port; got {got(text)}")
    host = match["v6"] or match["host"] or "127.0.0.1"
    return host, int(match["port"])


def format_address(host: str, port: int) -> str:
    """The inverse of `parse_address`: IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class ProxySpec(BaseModel):
    """One proxy: clients connect to `listen`, which forwards to `upstream`. Port 0 in
    `listen` takes a free port (the API then shows the real one)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    listen: str = "127.0.0.1:0"
    upstream: str = Field(min_length=1)
    enabled: bool = Field(True, strict=True)

    @model_validator(mode="after")
    def _addresses(self) -> ProxySpec:
        for field in ("listen", "upstream"):
            try:
                host, port = parse_address(getattr(self, field))
            except ValueError as exc:
                raise _fail(field, str(exc)) from None
            if field == "upstream" and port == 0:
                raise _fail(field, f"expected a port >= 1; got {got(self.upstream)}")
            setattr(self, field, format_address(host, port))
        return self


def describe_error(exc: ValidationError, data: Any = None, *, prefix: str = "") -> str:
    """The first error of a toxic's or a proxy's validation as one line:
    `attributes.latency: expected an integer; got '5'`."""
    err = exc.errors(include_url=False)[0]
    if err["type"] == RULE_ERROR:
        ctx = err.get("ctx") or {}
        where = join(prefix, render(err["loc"], data)) if prefix else render(err["loc"], data)
        return f"{join(where, str(ctx['path']))}: {ctx['detail']}"
    return describe(exc, data, prefix=prefix)


# --- the draw rule ----------------------------------------------------------------------------


def toxic_rng(seed: int, proxy: str, toxic: str, stream: str, link_no: int) -> random.Random:
    """The random stream of one toxic on one link (see the module's draw rule)."""
    return random.Random(f"{seed}:{proxy}:{toxic}:{stream}:{link_no}")


def toxicity_draw(rng: random.Random) -> float:
    """The link's `u`: the first draw of its stream, tested against the toxicity."""
    return rng.random()


def applies(u: float, toxicity: float) -> bool:
    """Toxiproxy's `rand.Float32() < toxicity`: 1.0 always applies, 0.0 never."""
    return u < toxicity


def jitter_ms(rng: random.Random, jitter: int) -> int:
    """One chunk's jitter in [-jitter, jitter), as Go's `rand.Int63n(2*jitter) - jitter`."""
    return rng.randrange(2 * jitter) - jitter if jitter > 0 else 0


def latency_ms(rng: random.Random, latency: int, jitter: int) -> int:
    """One chunk's delay: latency +/- jitter (a negative one is no delay)."""
    return latency + jitter_ms(rng, jitter)


def slice_offsets(rng: random.Random, size: int, average: int, variation: int) -> list[int]:
    """Where the slicer cuts a chunk of `size` bytes: [0, a, b, ..., size]. Toxiproxy's
    recursion: a span within `average + variation` is one piece, else it is cut near its
    middle (+/- variation) and both halves are sliced, the left one first."""
    cuts = [0]

    def chunk(start: int, end: int) -> None:
        if (end - start) - average <= variation:
            cuts.append(end)
            return
        shift = rng.randrange(2 * variation) - variation if variation > 0 else 0
        mid = start + (end - start) // 2 + shift
        chunk(start, mid)
        chunk(mid, end)

    if size > 0:
        chunk(0, size)
    return cuts


def default_toxic_name(toxic_type: str, stream: str) -> str:
    """Toxiproxy's default name for a toxic."""
    return f"{toxic_type}_{stream}"
