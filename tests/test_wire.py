"""The frames `engine.runtime.wire` packs by hand are the bytes pamqp marshals."""

from __future__ import annotations

import pamqp.frame
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands as spec
from pamqp.body import ContentBody
from pamqp.header import ContentHeader

from engine.runtime.wire import content, settle_frame


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
