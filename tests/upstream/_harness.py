"""The in-process cluster the upstream ports run against, and peers that speak our wire.

SGLang's runtime context is published the way ``sgl_nixl_plugin.bench.rank.setup`` does
for a rank process, then ``load_plugins()`` + ``get_kv_class(TransferBackend.NIXL, ...)``
hand out the four classes: the tests only ever use what SGLang would. One bootstrap
server, one prefill and one decode manager (real NIXL agents over UCX on ``lo``, DRAM
pools) live for the whole session; every test takes fresh bootstrap rooms and the
``rooms`` fixture wipes whatever a room left in either manager's tables afterwards.

Everything binds 127.0.0.1; every wait polls a condition against a deadline.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import zmq

OUR_PACKAGE = "sgl_nixl_plugin."

#: Keep all control and data traffic on loopback; decode-side deferred KV release on.
LOOPBACK_ENV = {
    "SGLANG_HOST_IP": "127.0.0.1",
    "UCX_NET_DEVICES": "lo",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
}

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 5.0, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(0.002)


class FakeRank:
    """A peer process stand-in: a PULL socket on 127.0.0.1 and PUSH sockets to managers.

    Messages are framed by our own ``Codec`` (no secret configured, like the cluster).
    Plays a prefill rank towards the decode manager or a decode rank towards the prefill.
    """

    def __init__(self, name: str) -> None:
        from sgl_nixl_plugin.wire.codec import Codec

        self.name = name
        self.codec = Codec()
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.ip = "127.0.0.1"
        self.port = self.pull.bind_to_random_port(f"tcp://{self.ip}")
        self._push: dict[int, zmq.Socket] = {}
        self._seq = itertools.count(1)

    @property
    def info(self) -> dict[str, Any]:
        """This rank as a bootstrap info row (what a receiver's ``bootstrap_infos`` holds)."""
        return {"rank_ip": self.ip, "rank_port": self.port, "is_dummy": False}

    def send(self, port: int, msg: Any) -> None:
        sock = self._push.get(port)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sock.connect(f"tcp://127.0.0.1:{port}")
            self._push[port] = sock
        sock.send_multipart(self.codec.encode(msg))

    def recv(self, timeout: float = 5.0) -> Any:
        """The next protocol message; a manager's liveness Ping is answered, not returned.

        A manager watches every peer it knows, so its Pings interleave with what a test
        waits for at any moment; a live peer answers them.
        """
        from sgl_nixl_plugin.wire.messages import Ping, Pong

        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.pull.poll(int(left * 1000)):
                raise AssertionError(f"{self.name}: no message within {timeout:.1f}s")
            decoded = self.codec.decode(self.pull.recv_multipart())
            assert decoded is not None, f"{self.name}: received a message our codec rejects"
            msg = decoded.msg
            if isinstance(msg, Ping) and msg.sender != self.name:
                self.send(msg.port, Pong(self.name, msg.seq, self.ip, self.port))
                continue
            return msg

    def round_trip(self, port: int, timeout: float = 5.0) -> list[Any]:
        """Ping the manager at ``port``; return what it sent us before its Pong.

        A barrier both ways: the manager handles our messages in order (so everything we
        sent before the Ping has been handled), and it answers on the socket it uses for
        everything else it sends to this endpoint (so nothing sent earlier is still due).
        """
        from sgl_nixl_plugin.wire.messages import Ping, Pong

        seq = next(self._seq)
        self.send(port, Ping(sender=self.name, ip=self.ip, port=self.port, seq=seq))
        before: list[Any] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(msg, Pong) and msg.seq == seq:
                return before
            before.append(msg)

    def close(self) -> None:
        for sock in self._push.values():
            sock.close(0)
        self.pull.close(0)
        self.ctx.term()


class Cluster:
    """Bootstrap server + one prefill and one decode manager of ours, in this process."""

    def __init__(self) -> None:
        self._saved_env = {k: os.environ.get(k) for k in LOOPBACK_ENV}
        os.environ.update(LOOPBACK_ENV)
        self._threads_before = set(threading.enumerate())
        from sgl_nixl_plugin.bench.pools import Pools
        from sgl_nixl_plugin.bench.rank import RankSpec, setup
        from sgl_nixl_plugin.bench.session import free_port
        from sgl_nixl_plugin.bench.workload import PRESETS, Workload

        self.free_port = free_port
        workload = Workload(PRESETS["tiny"], page_size=4, requests=1, max_tokens=64, concurrency=4)
        self.bootstrap_port = free_port()
        prefill_spec = RankSpec("prefill", 0, 1, 0, workload, self.bootstrap_port)
        decode_spec = RankSpec("decode", 0, 1, 0, workload, self.bootstrap_port)
        with warnings.catch_warnings():  # SGLang's CPU-only import warnings (AWQ, GGUF)
            warnings.simplefilter("ignore", UserWarning)
            env = setup(prefill_spec)  # publish the runtime context, load_plugins(), get_kv_class
        self.classes: dict[str, type] = env["classes"]
        self.server_args = env["server_args"]
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.common.conn import CommonKVReceiver
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.KVPoll = KVPoll
        self._receiver_base = CommonKVReceiver
        self.prefill_pools = Pools(prefill_spec)
        self.decode_pools = Pools(decode_spec)
        self.server = self.prefill = self.decode = None
        try:
            self.server = self.classes["bootstrap_server"](
                host="127.0.0.1", port=self.bootstrap_port
            )
            manager = self.classes["manager"]
            kvargs = self.classes["kvargs"]
            self.prefill = manager(
                self.prefill_pools.kv_args(kvargs, prefill_spec),
                DisaggregationMode.PREFILL,
                self.server_args,
                False,
            )
            self.decode = manager(
                self.decode_pools.kv_args(kvargs, decode_spec),
                DisaggregationMode.DECODE,
                self.server_args,
                False,
            )
            self.addr = f"127.0.0.1:{self.bootstrap_port}"
            wait_for(
                lambda: self.decode.try_ensure_parallel_info(self.addr),
                10,
                "the decode to learn the prefill's topology",
            )
        except BaseException:
            self.close()
            raise
        self._rooms = itertools.count(1_000_001)

    # -- classes, rooms -------------------------------------------------------------------
    def new_room(self) -> int:
        return next(self._rooms)

    def sender(self, room: int) -> Any:
        return self.classes["sender"](self.prefill, self.addr, room)

    def receiver(self, room: int) -> Any:
        return self.classes["receiver"](self.decode, self.addr, room)

    def forget(self, room: int) -> None:
        """Drop whatever ``room`` left in either manager (SGLang's tables and ours)."""
        for mgr in (self.prefill, self.decode):
            for name in (
                "request_status",
                "failure_records",
                "transfer_infos",
                "req_to_decode_prefix_len",
                "prefill_response_tracker",
                "required_prefill_response_num_table",
                "_deferred_abort_ack_tracker",
                "_deferred_ack_targets",
                "_staging_outstanding",
            ):
                table = getattr(mgr, name, None)
                if isinstance(table, dict):
                    table.pop(room, None)
        # ours: the room records of both sides
        self.prefill.prefill.release(room)
        self.prefill.prefill.ctx.early.claim(room)
        self.decode.decode.close_room(room, ok=True)
        for rooms in getattr(self.decode, "addr_to_rooms_tracker", {}).values():
            rooms.discard(room)

    # -- data -----------------------------------------------------------------------------
    def write_prefill(self, room: int, pages: np.ndarray, slot: int, state_slot: int) -> None:
        """Fill the prefill's pages, aux row ``slot`` and state row with ``room``'s patterns."""
        from sgl_nixl_plugin.bench.workload import (
            AUX_ITEM_BYTES,
            STATE_ITEM_BYTES,
            aux_pattern,
            state_pattern,
        )

        pools = self.prefill_pools
        pools.fill(room, pages)
        for b, buf in enumerate(pools.aux):
            n = AUX_ITEM_BYTES[b]
            buf[slot * n : (slot + 1) * n] = aux_pattern(room, b, n)
        pools.state_row(state_slot)[:] = state_pattern(room, STATE_ITEM_BYTES)

    def clear_decode_rows(self, slot: int, state_slot: int) -> None:
        from sgl_nixl_plugin.bench.workload import AUX_ITEM_BYTES

        for b, buf in enumerate(self.decode_pools.aux):
            n = AUX_ITEM_BYTES[b]
            buf[slot * n : (slot + 1) * n] = 0
        self.decode_pools.state_row(state_slot)[:] = 0

    def decode_aux_ok(self, room: int, slot: int) -> bool:
        from sgl_nixl_plugin.bench.workload import AUX_ITEM_BYTES, aux_pattern

        return all(
            np.array_equal(buf[slot * n : (slot + 1) * n], aux_pattern(room, b, n))
            for b, (buf, n) in enumerate(zip(self.decode_pools.aux, AUX_ITEM_BYTES, strict=True))
        )

    def decode_aux_zero(self, slot: int) -> bool:
        from sgl_nixl_plugin.bench.workload import AUX_ITEM_BYTES

        return all(
            not buf[slot * n : (slot + 1) * n].any()
            for buf, n in zip(self.decode_pools.aux, AUX_ITEM_BYTES, strict=True)
        )

    def decode_state(self, state_slot: int) -> np.ndarray:
        return self.decode_pools.state_row(state_slot)

    def decode_pages_ok(self, room: int, pages: np.ndarray) -> bool:
        """Whether the decode's ``pages`` hold the first ``len(pages)`` pages of ``room``."""
        return self.decode_pools.check(room, pages) == 0

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        for mgr in (self.prefill, self.decode):
            if mgr is not None:
                mgr.close()
        if self.server is not None:
            self.server.close()
        self._receiver_base.close_all_sockets()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def leftover_threads(self) -> list[str]:
        return sorted(
            t.name for t in threading.enumerate() if t not in self._threads_before and t.is_alive()
        )
