"""SGLang's per-room tables, through one small facade.

SGLang's ``CommonKVManager`` owns the status table the scheduler polls, the failure
records, the destinations its common code reads (``transfer_infos``), the count of
transfers in flight that holds back Success and the abort ACK (``_staging_outstanding``,
private), and the decode's cached routes to prefill ranks. Our threads reach them only
through this class, so what we depend on in SGLang's internals is listed here and nowhere
else (docs/sglang-contract-audit.md).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as sglang_conn
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.utils.network import NetworkAddress

from sgl_nixl_plugin.protocol.prefill_rooms import TransferInfo

Endpoint = tuple[str, int]


class AbortTarget(NamedTuple):
    """Who gets a drained abort's ACK: the fields of SGLang's ``AckTarget`` (0.5.22+)."""

    ip: str
    port: int
    generation: int


#: SGLang's per-room tables on the manager: every one returns to empty once all rooms ended.
SGLANG_ROOM_TABLES = (
    "request_status",
    "failure_records",
    "transfer_infos",
    "req_to_decode_prefix_len",
    "_staging_outstanding",
    "_deferred_ack_targets",
    "required_prefill_response_num_table",
    "prefill_response_tracker",
    "_deferred_abort_ack_tracker",
    "_deferred_ack_fanout_snapshots",  # SGLang 0.5.21
)


def sglang_table_sizes(mgr: Any) -> dict[str, int]:
    """Sizes of SGLang's per-room tables on ``mgr`` (ours or SGLang's in-tree manager)."""
    out = {
        n: len(getattr(mgr, n))
        for n in SGLANG_ROOM_TABLES
        if isinstance(getattr(mgr, n, None), dict)
    }
    tracker = getattr(mgr, "addr_to_rooms_tracker", None)
    if tracker is not None:
        out["addr_to_rooms_tracker"] = sum(len(v) for v in tracker.values())
    return out


_ENDED = (None, KVPoll.Success, KVPoll.Failed)


class SGLangRooms:
    """The ``RoomTables`` the per-side threads use, over SGLang's manager ``mgr``."""

    def __init__(self, mgr: Any) -> None:
        self._m = mgr
        # A room's outcome is decided once. Our threads (the transfer worker concluding
        # Success, the control thread and liveness failing rooms, SGLang's abort on the
        # scheduler thread: ``sender.abort``) each check the room's status, then set it
        # and tell the decode; under this lock no other one comes between the two, so
        # the decode is never sent Success for a room failed here, nor a Failed that
        # overturns a Success it was sent. (Sends never block: ``Transport``.)
        self.outcome_lock = threading.Lock()

    # -- both sides ---------------------------------------------------------------------
    def exists(self, room: int) -> bool:
        return room in self._m.request_status

    def is_open(self, room: int) -> bool:
        """The room exists and has not ended (neither Success nor Failed)."""
        return self._m.request_status.get(room) not in _ENDED

    def is_failed_or_gone(self, room: int) -> bool:
        return self._m.request_status.get(room) in (None, KVPoll.Failed)

    def fail(self, room: int, reason: str) -> bool:
        """Fail an open room here only (no message to the peer); whether it was open."""
        with self.outcome_lock:
            if not self.is_open(room):
                return False
            self._m.record_failure(room, reason)
            self._m.update_status(room, KVPoll.Failed)
            return True

    def fail_unless_done(self, room: int, reason: str) -> None:
        """Fail an existing room that has not succeeded (an abort that beat the sender)."""
        with self.outcome_lock:
            status = self._m.request_status.get(room)
            if status is not None and status != KVPoll.Success:
                self._m.record_failure(room, reason)
                self._m.update_status(room, KVPoll.Failed)

    # -- prefill --------------------------------------------------------------------------
    def conclude_failure(self, room: int, reason: str, only_open: bool = False) -> bool:
        """Fail the room and tell its decode ranks (SGLang's status message); whether it
        did. Never after Success (the decode was told, and may use the pages), and with
        ``only_open`` not for a room that already failed either."""
        with self.outcome_lock:
            status = self._m.request_status.get(room)
            if status is None or status == KVPoll.Success:
                return False
            if only_open and status == KVPoll.Failed:
                return False
            self._m.conclude_failure(bootstrap_room=room, failure_reason=reason)
            return True

    def conclude_success(self, room: int) -> bool:
        """Conclude Success and tell the decode ranks, unless the room failed or is gone
        (SGLang then sends the failure instead); whether Success it was."""
        with self.outcome_lock:
            # what it emitted, not the table read after: the scheduler thread may poll the
            # Success and clear the room in between (every supported release returns it)
            emitted = self._m.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
            return emitted == KVPoll.Success

    def mark_ready(self, room: int) -> None:
        """Every decode destination arrived: SGLang's sender may start sending."""
        self._m.update_status(room, KVPoll.WaitingForInput)

    def destinations(self, room: int) -> dict[str, TransferInfo]:
        return self._m.transfer_infos.get(room) or {}

    def add_destination(self, info: TransferInfo) -> int | None:
        """File a decode rank's destination; how many the room has now, or None if this
        agent already gave one (a duplicate)."""
        infos = self._m.transfer_infos.setdefault(info.room, {})
        if info.agent in infos:
            return None
        infos[info.agent] = info
        return len(infos)

    def rooms_with_destinations(self) -> list[tuple[int, dict[str, TransferInfo]]]:
        return list(self._m.transfer_infos.items())

    def set_decode_prefix_len(self, room: int, n: int) -> None:
        self._m.req_to_decode_prefix_len[room] = n

    def mirror_in_flight(self, room: int, n: int) -> None:
        """The one place SGLang's ``_staging_outstanding`` is written for our rooms: the
        room's record counts what it has in flight (its machine), and SGLang holds Success
        and a deferred abort ACK on this copy; at zero the entry goes and a drained abort
        is ACKed. Only the room's worker calls it, so the copies arrive in order."""
        table = self._m._staging_outstanding
        if n > 0:
            table[room] = n
            return
        table.pop(room, None)
        self._m._maybe_ack_drained_abort(room)

    def ack_abort_when_drained(self, room: int, ip: str, port: int, generation: int) -> None:
        self._m.register_deferred_ack_target(room, AbortTarget(ip, port, generation))
        self._m._maybe_ack_drained_abort(room)

    def check_aux_count(self, agent: str, count: int) -> None:
        self._m.check_peer_aux_buffer_count(agent, count)

    # -- decode ---------------------------------------------------------------------------
    def arm_abort(self, room: int) -> int:
        """Count the prefills' drain ACKs for an aborted room; the generation to send."""
        return self._m.register_deferred_abort_room(room)

    def apply_status(self, room: int, status: int, prefill_rank: int, reason: str) -> None:
        self._m.apply_prefill_status(
            bootstrap_room=room,
            status=status,
            prefill_rank=prefill_rank,
            failure_reason=reason or None,
        )

    def note_abort_ack(self, room: int, prefill_rank: int, generation: int | None) -> None:
        if self._m.enable_deferred_decode_kv_release and generation is not None:
            self._m.note_abort_ack(room, prefill_rank, generation)

    def abort_acks_pending(self) -> bool:
        return bool(self._m._deferred_abort_ack_tracker)

    def senders_of(self, room: int) -> int:
        """How many prefill ranks answer for ``room`` (SGLang records it before asking)."""
        return int(self._m.required_prefill_response_num_table.get(room, 1) or 1)

    def cached_prefill_endpoints(self) -> set[Endpoint]:
        with self._m.connection_lock:
            pools = list(self._m.connection_pool.values())
        return {(i["rank_ip"], int(i["rank_port"])) for infos in pools for i in infos}

    def prefill_info(self, addr: str) -> Any:
        """SGLang's parallel info of the prefill at bootstrap ``addr`` (None: not fetched)."""
        return self._m.prefill_info_table.get(addr)

    def resolve_prefill_info(self, topology: dict[str, Any]) -> Any:
        """SGLang's parallel info built from a copy of a prefill's topology answer, with
        SGLang's mapping of this decode's ranks onto it (not cached: SGLang's own query
        fills its table); None when SGLang's code refuses it or has no such mapping."""
        try:
            info = sglang_conn.PrefillServerInfo(**topology)
            self._m._resolve_rank_mapping(info)
        except Exception:  # this release's fields or checks differ: wait for its own query
            return None
        return info

    def forget_prefill_endpoint(self, endpoint: Endpoint, disconnect: bool = True) -> None:
        """Drop cached routes to ``endpoint`` so the next request asks the bootstrap again;
        ``disconnect`` also closes SGLang's cached socket to it."""
        with self._m.connection_lock:
            for key, infos in list(self._m.connection_pool.items()):
                if any((i.get("rank_ip"), int(i.get("rank_port", -1))) == endpoint for i in infos):
                    del self._m.connection_pool[key]
        if disconnect:
            CommonKVReceiver.disconnect_endpoint(NetworkAddress(*endpoint).to_tcp())

    def socket_url(self, endpoint: Endpoint) -> str:
        return tcp(endpoint)[0]

    def socket_urls(self) -> set[str]:
        return receiver_socket_urls()

    def close_socket(self, url: str, linger_ms: int) -> None:
        close_receiver_socket(url, linger_ms)


