"""Port of SGLang's decode-receiver tests (connection pool, publication, lifecycle) to ours.

Upstream: sgl-project/sglang ``test/registered/unit/disaggregation/test_receiver_connection_pool.py``
at commit 181ed660754ffe44cd003ef85622a5e4ffa6b6a8 (the directory listing names
48ae8b68ba0adee072c282acfc56b19bf6af592a). Upstream builds receivers over bare managers
with hand-made ``connection_pool`` entries; here every receiver is ours, on our live decode
manager, and fetches its prefill ranks from our bootstrap server (``init``), so the cached
entries are the real ones. Prefill statuses reach the decode through our wire from a fake
prefill rank, and what the decode publishes is read off the wire by fake prefill ranks.

Not ported: the byte-layout tests of the in-tree backends' registration and metadata
frames (our wire is our own, tested in ``tests/test_wire_*``), the in-tree staging-handler
cases (``_staging_handler``, ``CHUNK_READY``, ``register_staging_room_bootstrap``: our
decode staging is a different mechanism), the Mooncake ``device_kv_indices`` case
(newer than SGLang 0.5.23, whose in-tree NIXL also accepts and ignores the argument), and
the completion-racing-``clear()`` case, which swaps ``request_status`` for an instrumented
dict: SGLang's ``apply_prefill_status`` logic that our manager inherits unchanged, and
not something to do to a live manager whose listener thread uses that table.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from ._harness import wait_for

pytestmark = pytest.mark.timeout(60)

PAGES = np.array([2, 4], dtype=np.int32)


def _bootstrapped(cluster, room):
    """A receiver of ours after a real ``init``: its prefill ranks come from the bootstrap."""
    receiver = cluster.receiver(room)
    receiver.init(0)
    assert receiver.bootstrap_infos, "init found no prefill rank"
    (key,) = receiver._connection_pool_entries
    return receiver, key


def _status(fake, room, status, rank, reason=""):
    from sgl_nixl_plugin.wire.messages import TransferStatus

    return TransferStatus(
        room=room, status=int(status), prefill_rank=rank, reason=reason, ip=fake.ip, port=fake.port
    )


# -- connection pool ------------------------------------------------------------------------


def test_invalidate_drops_only_the_entries_this_receiver_cached(cluster, rooms):
    pool = cluster.decode.connection_pool
    receiver, key = _bootstrapped(cluster, rooms())
    cached = pool[key]
    assert cached is receiver._connection_pool_entries[key]
    pool["other-prefill"] = [dict(info) for info in cached]
    try:
        receiver.invalidate_cached_bootstrap_infos()
        assert key not in pool
        assert "other-prefill" in pool
        assert receiver._connection_pool_entries == {}
    finally:
        pool.pop("other-prefill", None)
        receiver.clear()


def test_invalidate_keeps_a_newer_entry_another_receiver_cached(cluster, rooms):
    pool = cluster.decode.connection_pool
    receiver, key = _bootstrapped(cluster, rooms())
    replacement = [dict(info) for info in pool[key]]
    pool[key] = replacement  # a concurrent receiver re-fetched and cached its own generation
    receiver.invalidate_cached_bootstrap_infos()
    assert pool[key] is replacement
    receiver.clear()


def test_invalidate_drops_every_entry_of_the_receiver(cluster, rooms):
    pool = cluster.decode.connection_pool
    receiver, key = _bootstrapped(cluster, rooms())
    second = key.rsplit("_", 2)[0] + "_1_0"  # as a second CP rank's entry would be keyed
    pool[second] = receiver._connection_pool_entries[second] = [dict(pool[key][0])]
    receiver.invalidate_cached_bootstrap_infos()
    assert key not in pool
    assert second not in pool
    receiver.clear()


def test_next_receiver_fetches_again_after_an_invalidation(cluster, rooms):
    pool = cluster.decode.connection_pool
    stale, key = _bootstrapped(cluster, rooms())
    old = pool[key]
    stale.invalidate_cached_bootstrap_infos()
    fresh, fresh_key = _bootstrapped(cluster, rooms())
    assert fresh_key == key
    assert pool[key] is not old  # fetched from the bootstrap server, not the stale cache
    assert pool[key] is fresh._connection_pool_entries[key]
    assert [dict(i) for i in pool[key]] == [dict(i) for i in old]
    stale.clear()
    fresh.clear()


def test_waiting_timeout_fails_the_room_and_invalidates_its_cached_entry(cluster, rooms):
    KVPoll = cluster.KVPoll
    room = rooms()
    pool = cluster.decode.connection_pool
    receiver, key = _bootstrapped(cluster, room)
    receiver.send_metadata(PAGES, 1, None)
    assert receiver.poll() == KVPoll.WaitingForInput
    receiver.init_time = time.time() - cluster.decode.waiting_timeout - 1
    assert receiver.poll() == KVPoll.Failed
    assert "timed out" in cluster.decode.failure_records[room]
    assert key not in pool
    assert receiver.abort_notified  # and the prefill ranks were told
    receiver.clear()


# -- publication of registration and metadata ------------------------------------------------


def test_metadata_publication_records_its_time_and_keeps_the_cache(cluster, rooms):
    room = rooms()
    pool = cluster.decode.connection_pool
    receiver, key = _bootstrapped(cluster, room)
    cached = pool[key]
    assert receiver.init_time is None
    receiver.send_metadata(PAGES, 1, [np.array([3, 5], dtype=np.int32)], decode_prefix_len=2)
    assert receiver.init_time is not None
    assert cluster.decode.prefill_response_tracker[room] == set()
    assert pool[key] is cached
    receiver.clear()


def test_missing_bootstrap_infos_fail_the_room_without_publishing(cluster, rooms):
    KVPoll = cluster.KVPoll
    room = rooms()
    receiver = cluster.receiver(room)
    receiver.bootstrap_infos = None  # init could not reach the bootstrap server
    receiver.required_dst_info_num = 1
    receiver.send_metadata(PAGES, 1)
    assert cluster.decode.check_status(room) == KVPoll.Failed
    assert "bootstrap" in cluster.decode.failure_records[room]
    assert receiver.init_time is None
    receiver.clear()


def test_host_destination_without_a_host_pool_is_refused_and_device_is_the_default(
    cluster, rooms, fake_rank
):
    """Upstream's receiver refuses HOST outright; ours serves it when SGLang gave the
    decode a host pool (tests/e2e/test_host_destination.py) and refuses it, publishing
    nothing, when it did not (SGLang then never asks: supports_host_destination is False)."""
    from sglang.srt.disaggregation.base.conn import KVTransferDestination

    from sgl_nixl_plugin.wire.messages import TransferRequest

    prefill = fake_rank("prefill")
    host, device = rooms(), rooms()
    receiver = _on_fake_prefills(cluster, host, [prefill])
    assert receiver.supports_host_destination is False
    with pytest.raises(ValueError, match="registered no host pool"):
        receiver.send_metadata(PAGES, 1, destination=KVTransferDestination.HOST)
    assert receiver.init_time is None
    assert prefill.round_trip(cluster.decode.rank_port) == []  # nothing was published

    explicit = _on_fake_prefills(cluster, device, [prefill])
    explicit.send_metadata(PAGES, 1, destination=KVTransferDestination.DEVICE)
    (published,) = prefill.round_trip(cluster.decode.rank_port)
    assert isinstance(published, TransferRequest) and published.room == device
    assert explicit.init_time is not None
    receiver.clear()
    explicit.clear()


def _on_fake_prefills(cluster, room, prefills):
    """Our receiver, bootstrapped (by hand, as upstream does) against fake prefill ranks."""
    receiver = cluster.receiver(room)
    cluster.decode.update_status(room, cluster.KVPoll.WaitingForInput)
    receiver.bootstrap_infos = [p.info for p in prefills]
    receiver.required_dst_info_num = 1
    return receiver


class _FailingSocket:
    """Stands for a ZMQ socket whose send fails (what upstream injects)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def send_multipart(self, frames, *args, **kwargs):
        raise self.error


