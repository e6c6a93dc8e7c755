"""Hostile inputs shared by the tests: ZMQ frames that can never decode, valid frames
damaged once, random bootstrap HTTP requests and bytes that are not HTTP at all.

``tests/e2e/test_hostile.py`` aims them at one session; the chaos soak
(``tests/e2e/test_chaos.py``) fires them at live ranks while it kills and restarts others.
"""

from __future__ import annotations

import json
import random
import time
import urllib.parse
from typing import Any

import msgspec

from sgl_nixl_plugin.wire.codec import MAGIC
from sgl_nixl_plugin.wire.messages import PROTOCOL_VERSION


def _envelope(body: Any, version: int = PROTOCOL_VERSION, signed: bool = False) -> bytes:
    return msgspec.msgpack.encode([version, time.time(), signed, body])


def _random_structure(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.randrange(-(1 << 63), 1 << 63)
    if kind == 1:
        return rng.random() * 10 ** rng.randrange(-5, 300)
    if kind == 2:
        return "".join(rng.choice("abcxyz_\u00e9\u4e2d") for _ in range(rng.randrange(12)))
    if kind == 3:
        return rng.choice([None, True, False, b"\x00\xff"])
    if kind == 4:
        return [_random_structure(rng, depth + 1) for _ in range(rng.randrange(6))]
    if kind == 5:
        keys = ["type", "room", "agent_name", "slot", "ip", "port", "seq", "zz"]
        return {
            rng.choice(keys): _random_structure(rng, depth + 1) for _ in range(rng.randrange(5))
        }
    return {
        "type": rng.choice(["xfer", "piece", "status", "ping", "reg"]),
        "room": _random_structure(rng, depth + 1),
    }


def garbage(rng: random.Random) -> list[bytes]:
    """A message that can never decode: random frames, random headers, unknown tags,
    other protocol versions, structurally wrong envelopes."""
    kind = rng.randrange(7)
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 200)) for _ in range(rng.randrange(1, 5))]
    if kind == 1:
        return [MAGIC, rng.randbytes(rng.randrange(0, 300))]
    if kind == 2:
        return [MAGIC, msgspec.msgpack.encode(_random_structure(rng))]
    if kind == 3:  # a tag no version of the protocol has
        return [MAGIC, _envelope({"type": f"nope{rng.randrange(100)}", "room": 1})]
    if kind == 4:  # a future (or past) protocol version
        return [
            MAGIC,
            _envelope(
                {"type": "ping", "sender": "x", "ip": "127.0.0.1", "port": 1, "seq": 1},
                version=rng.choice([0, 2, 99, -1]),
            ),
        ]
    if kind == 5:  # right shape, wrong field types
        return [
            MAGIC,
            _envelope({"type": "piece_done", "room": "seven", "agent_name": 3, "slot": -1}),
        ]
    return [MAGIC[:-1] + bytes([rng.randrange(256)]), _envelope({"type": "ping"})]


def mutate(rng: random.Random, frames: list[Any]) -> list[bytes]:
    """A valid message damaged once: flipped, truncated or extended header, frames
    dropped, duplicated or resized."""
    frames = [bytes(memoryview(f).cast("B")) if not isinstance(f, bytes) else f for f in frames]
    kind = rng.randrange(6)
    if kind == 0:
        h = bytearray(frames[1])
        for _ in range(rng.randrange(1, 4)):
            h[rng.randrange(len(h))] ^= 1 << rng.randrange(8)
        frames[1] = bytes(h)
    elif kind == 1:
        frames[1] = frames[1][: rng.randrange(len(frames[1]))]
    elif kind == 2:
        frames[1] = frames[1] + rng.randbytes(rng.randrange(1, 16))
    elif kind == 3 and len(frames) > 2:
        del frames[rng.randrange(2, len(frames))]
    elif kind == 4 and len(frames) > 2:
        i = rng.randrange(2, len(frames))
        frames[i] = frames[i][: max(0, len(frames[i]) - rng.choice([1, 4, 5]))] or b"\x01"
    else:
        frames.append(frames[-1])
    return frames


def route_body(**over: Any) -> dict[str, Any]:
    body = dict(
        attn_tp_size=2,
        attn_tp_rank=0,
        attn_cp_size=1,
        attn_cp_rank=0,
        attn_dp_size=1,
        attn_dp_rank=0,
        pp_size=1,
        pp_rank=0,
        system_dp_size=1,
        system_dp_rank=0,
        rank_ip="127.0.0.1",
        rank_port=4242,
        page_size=16,
        kv_cache_dtype="float16",
    )
    body.update(over)
    return body


def random_request(rng: random.Random) -> tuple[str, str, bytes | None]:
    method = rng.choice(["GET", "PUT", "POST", "DELETE", "GET", "PUT", "POST"])
    path = rng.choice(["/route", "/register_dp_rank", "/query_dp_ranks", "/health", "/x"])
    keys = ["prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"]
    params = {
        k: rng.choice(["-1", "0", str(rng.randrange(-(10**20), 10**20)), "\u00e9", "1e3"])
        for k in rng.sample(keys, rng.randrange(5))
    }
    if rng.random() < 0.2:  # one huge value (the request line stays under 8 KiB)
        params[rng.choice(keys)] = "9" * rng.randrange(1000, 6000)
    path += ("?" + urllib.parse.urlencode(params)) if params else ""
    good = json.dumps(route_body(attn_tp_rank=rng.randrange(2))).encode()
    body = rng.choice(
        [
            None,
            rng.randbytes(rng.randrange(200)),
            good,
            good[: rng.randrange(len(good))],
            json.dumps(
                route_body(
                    **{
                        rng.choice(list(route_body())): rng.choice(
                            [None, "x", -1, 1 << 70, [1], 2.5]
                        )
                    }
                )
            ).encode(),
            json.dumps(
                {
                    "bootstrap_room": rng.choice([1, -1, "1", 1 << 80]),
                    "dp_rank": rng.choice([0, "0", None]),
                }
            ).encode(),
            json.dumps(
                {"bootstrap_rooms": [rng.choice([1, "1", None, 1.5]) for _ in range(3)]}
            ).encode(),
            b"{" * rng.randrange(1, 3000),
            b"0" * (70 << 10),
        ]
    )
    return method, path, body


def raw_garbage(rng: random.Random, n: int) -> list[bytes]:
    """Bytes on the socket that are not a well-formed HTTP request."""
    good = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    forms = [
        lambda: rng.randbytes(rng.randrange(1, 400)),
        lambda: b"GET /route HTTP/9.9\r\n\r\n",
        lambda: b"PUT /route HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n{}",
        lambda: b"POST /register_dp_rank HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        lambda: b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
        lambda: b"GET /health HTTP/1.1\r\n" + b"X: " + b"b" * 20000 + b"\r\n\r\n",
        lambda: b"\x00\xff" + good,
        lambda: good[: rng.randrange(1, len(good))],
        lambda: b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",
    ]
    return [rng.choice(forms)() for _ in range(n)]
