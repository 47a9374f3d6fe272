"""The frames `engine.runtime.wire` packs by hand are the bytes pamqp marshals, and its
reader takes whole publisher acks out of any chunking of a stream and passes the rest on."""

from __future__ import annotations

import asyncio
import itertools
import struct

import pamqp.frame
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from engine.runtime.wire import ConfirmReader, content, settle_frame


def pamqp_content(
    channel: int, body: bytes, message_id: str, expiration: str | None, max_body: int
) -> bytes:
    """What aiormq's `basic_publish` writes after the method frame, for the properties the
    broker gives every message (`Broker._publish_raw`)."""
    properties = spec.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        expiration=expiration,
        headers={},
        message_id=message_id,
        priority=0,
    )
    frames = [ContentHeader(properties=properties, body_size=len(body))]
    frames += [ContentBody(body[i : i + max_body]) for i in range(0, len(body), max_body)]
    return b"".join(pamqp.frame.marshal(f, channel) for f in frames)


@given(
    channel=st.integers(1, 65535),
    body=st.binary(max_size=300),
    message_id=st.text(min_size=1, max_size=80),  # aiormq gives an empty one a uuid
    expiration=st.none() | st.integers(1, 10**9).map(str),
    max_body=st.integers(1, 400),
)
def test_content_frames_are_pamqps(
    channel: int, body: bytes, message_id: str, expiration: str | None, max_body: int
) -> None:
    ours = content(channel, body, message_id, expiration, max_body)
    assert ours == pamqp_content(channel, body, message_id, expiration, max_body)


def test_an_engine_message_round_trips_through_pamqp() -> None:
    raw = content(3, b'{"attempt_id":"a"}', "evaluation.started:a", None, 131064)
    _, channel, header = pamqp.frame.unmarshal(raw)
    assert channel == 3 and isinstance(header, ContentHeader)
    props = header.properties
    assert (props.content_type, props.delivery_mode, props.message_id) == (
        "application/json",
        2,
        "evaluation.started:a",
    )


def test_a_message_id_too_long_for_a_short_string_is_refused() -> None:
    with pytest.raises(ValueError, match="255"):
        content(1, b"x", "m" * 256, None, 100)


@given(channel=st.integers(1, 65535), tag=st.integers(1, 2**63 - 1))  # pamqp: signed
def test_ack_and_nack_frames_are_pamqps(channel: int, tag: int) -> None:
    ack = pamqp.frame.marshal(spec.Basic.Ack(delivery_tag=tag), channel)
    nack = pamqp.frame.marshal(spec.Basic.Nack(delivery_tag=tag, requeue=True), channel)
    assert settle_frame(channel, tag, ack=True) == ack
    assert settle_frame(channel, tag, ack=False) == nack


class _Acks:
    """A wire that takes the acks of the given delivery tags, as `Wire.acked` reads them."""

    def __init__(self, tags: set[int]) -> None:
        self.tags = tags
        self.taken: list[int] = []

    def acked(self, data: bytes, offset: int) -> bool:
        cls, method, tag, _ = struct.unpack_from(">HHQB", data, offset)
        if (cls, method) == (60, 80) and tag in self.tags:
            self.taken.append(tag)
            return True
        return False


def _frames(stream: bytes) -> list[bytes]:
    """The frames of a byte stream, which must end at a frame's end."""
    frames, pos = [], 0
    while pos < len(stream):
        _, _, size = struct.unpack_from(">BHI", stream, pos)
        frames.append(stream[pos : pos + size + 8])
        assert stream[pos + size + 7] == 0xCE, "a frame cut or spliced"
        pos += size + 8
    assert pos == len(stream)
    return frames


_FRAME = st.one_of(
    st.builds(  # an ack, of channel 1 (wired) or 2 (not)
        lambda ch, tag, multiple: pamqp.frame.marshal(
            spec.Basic.Ack(delivery_tag=tag, multiple=multiple), ch
        ),
        st.sampled_from([1, 2]),
        st.integers(1, 12),
        st.booleans(),
    ),
    st.builds(
        lambda tag: pamqp.frame.marshal(spec.Basic.Nack(delivery_tag=tag), 1), st.integers(1, 12)
    ),
    st.builds(lambda body: pamqp.frame.marshal(ContentBody(body), 1), st.binary(max_size=60)),
    st.builds(lambda: pamqp.frame.marshal(spec.Basic.Deliver("c", 7, False, "ex", "rk"), 1)),
    st.just(b"\x08\x00\x00\x00\x00\x00\x00\xce"),
)


@settings(max_examples=300)
@given(frames=st.lists(_FRAME, max_size=30), data=st.data())
def test_the_reader_takes_whole_acks_of_wired_channels_and_passes_the_rest_in_order(
    frames: list[bytes], data: st.DataObject
) -> None:
    loop = asyncio.new_event_loop()
    try:
        reader = ConfirmReader(loop)
        reader.BEAT_S = 0.0  # a heartbeat wherever one may go
        acks = _Acks(set(data.draw(st.lists(st.integers(1, 12), max_size=12))))
        reader.wires[1] = acks  # type: ignore[assignment]
        stream = b"".join(frames)
        cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=12))
        bounds = sorted({0, len(stream), *cuts})
        for a, b in itertools.pairwise(bounds):
            reader.feed_data(stream[a:b])
        passed = bytes(reader._buffer)
    finally:
        loop.close()
    # Taken: exactly the acks of channel 1 the wire accepts, each whole in one read.
    must, pos = [], 0
    for f in frames:
        cls, method, tag, _ = struct.unpack_from(">HHQB", f.ljust(20, b"\0"), 7)
        whole = not any(pos < c < pos + len(f) for c in bounds)
        if f[:3] == b"\x01\x00\x01" and (cls, method) == (60, 80) and tag in acks.tags and whole:
            must.append((pos, f))
        pos += len(f)
    assert acks.taken == [struct.unpack_from(">Q", f, 11)[0] for _, f in must]
    # Passed on: every other frame, in order, cut nowhere; heartbeats only between frames.
    beat = b"\x08\x00\x00\x00\x00\x00\x00\xce"
    taken = {p for p, _ in must}
    rest, pos = [], 0
    for f in frames:
        if pos not in taken:
            rest.append(f)
        pos += len(f)
    assert [f for f in _frames(passed) if f != beat] == [f for f in rest if f != beat]