def _inject(receiver, bad_port, fault, error):
    """Make publication to ``bad_port`` fail at connect or at send; others are real."""
    real = receiver._connect_to_bootstrap_server

    def connect(info):
        if info["rank_port"] == bad_port:
            if fault == "connect":
                raise error
            sock, lock = real(info)
            return _FailingSocket(error), lock
        return real(info)

    receiver._connect_to_bootstrap_server = connect


def _publish(receiver, operation):
    if operation == "_register_kv_args":
        return receiver._register_kv_args()
    return receiver.send_metadata(PAGES, 9, [np.array([3, 5], dtype=np.int32)], decode_prefix_len=2)


@pytest.mark.parametrize("fault", ["connect", "send"])
@pytest.mark.parametrize("operation", ["_register_kv_args", "send_metadata"])
def test_zmq_failure_stops_publication_and_spares_other_generations(
    cluster, rooms, fake_rank, operation, fault
):
    KVPoll = cluster.KVPoll
    room = rooms()
    pool = cluster.decode.connection_pool
    first, bad, last = fake_rank("p0"), fake_rank("p1"), fake_rank("p2")
    receiver = _on_fake_prefills(cluster, room, [first, bad, last])
    stale, replaced, replacement = [first.info], [bad.info], [last.info]
    pool[f"stale-{room}"], pool[f"replaced-{room}"] = stale, replacement
    receiver._connection_pool_entries = {f"stale-{room}": stale, f"replaced-{room}": replaced}
    _inject(receiver, bad.port, fault, zmq.ZMQError(zmq.EHOSTUNREACH))
    try:
        result = _publish(receiver, operation)
        assert result is (False if operation == "_register_kv_args" else None)
        assert len(first.round_trip(cluster.decode.rank_port)) == 1  # the first rank got it
        assert last.round_trip(cluster.decode.rank_port) == []  # the one after the failure not
        assert receiver.conclude_state == KVPoll.Failed
        assert cluster.decode.check_status(room) == KVPoll.Failed
        # SGLang 0.5.23 names the operation, our template (0.5.21/0.5.22) what was sent
        assert f" to prefill 127.0.0.1:{bad.port} failed" in cluster.decode.failure_records[room]
        if operation == "send_metadata":  # only its own generation is invalidated
            assert f"stale-{room}" not in pool
        else:
            assert pool[f"stale-{room}"] is stale
        assert pool[f"replaced-{room}"] is replacement
        assert receiver.init_time is None
        assert cluster.decode.prefill_response_tracker[room] == set()
    finally:
        pool.pop(f"stale-{room}", None)
        pool.pop(f"replaced-{room}", None)
        receiver.clear()


