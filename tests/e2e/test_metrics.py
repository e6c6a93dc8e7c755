"""Prometheus metrics of a real PD session, read across processes.

The rank processes write to ``PROMETHEUS_MULTIPROC_DIR``; this process reads them with
``prometheus_client.multiprocess.MultiProcessCollector``. The session has one prefill rank
and two decode instances: a bench decode rank process (instance 0) and ``FakeDecode``
(instance 1, in this process, a real NIXL agent), which fetches one of its rooms whole and
byte-exact and gives the prefill a wrong page count for the other, a forced failure.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import requests
from helpers.pd import E2E_ENV, expected_bytes, leaked_tables, workload
from helpers.prom import multiproc_registry, rejected_counts, sample_value
from test_hostile import (
    FakeDecode,
    FdCapture,
    LiveSession,
    wait_for,
)

from sgl_nixl_plugin.bench.session import SessionConfig
from sgl_nixl_plugin.bench.workload import (
    AUX_ITEM_BYTES,
    STATE_ITEM_BYTES,
    aux_pattern,
    state_pattern,
)
from sgl_nixl_plugin.metrics import failure_kind
from sgl_nixl_plugin.wire.messages import TransferStatus

FAILED, SUCCESS = 0, 4
RANK0 = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
#: Every value ``metrics.failure_kind`` can return: the label set stays bounded.
FAILURE_KINDS = {
    "aborted",
    "peer_lost",
    "incompatible",
    "bad_request",
    "transport",
    "timeout",
    "other",
}


def test_failure_kind_is_a_bounded_label() -> None:
    assert (
        failure_kind("decode x gave 1 pages, prefill sends 3: page counts disagree")
        == "bad_request"
    )
    assert failure_kind("NIXL WRITE failed") == "transport"
    assert (
        failure_kind("decode d at 1.2.3.4:5 stopped answering (no reply for 5.0s)") == "peer_lost"
    )
    assert (
        failure_kind(None) == failure_kind("") == failure_kind("\u00e9 anything at all") == "other"
    )
    assert {failure_kind(f"reason {i} " * i) for i in range(50)} <= FAILURE_KINDS


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> Any:
    mp = pytest.MonkeyPatch()
    prom = tmp_path_factory.mktemp("prom")
    mp.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))  # the rank processes inherit it
    mp.setenv("UCX_NET_DEVICES", "lo")
    for name in ("SGLANG_NIXL_PLUGIN_SECRET", "SGLANG_NIXL_PLUGIN_SECRET_FILE"):
        mp.delenv(name, raising=False)
    w = workload("tiny", 16, requests=5, min_tokens=48, max_tokens=160)
    reqs = w.make_requests()
    live = LiveSession(
        SessionConfig(
            w, n_decode=2, timeout_s=90, env={**E2E_ENV, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
        )
    )
    url = f"http://127.0.0.1:{live.specs[('prefill', 0, 0)].bootstrap_port}"
    fake = None
    try:
        with FdCapture() as log:
            live.start(("prefill", 0, 0), ("decode", 0, 0))  # decode instance 1 is the fake
            fake = FakeDecode(w, instance=1)

            def route() -> tuple[str, int] | None:
                try:
                    r = requests.get(url + RANK0, timeout=2)
                except requests.RequestException:
                    return None
                return (
                    (r.json()["rank_ip"], int(r.json()["rank_port"]))
                    if r.status_code == 200
                    else None
                )

            prefill_ep = wait_for("the prefill rank's route", route)
            reply = fake.register(prefill_ep)
            assert reply.accepted, reply.reason
            good, bad = reqs[1], reqs[3]  # instance 1 serves the odd requests
            n = good.pages(w.page_size)
            pages = np.arange(1, 1 + n, dtype=np.int32)
            fake.request(
                prefill_ep, good.room, pages, aux_index=1, state=(np.array([1], np.int32),)
            )
            # Forced failure: one destination page where the prefill sends several.
            assert bad.pages(w.page_size) >= 3
            fake.request(prefill_ep, bad.room, np.array([20], np.int32))
            done = {
                room: fake.wait_for(
                    f"the status of room {room}",
                    lambda m, room=room: isinstance(m, TransferStatus) and m.room == room,
                )
                for room in (good.room, bad.room)
            }
            res = live.wait()
            fake.drain()
        yield {
            "w": w,
            "reqs": reqs,
            "res": res,
            "fake": fake,
            "pages": pages,
            "good": good,
            "bad": bad,
            "done": done,
            "metrics": multiproc_registry(prom),
            "log": log.text,
        }
    finally:
        live.kill()
        if fake is not None:
            fake.close()
        mp.undo()


def test_session_itself_went_as_planned(session: dict[str, Any]) -> None:
    res, fake, good = session["res"], session["fake"], session["good"]
    assert not res.errors, res.errors
    dec = res.decode_results()
    mine = [r.room for i, r in enumerate(session["reqs"]) if i % 2 == 0]
    assert sorted(dec) == sorted(mine) and all(
        d["ok"] and d["bad_pages"] == 0 for d in dec.values()
    ), dec
    pre = res.prefill[(0, 0)]["results"]
    assert {room for room, r in pre.items() if not r["ok"]} == {session["bad"].room}, pre
    assert session["done"][good.room].status == SUCCESS
    # what the fake received is byte-exact: KV pages, both aux rows, the state row
    pools = fake.pools
    assert pools.check(good.room, session["pages"]) == 0
    for b, (buf, nb) in enumerate(zip(pools.aux, AUX_ITEM_BYTES, strict=True)):
        assert np.array_equal(buf[nb : 2 * nb], aux_pattern(good.room, b, nb))
    assert np.array_equal(pools.state_row(1), state_pattern(good.room, STATE_ITEM_BYTES))
    assert not leaked_tables(res), leaked_tables(res)  # the failed room left nothing behind either


def test_transfer_metrics_count_every_room(session: dict[str, Any]) -> None:
    m, w, reqs, res = session["metrics"], session["w"], session["reqs"], session["res"]
    ok_rooms = [r for r in reqs if r.room != session["bad"].room]
    assert (
        sample_value(m, "sgl_nixl_transfers_total", outcome="ok") == len(ok_rooms) == len(reqs) - 1
    )
    assert sample_value(m, "sgl_nixl_transfers_total", outcome="failed") == 1
    # KV pages, both aux rows and the state row of every room that succeeded
    cfg = res.config
    kv = sum(expected_bytes(cfg, r.pages(w.page_size)) for r in ok_rooms)
    extra = len(ok_rooms) * (sum(AUX_ITEM_BYTES) + STATE_ITEM_BYTES)
    assert sample_value(m, "sgl_nixl_transfer_bytes_total") == kv + extra
    assert sample_value(m, "sgl_nixl_transfer_seconds_count") == len(ok_rooms)
    assert 0 < sample_value(m, "sgl_nixl_transfer_seconds_sum") < 60
    assert sample_value(m, "sgl_nixl_transfer_descriptors_count") == len(ok_rooms)
    descriptors = sample_value(m, "sgl_nixl_transfer_descriptors_sum")
    assert descriptors >= len(ok_rooms) * 3  # at least the KV, aux and state WRITEs of each
    assert sample_value(m, "sgl_nixl_transfer_descriptors_bucket", le="+Inf") == len(ok_rooms)
    # the rooms' own reports agree with the histogram
    per_room = [r["descriptors"] for r in res.prefill[(0, 0)]["results"].values() if r["ok"]]
    assert sum(per_room) == descriptors
    # a clean session rejects nothing (pongs, registrations, statuses all understood)
    assert not +rejected_counts(m), rejected_counts(m)


def test_forced_failure_is_counted_with_a_bounded_reason(session: dict[str, Any]) -> None:
    m = session["metrics"]
    reasons = {
        s.labels["reason"]: s.value
        for metric in m.collect()
        for s in metric.samples
        if s.name == "sgl_nixl_failures_total"
    }
    assert reasons == {"bad_request": 1.0}, reasons
    assert set(reasons) <= FAILURE_KINDS
    status = session["done"][session["bad"].room]
    assert status.status == FAILED and "page counts disagree" in status.reason


def test_failed_room_log_names_room_and_peer(session: dict[str, Any]) -> None:
    room, agent = session["bad"].room, session["fake"].name
    lines = [line for line in session["log"].splitlines() if f"room {room} failed" in line]
    assert lines, session["log"][-3000:]
    assert any(agent in line and "page counts disagree" in line for line in lines), lines
    assert re.search(
        rf"sgl-nixl: room {room} failed: decode {re.escape(agent)} gave 1 pages", session["log"]
    )
    # nothing about the good rooms is logged as failed
    assert not re.search(rf"room {session['good'].room} failed", session["log"])
