"""Port of SGLang's prefill-sender lifecycle tests to our sender and prefill manager.

Upstream: sgl-project/sglang ``test/registered/unit/disaggregation/test_common_sender_lifecycle.py``
at commit 269099e453c4e41c2ac8feda6863ac91e3d16cce (the version the index serves; the
directory listing names f00c8bfdbe1827b88154a61c7127e0f962d5a0de). Upstream drives
``CommonKVSender`` over bare managers of the in-tree backends and reads the chunks off the
in-tree NIXL manager's ``transfer_queues``. Our manager has no such queue (``send()`` hands
each chunk to a transfer worker that posts it at once), so the chunk contract is checked
where it matters: on the decode's memory, through a real NIXL transfer. The Mooncake- and
Mori-only cases (trace context, early-send wait event) have no counterpart here.

The two-chunk test also checks the transfer metric the sender reports, as SGLang 0.5.23's
``CommonKVSender.get_transfer_metric`` computes it (pages and state indices times item
lengths; latency from the first send), the fallback branch of upstream's
``test_kv_transfer_metrics.py`` (commit 8400671898bc34ad1386e09e4ae94a422e88ebed, whose
measured-record branch is newer than 0.5.23).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from ._harness import wait_for

pytestmark = pytest.mark.timeout(60)

SLOT, STATE_SLOT = 3, 5


def _connect(cluster, room, decode_pages, state=True):
    """A sender/receiver pair for ``room`` whose decode side has published its metadata."""
    KVPoll = cluster.KVPoll
    sender = cluster.sender(room)
    receiver = cluster.receiver(room)
    receiver.init(0)
    cluster.clear_decode_rows(SLOT, STATE_SLOT)
    states = [np.array([STATE_SLOT], dtype=np.int32)] if state else None
    receiver.send_metadata(np.asarray(decode_pages, dtype=np.int32), SLOT, states)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput, 5, "the sender to be bootstrapped")
    return sender, receiver


def test_two_chunks_deliver_pages_first_then_aux_and_state_with_the_last(cluster, rooms):
    KVPoll = cluster.KVPoll
    room = rooms()
    src = np.array([2, 9, 4, 11], dtype=np.int32)
    dst = np.array([7, 3, 12, 5], dtype=np.int32)
    cluster.write_prefill(room, src, SLOT, STATE_SLOT)
    sender, receiver = _connect(cluster, room, dst)

    sender.init(len(src), aux_index=SLOT)
    sender.send(src[:2], num_kv_tokens=8)
    # The first chunk lands on its own: its pages, but neither aux row nor state.
    wait_for(lambda: cluster.decode_pages_ok(room, dst[:2]), 5, "the first chunk's pages")
    assert receiver.poll() == KVPoll.WaitingForInput
    assert cluster.decode_aux_zero(SLOT)
    assert not cluster.decode_state(STATE_SLOT).any()

    sender.send(src[2:], state_indices=[np.array([STATE_SLOT], dtype=np.int32)], num_kv_tokens=7)
    wait_for(lambda: receiver.poll() == KVPoll.Success, 5, "the decode's Success")
    assert cluster.decode_pages_ok(room, dst)
    assert cluster.decode_aux_ok(room, SLOT)
    assert cluster.decode_state(STATE_SLOT).any()
    np.testing.assert_array_equal(
        cluster.decode_state(STATE_SLOT), cluster.prefill_pools.state_row(STATE_SLOT)
    )
    wait_for(lambda: sender.poll() == KVPoll.Success, 5, "the prefill's Success")
    # The sender counted every page and the state index it handed over.
    assert sender._transfer_num_kv_indices == 4
    assert sender._transfer_num_state_indices == 1
    # ... and reports them (and, as our manager measures it, the latency) to the scheduler
    mgr = cluster.prefill
    metric = sender.get_transfer_metric()
    assert metric.transfer_total_bytes == 4 * mgr.kv_item_lens_sum + mgr.state_item_lens_sum
    assert metric.transfer_latency_s is not None and metric.transfer_latency_s > 0
    sender.clear()
    receiver.clear()


def test_zero_kv_final_chunk_still_sends_aux_and_state(cluster, rooms):
    KVPoll = cluster.KVPoll
    room = rooms()
    cluster.write_prefill(room, np.empty(0, np.int32), SLOT, STATE_SLOT)
    sender, receiver = _connect(cluster, room, np.empty(0, np.int32))

    sender.init(0, aux_index=SLOT)
    sender.send(np.empty(0, np.int32), state_indices=[np.array([STATE_SLOT], dtype=np.int32)])
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), 5, "the room to end")
    assert receiver.poll() == KVPoll.Success
    assert cluster.decode_aux_ok(room, SLOT)
    np.testing.assert_array_equal(
        cluster.decode_state(STATE_SLOT), cluster.prefill_pools.state_row(STATE_SLOT)
    )
    wait_for(lambda: sender.poll() == KVPoll.Success, 5, "the prefill's Success")
    sender.clear()
    receiver.clear()


def test_dummy_cp_rank_succeeds_on_its_last_chunk_without_transferring(cluster, rooms):
    KVPoll = cluster.KVPoll
    mgr = cluster.prefill
    room = rooms()
    mgr.is_dummy_cp_rank = True  # what SGLang's __init__ sets on a non-zero CP rank
    try:
        sender = cluster.sender(room)
        sender.init(2, aux_index=SLOT)
        sender.send(np.array([10], dtype=np.int32))
        assert sender.poll() == KVPoll.WaitingForInput
        sender.send(np.array([11], dtype=np.int32))
        assert sender.poll() == KVPoll.Success
    finally:
        mgr.is_dummy_cp_rank = False
    # Nothing went to a transfer worker: a chunk there, with no decode destination, would
    # have failed the room. Workers serve rooms in order, so once later rooms that have
    # no destination either (one per worker shard) have failed, ours would have too.
    probes = [rooms() for _ in range(8)]
    probe_senders = []
    for probe in probes:
        s = cluster.sender(probe)
        s.init(1, aux_index=SLOT)
        s.send(np.array([1], dtype=np.int32))
        probe_senders.append(s)
    wait_for(lambda: all(s.poll() == KVPoll.Failed for s in probe_senders), 5, "probe rooms")
    assert room not in mgr.failure_records
    assert mgr.request_status.get(room) == KVPoll.Success
    assert sender._transfer_num_kv_indices == 0
    sender.clear()
    for s in probe_senders:
        with pytest.raises(Exception, match="no decode destination"):
            s.failure_exception()


def test_success_waits_for_an_outstanding_write_and_survives_clear(cluster, rooms):
    KVPoll = cluster.KVPoll
    mgr = cluster.prefill
    room = rooms()
    sender = cluster.sender(room)
    sender._transfer_start_time = time.perf_counter() - 2.0
    # A room's worker mirrors what its record has in flight into _staging_outstanding
    # (SGLangRooms.mirror_in_flight); Success must wait until that comes back to 0.
    mgr.prefill.ctx.sglang.mirror_in_flight(room, 1)
    mgr.update_status(room, KVPoll.Success)
    assert sender.poll() == KVPoll.Transferring
    assert sender.conclude_state is None
    mgr.prefill.ctx.sglang.mirror_in_flight(room, 0)
    assert sender.poll() == KVPoll.Success
    assert sender._transfer_metric.transfer_latency_s >= 2.0  # the plugin reports latency
    sender.clear()
    assert sender.poll() == KVPoll.Success
    assert room not in mgr.request_status


def test_bootstrap_timeout_latches_failed_and_cleans_up(cluster, rooms):
    from sglang.srt.disaggregation.common.conn import KVTransferError

    KVPoll = cluster.KVPoll
    mgr = cluster.prefill
    room = rooms()
    sender = cluster.sender(room)
    sender.init_time = time.time() - mgr.bootstrap_timeout - 1  # no decode ever came
    assert sender.poll() == KVPoll.Failed
    assert sender.conclude_state == KVPoll.Failed
    assert "timed out" in mgr.failure_records[room]
    with pytest.raises(KVTransferError) as raised:
        sender.failure_exception()
    assert not raised.value.is_from_another_rank
    assert room not in mgr.failure_records
    assert room not in mgr.transfer_infos
    assert sender.poll() == KVPoll.Failed


def test_abort_stops_sending_and_keeps_the_abort_reason(cluster, rooms):
    from sglang.srt.disaggregation.common.conn import KVTransferError

    room = rooms()
    sender = cluster.sender(room)
    sender.init(1, aux_index=SLOT)
    sender.abort()
    sender.send(np.array([1], dtype=np.int32))
    assert sender._transfer_num_kv_indices == 0  # nothing was handed to the manager
    with pytest.raises(KVTransferError, match="Aborted"):
        sender.failure_exception()


def test_missing_room_is_failed_without_resurrecting_it(cluster, rooms):
    from sglang.srt.disaggregation.common.conn import KVTransferError

    KVPoll = cluster.KVPoll
    mgr = cluster.prefill
    room = rooms()
    sender = cluster.sender(room)
    del mgr.request_status[room]  # e.g. cleared by another rank's failure path
    assert sender.poll() == KVPoll.Failed
    assert room not in mgr.request_status
    with pytest.raises(KVTransferError) as raised:
        sender.failure_exception()
    assert raised.value.is_from_another_rank


def test_a_failed_room_leaves_nothing_behind_for_the_next_use_of_its_id(cluster, rooms):
    """A worker-side failure must not leave the room's outstanding count behind: a later
    request reusing the id would report Transferring forever. (Behaviour of the
    worker-failure case in a newer upstream NIXL control-path test the index serves by
    content only, id 59450246278: ``test_worker_failure_clears_room_outstanding_count``.)
    """
    KVPoll = cluster.KVPoll
    mgr = cluster.prefill
    room = rooms()
    first = cluster.sender(room)
    first.init(1, aux_index=SLOT)
    first.send(np.array([1], dtype=np.int32))  # no decode destination: the room fails
    wait_for(
        lambda: first.poll() == KVPoll.Failed and room not in mgr._staging_outstanding,
        5,
        "the failed room to settle",
    )
    with pytest.raises(Exception, match="no decode destination"):
        first.failure_exception()

    src = np.array([5, 6], dtype=np.int32)
    dst = np.array([9, 2], dtype=np.int32)
    cluster.write_prefill(room, src, SLOT, STATE_SLOT)
    sender, receiver = _connect(cluster, room, dst, state=False)
    sender.init(len(src), aux_index=SLOT)
    sender.send(src)
    wait_for(lambda: receiver.poll() == KVPoll.Success, 5, "the reused room's Success")
    wait_for(lambda: sender.poll() == KVPoll.Success, 5, "the prefill's Success")
    assert cluster.decode_pages_ok(room, dst)
    sender.clear()
    receiver.clear()