@pytest.mark.parametrize("fault", ["connect", "send"])
@pytest.mark.parametrize("operation", ["_register_kv_args", "send_metadata"])
def test_non_zmq_errors_propagate_and_leave_the_room_alone(
    cluster, rooms, fake_rank, operation, fault
):
    KVPoll = cluster.KVPoll
    room = rooms()
    first, bad = fake_rank("p0"), fake_rank("p1")
    receiver = _on_fake_prefills(cluster, room, [first, bad])
    error = ValueError("invalid frame")
    _inject(receiver, bad.port, fault, error)
    with pytest.raises(ValueError) as caught:
        _publish(receiver, operation)
    assert caught.value is error
    assert len(first.round_trip(cluster.decode.rank_port)) == 1
    assert cluster.decode.check_status(room) == KVPoll.WaitingForInput
    assert room not in cluster.decode.failure_records
    assert receiver.conclude_state is None
    receiver.clear()


# -- receiver lifecycle ---------------------------------------------------------------------


def test_success_waits_for_every_distinct_prefill_rank(cluster, rooms, fake_rank):
    KVPoll = cluster.KVPoll
    mgr = cluster.decode
    room = rooms()
    prefill = fake_rank("prefill")
    receiver = _on_fake_prefills(cluster, room, [prefill])
    mgr.required_prefill_response_num_table[room] = 2
    for _ in range(2):  # the same rank twice counts once
        prefill.send(mgr.rank_port, _status(prefill, room, KVPoll.Success, 3))
    prefill.round_trip(mgr.rank_port)
    assert receiver.poll() == KVPoll.WaitingForInput
    prefill.send(mgr.rank_port, _status(prefill, room, KVPoll.Success, 4))
    wait_for(lambda: receiver.poll() == KVPoll.Success, 5, "Success from the second rank")
    assert mgr.prefill_response_tracker[room] == {3, 4}
    receiver.clear()


