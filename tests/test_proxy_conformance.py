"""`chaos.proxy` against Toxiproxy's own source, where a review found them apart.

Each test names the Toxiproxy file that shows the behaviour. Real TCP on 127.0.0.1, the
server in-process (`tests.test_proxy.Env`); nothing timed: a delay is read from the
proxy's own record of what its toxics held (`LinkRecord.held`).
"""

from __future__ import annotations

import asyncio

from tests.test_proxy import Env, aio, roundtrip

# --- stream/direction.go: ParseDirection lower-cases what it is given -----------------------


@aio
async def test_a_toxics_stream_is_read_in_any_case() -> None:
    async with Env() as env:
        reader, writer = await asyncio.open_connection(*await env.proxy("p"))
        up = {"type": "latency", "stream": "UpStream", "attributes": {"latency": 150}}
        status, body = await env.call("POST", "/proxies/p/toxics", up)
        assert status == 200
        # the default name keeps the spelling, as Toxiproxy's `<type>_<stream>` does
        assert (body["name"], body["stream"]) == ("latency_UpStream", "upstream")
        await roundtrip(reader, writer, b"up")
        records = {r.stream: r.decisions for r in env.server.links("p")}
        held = {r.stream: r.held for r in env.server.links("p")}
        assert held["downstream"] == []  # on the upstream chain, held its 150 ms in full
        assert [(h.toxic, h.nbytes, h.delay) for h in held["upstream"]] == [
            ("latency_UpStream", 2, 0.150)
        ]
        assert all(h.until >= h.since + h.delay for h in held["upstream"])
        assert records == {"upstream": {"latency_UpStream": True}, "downstream": {}}

        down = {"type": "timeout", "stream": "DOWNSTREAM"}
        status, body = await env.call("POST", "/proxies/p/toxics", down)
        assert (status, body["name"], body["stream"]) == (200, "timeout_DOWNSTREAM", "downstream")
        status, body = await env.call(
            "POST", "/proxies/p/toxics", {"type": "latency", "stream": "UpStream"}
        )
        assert (status, body) == (409, {"error": "toxic already exists", "status": 409})
        for wrong in ("", "up", 5):
            status, body = await env.call(
                "POST", "/proxies/p/toxics", {"type": "latency", "name": "x", "stream": wrong}
            )
            assert (status, body["error"]) == (
                400,
                "stream was invalid, can be either upstream or downstream",
            )
        writer.close()


# --- encoding/json: a null leaves the field it is decoded into as it was ---------------------
# api.go's ProxyUpdate decodes the body over the proxy's current fields, and
# toxic_collection.go's UpdateToxicJson over the toxic's current attributes and toxicity;
# AddToxicJson over the defaults.


@aio
async def test_a_null_in_a_proxy_update_changes_nothing() -> None:
    async with Env() as env:
        host, port = await env.proxy("p")
        reader, writer = await asyncio.open_connection(host, port)
        await roundtrip(reader, writer, b"before")
        _, before = await env.call("GET", "/proxies/p")

        nulls = {"listen": None, "upstream": None, "enabled": None}
        assert await env.call("PATCH", "/proxies/p", nulls) == (200, before)
        await roundtrip(reader, writer, b"after")  # not restarted: the connection lives

        status, off = await env.call("PATCH", "/proxies/p", {"enabled": False})
        assert status == 200 and off["enabled"] is False
        assert await env.call("POST", "/proxies/p", nulls) == (200, off)  # still disabled
        writer.close()


@aio
async def test_a_null_in_a_toxic_update_or_create_sets_nothing() -> None:
    async with Env() as env:
        await env.proxy("p")
        await env.toxic(
            "p", type="latency", name="lat", toxicity=0.5, attributes={"latency": 10, "jitter": 2}
        )
        status, body = await env.call(
            "PATCH", "/proxies/p/toxics/lat", {"toxicity": None, "attributes": None}
        )
        assert status == 200
        assert (body["toxicity"], body["attributes"]) == (0.5, {"latency": 10, "jitter": 2})
        status, body = await env.call(
            "PATCH", "/proxies/p/toxics/lat", {"attributes": {"latency": None, "jitter": 3}}
        )
        assert status == 200 and body["attributes"] == {"latency": 10, "jitter": 3}

        status, body = await env.call(
            "POST", "/proxies/p/toxics",
            {"type": "slicer", "name": None, "stream": None, "toxicity": None,
             "attributes": {"average_size": 64, "size_variation": None, "delay": None}},
        )  # fmt: skip
        assert status == 200
        assert body == {
            "attributes": {"average_size": 64, "size_variation": 0, "delay": 0},
            "name": "slicer_downstream",
            "type": "slicer",
            "stream": "downstream",
            "toxicity": 1.0,
        }