def receiver_socket(endpoint: Endpoint) -> tuple[Any, Any]:
    """The decode's socket (and its lock) to a prefill rank: the one that carries its
    registrations and transfer requests, so an abort never overtakes the request it cancels."""
    na = NetworkAddress(endpoint[0], int(endpoint[1]))
    return CommonKVReceiver._connect(na.to_tcp(), is_ipv6=na.is_ipv6)


def receiver_socket_urls() -> set[str]:
    """The ``tcp://`` URLs of the decode's cached sockets to prefill ranks."""
    with CommonKVReceiver._global_lock:
        return set(CommonKVReceiver._socket_cache)


def close_receiver_socket(url: str, linger_ms: int) -> None:
    """Drop one cached socket; messages still queued on it get ``linger_ms`` to leave.

    SGLang's own ``disconnect_endpoint`` closes with its socket option (no linger), which
    would drop them.
    """
    with CommonKVReceiver._global_lock:
        sock = CommonKVReceiver._socket_cache.pop(url, None)
        lock = CommonKVReceiver._socket_locks.pop(url, None)
    if sock is None:
        return
    if lock is None:
        sock.close(linger=linger_ms)
        return
    with lock:  # not while a sender that already holds it is mid-send
        sock.close(linger=linger_ms)


def tcp(endpoint: Endpoint) -> tuple[str, bool]:
    na = NetworkAddress(endpoint[0], int(endpoint[1]))
    return na.to_tcp(), na.is_ipv6