def test_success_cannot_override_a_failure_or_recreate_a_cleared_room(cluster, rooms, fake_rank):
    KVPoll = cluster.KVPoll
    mgr = cluster.decode
    room = rooms()
    prefill = fake_rank("prefill")
    receiver = _on_fake_prefills(cluster, room, [prefill])
    mgr.required_prefill_response_num_table[room] = 1
    prefill.send(mgr.rank_port, _status(prefill, room, KVPoll.Failed, 0, "remote write failed"))
    prefill.send(mgr.rank_port, _status(prefill, room, KVPoll.Success, 0))
    prefill.round_trip(mgr.rank_port)
    assert receiver.poll() == KVPoll.Failed
    assert mgr.failure_records[room] == "remote write failed"
    receiver.clear()
    prefill.send(mgr.rank_port, _status(prefill, room, KVPoll.Success, 0))
    prefill.send(mgr.rank_port, _status(prefill, room, KVPoll.Failed, 0, "late"))
    prefill.round_trip(mgr.rank_port)
    assert room not in mgr.request_status
    assert room not in mgr.prefill_response_tracker
    assert mgr.failure_records.get(room) == "remote write failed"  # not the late one
    mgr.failure_records.pop(room, None)


def test_a_failure_sglang_sets_itself_keeps_its_reason_over_a_prefill_failure(
    cluster, rooms, fake_rank
):
    """SGLang fails an open room by itself (as its timeout while bootstrapping does: the
    status, then the reason) before the scheduler polls it again; a prefill's Failed that
    arrives in between is not applied over it: SGLang's reason stays."""
    KVPoll = cluster.KVPoll
    mgr = cluster.decode
    room = rooms()
    prefill = fake_rank("prefill")
    receiver = _on_fake_prefills(cluster, room, [prefill])
    mgr.decode.rooms.open(room, {(prefill.ip, prefill.port)})  # as our ``init`` opens it
    mgr.required_prefill_response_num_table[room] = 1
    mgr.update_status(room, KVPoll.Failed)
    mgr.record_failure(room, "Timed out waiting for prefill completion")
    prefill.send(mgr.rank_port, _status(prefill, room, KVPoll.Failed, 0, "remote write failed"))
    prefill.round_trip(mgr.rank_port)
    assert mgr.failure_records[room] == "Timed out waiting for prefill completion"
    assert receiver.poll() == KVPoll.Failed
    receiver.clear()
    mgr.failure_records.pop(room, None)


def test_a_failure_from_another_rank_overrides_a_local_success(cluster, rooms):
    from sglang.srt.disaggregation.common.conn import KVTransferError

    KVPoll = cluster.KVPoll
    room = rooms()
    receiver = cluster.receiver(room)
    cluster.decode.update_status(room, KVPoll.Success)
    assert receiver.poll() == KVPoll.Success
    with pytest.raises(KVTransferError) as caught:
        receiver.failure_exception()  # the scheduler's TP-wide verdict was Failed
    assert caught.value.is_from_another_rank
    assert receiver.poll() == KVPoll.Failed


@pytest.mark.parametrize("initial", ["Success", "Failed", "WaitingForInput"])
def test_clear_keeps_a_terminal_result_and_retires_an_unfinished_receiver(cluster, rooms, initial):
    KVPoll = cluster.KVPoll
    mgr = cluster.decode
    room = rooms()
    receiver = cluster.receiver(room)
    state = getattr(KVPoll, initial)
    if state != KVPoll.WaitingForInput:
        mgr.update_status(room, KVPoll.WaitingForInput)
    mgr.update_status(room, state)
    mgr.required_prefill_response_num_table[room] = 1
    if state in (KVPoll.Success, KVPoll.Failed):
        assert receiver.poll() == state
    receiver.clear()
    receiver.clear()
    assert receiver.poll() == (state if state == KVPoll.Success else KVPoll.Failed)
    assert room not in mgr.request_status
    assert room not in mgr.prefill_response_tracker
    assert room not in mgr.required_prefill_response_num_table
    assert room not in mgr.addr_to_rooms_tracker[cluster.addr]


def test_abort_keeps_receive_and_drain_state_until_clear(cluster, rooms, fake_rank):
    from sgl_nixl_plugin.wire.messages import Abort

    KVPoll = cluster.KVPoll
    mgr = cluster.decode
    room = rooms()
    prefill = fake_rank("prefill")
    receiver = _on_fake_prefills(cluster, room, [prefill])
    receiver.init_time = time.time()  # its metadata went out: the prefill may be writing
    tracker = mgr.prefill_response_tracker[room]
    receiver.abort()
    receiver.abort()
    assert receiver.poll() == KVPoll.Failed
    assert mgr.request_status[room] == KVPoll.Failed
    assert mgr.prefill_response_tracker[room] is tracker
    assert room in mgr._deferred_abort_ack_tracker
    assert "Abort" in mgr.failure_records[room]
    sent = prefill.round_trip(mgr.rank_port)
    assert [type(m) for m in sent] == [Abort]  # one notification for two abort() calls
    assert sent[0].room == room
    receiver.clear()
    assert room not in mgr.prefill_response_tracker
    assert room in mgr._deferred_abort_ack_tracker  # released by the scheduler, not clear()


@pytest.mark.parametrize("reason", ["peer disconnected during transfer", None])
def test_failure_exception_keeps_the_local_reason_and_its_origin(cluster, rooms, reason):
    from sglang.srt.disaggregation.common.conn import KVTransferError

    KVPoll = cluster.KVPoll
    mgr = cluster.decode
    room = rooms()
    receiver = cluster.receiver(room)
    mgr.update_status(room, KVPoll.WaitingForInput)
    if reason is not None:
        mgr.record_failure(room, reason)
    with pytest.raises(KVTransferError) as caught:
        receiver.failure_exception()
    assert caught.value.bootstrap_room == room
    assert caught.value.is_from_another_rank is (reason is None)
    if reason is not None:
        assert caught.value.failure_reason == reason
    assert room not in mgr.failure_records
    assert room not in mgr.prefill_response_tracker
    assert receiver.poll() == KVPoll.Failed


# -- sockets of routes that left -----------------------------------------------------------


def test_sockets_of_routes_that_left_are_closed_and_a_refusers_outlive_them(
    cluster, rooms, fake_rank
):
    """A prefill that came back on another port leaves a socket no route leads to: the
    decode closes it once it has been unused for the liveness deadline. A socket whose
    prefill refused this decode stays for a deadline after the refusal (aborts queued on
    it still leave), and one that a cached route leads to stays."""
    from sglang.srt.disaggregation.common.conn import CommonKVReceiver

    from sgl_nixl_plugin.adapter.sglang_rooms import receiver_socket, tcp
    from sgl_nixl_plugin.wire.messages import RegistrationReply

    room = rooms()
    pool, policy = cluster.decode.connection_pool, cluster.decode.decode.policy
    gone, refusing, routed = fake_rank("gone"), fake_rank("refusing"), fake_rank("routed")
    url = {f.name: tcp((f.ip, f.port))[0] for f in (gone, refusing, routed)}
    pool[f"routed-{room}"] = [routed.info]
    try:
        for f in (gone, refusing, routed):
            receiver_socket((f.ip, f.port))
        wait_for(lambda: url[gone.name] in policy._unused_since, 5, "the listener to see it")
        reply = RegistrationReply("agent", 0, False, "test refusal", refusing.ip, refusing.port)
        refusing.send(cluster.decode.rank_port, reply)
        refusing.round_trip(cluster.decode.rank_port)  # the refusal has been applied

        def cached() -> set[str]:
            return set(CommonKVReceiver._socket_cache)

        deadline = cluster.decode.decode.listener.watch.deadline
        wait_for(lambda: url[gone.name] not in cached(), deadline + 3, "the unused socket closed")
        assert url[refusing.name] in cached(), "closed within a deadline of its refusal"
        assert url[routed.name] in cached()
        wait_for(
            lambda: url[refusing.name] not in cached(), 2 * deadline + 3, "the refuser's closed"
        )
        assert url[routed.name] in cached(), "a socket a route leads to was closed"
    finally:
        pool.pop(f"routed-{room}", None)
        for f in (gone, refusing, routed):
            CommonKVReceiver.disconnect_endpoint(url[f.name])
