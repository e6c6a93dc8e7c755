"""Failure handling of PD transfers with real NIXL, real SGLang classes, one process per rank.

Every test steers its ranks step by step (``helpers.faults``): a prefill holds the last
chunk of some rooms, so a kill, an abort or a partition lands while the room is provably
mid-transfer (its first chunk's pages already hold the expected bytes on the decode, its
last chunk not). Times compared across processes are ``time.time()`` on one host.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from helpers.faults import (
    FaultCluster,
    RankProc,
    first_chunk_pages,
    hold_mid_transfer,
    make_requests,
    netns_pair,
    netns_unavailable,
    poll_until,
)
from helpers.prom import multiproc_registry, sample_value

from sgl_nixl_plugin.bench.rank import RankSpec
from sgl_nixl_plugin.bench.session import free_port
from sgl_nixl_plugin.bench.workload import PRESETS, ModelShape, Request, Workload

PAGE = 16
TINY = Workload(PRESETS["tiny"], page_size=PAGE, max_tokens=128, concurrency=32)

#: A ping deadline shorter than a room is held in tests 1 and 5 (interval x misses).
SHORT_PINGS = {
    "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "0.5",
    "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "4",
}
SHORT_PING_DEADLINE_S = 2.0

#: The kill-detection bounds of the brief: the decode sees a dead prefill within 2 s, the
#: prefill cleans up after a dead decode within 5 s.
PREFILL_DEATH_S = 2.0
DECODE_DEATH_S = 5.0


KVPOLL_FAILED, KVPOLL_SUCCESS = 0, 4  # SGLang's KVPoll values


def _first_chunk(r: Request) -> int:
    return first_chunk_pages(r, PAGE)


def _rooms(reqs: list[Request]) -> set[int]:
    return {r.room for r in reqs}


def _room_tables(tables: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in tables.items() if not k.startswith(("nixl.", "count.")) and v}


def _assert_byte_exact(results: dict[int, dict[str, Any]], logs: str = "") -> None:
    bad = {
        room: (r.get("reason"), r.get("bad_pages"), r.get("bad_aux"), r.get("bad_state"))
        for room, r in results.items()
        if not r["ok"] or r.get("bad_pages") or r.get("bad_aux") or r.get("bad_state")
    }
    assert not bad, f"rooms not delivered byte-exact: {bad}\n{logs}"


def _run_ok(
    prefill: RankProc, decode: RankProc, reqs: list[Request], addr: str, timeout: float = 30
) -> None:
    """Serve ``reqs`` through one prefill and one decode; all must arrive byte-exact."""
    prefill.call("expect", reqs=reqs)
    assert decode.call("submit", reqs=reqs, addr=addr) == {}
    got = decode.wait_done(_rooms(reqs), timeout)
    _assert_byte_exact(got, prefill.log_tail() + decode.log_tail())
    sent = prefill.wait_done(_rooms(reqs), timeout)
    assert all(r["ok"] for r in sent.values()), sent


def _hold(
    prefill: RankProc, decode: RankProc, reqs: list[Request], addr: str, timeout: float = 30
) -> None:
    hold_mid_transfer(prefill, decode, reqs, addr, PAGE, timeout)


def _stays_held(prefill: RankProc, decode: RankProc, rooms: set[int], seconds: float) -> None:
    """Observe for ``seconds`` that no room of ``rooms`` ends on either side: healthy peers
    with rooms pending past the ping deadline must not be declared dead."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ended = set(decode.done(rooms)) | set(prefill.done(rooms))
        assert not ended, (
            f"{len(ended)} held rooms ended while both sides were healthy: "
            f"{list(decode.done(rooms).values())[:2]} {list(prefill.done(rooms).values())[:2]}"
        )
        time.sleep(0.1)  # observation window of a bounded check, not synchronisation


# ---------------------------------------------------------------------------------------
# 1. prefill killed mid-transfer
# ---------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_prefill_killed_mid_transfer_fails_its_rooms_fast(tmp_path: Path) -> None:
    """SIGKILL one prefill instance (its bootstrap server is a separate process and stays
    up) while rooms to it are mid-transfer: every such decode request fails within 2 s
    with a reason naming that prefill rank; requests to the healthy instance go on. Before
    the kill, the rooms are held past the ping deadline: healthy peers stay alive (each side
    answers the other's pings)."""
    prom = tmp_path / "prom"
    prom.mkdir()
    env = {**SHORT_PINGS, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    with FaultCluster(TINY, tmp_path, env) as c:
        port0, port1 = free_port(), free_port()
        # All start at once: a prefill retries its bootstrap registration for ~15 s.
        boot0 = c.bootstrap("boot0", port0)
        p0 = c.prefill("prefill0", port0, serve_bootstrap=False, instance=0)
        p1 = c.prefill("prefill1", port1, serve_bootstrap=True, instance=1)
        d = c.decode("decode0")
        c.ready()
        addr0, addr1 = f"127.0.0.1:{port0}", f"127.0.0.1:{port1}"
        dead = (p0.info["ip"], p0.info["port"])

        _run_ok(p0, d, make_requests(3, 10, tokens=(16, 64)), addr0)
        _run_ok(p1, d, make_requests(3, 11, tokens=(16, 64)), addr1)

        to0 = make_requests(8, 12, tokens=(48, 128), chunks=2)
        to1 = make_requests(8, 13, tokens=(48, 128), chunks=2)
        _hold(p0, d, to0, addr0)
        _hold(p1, d, to1, addr1)
        # what the chaos checker reports of a room without an outcome: a held room's state
        held = d.call("room", room=to0[0].room)
        assert held["sglang_status"] not in (KVPOLL_SUCCESS, KVPOLL_FAILED), held
        assert held["harness"]["aux_landed"] is False and not held["harness"]["aborted"], held
        assert [tuple(e) for e in held["record"]["sent_to"]] == [dead], held
        poll_until(lambda: d.call("state")["watched"], lambda w: w.get(dead) is True, 10)
        # Held past the ping deadline, the rooms live on: both sides answer pings.
        _stays_held(p0, d, _rooms(to0), SHORT_PING_DEADLINE_S + 1)

        t_kill = p0.kill()
        failed = d.wait_done(_rooms(to0), 20)
        late = {}
        for room, r in failed.items():
            assert not r["ok"], f"room {room} to the killed prefill succeeded"
            assert f"{dead[0]}:{dead[1]}" in r["reason"], r["reason"]
            assert "closed its connection" in r["reason"], r["reason"]
            if r["t"] - t_kill > PREFILL_DEATH_S:
                late[room] = r["t"] - t_kill
        detect = max(r["t"] - t_kill for r in failed.values())
        print(
            f"\nprefill kill -> decode failure: max {detect * 1e3:.0f} ms over {len(failed)} rooms"
        )
        assert not late, f"failures observed later than {PREFILL_DEATH_S}s after the kill: {late}"

        # The healthy instance: its held rooms were untouched and complete byte-exact.
        assert not d.done(_rooms(to1)), "rooms of the healthy prefill failed with the other"
        assert set(p1.call("release", rooms=list(_rooms(to1)))) == _rooms(to1)
        _assert_byte_exact(d.wait_done(_rooms(to1), 20), c.logs())
        # ... and it keeps serving new requests.
        _run_ok(p1, d, make_requests(8, 14, tokens=(16, 128), chunks=2), addr1)

        st = d.call("state")
        assert dead not in st["known"] and dead not in st["watched"], st
        assert f"tcp://{dead[0]}:{dead[1]}" not in st["sockets"], st
        assert boot0.alive(), "the bootstrap server of the killed prefill went down"
        assert not _room_tables(st["tables"]), st["tables"]
    # every failed room was counted once, as a lost peer (by the decode: the prefill died)
    lost = multiproc_registry(prom)
    assert sample_value(lost, "sgl_nixl_failures_total", reason="peer_lost") == len(to0)
    assert sample_value(lost, "sgl_nixl_failures_total") == len(to0)


# ---------------------------------------------------------------------------------------
# 2. decode killed mid-transfer
# ---------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_decode_killed_mid_transfer_prefill_cleans_up(tmp_path: Path) -> None:
    """SIGKILL one decode instance while rooms to it are mid-transfer (and their last
    chunks are posted right after the kill): the prefill fails those rooms, and within 5 s
    its per-room tables are empty, no NIXL transfer handle is live, and the dead decode's
    peer and prepared lists are gone; it keeps serving the other decode instance."""
    with FaultCluster(TINY, tmp_path) as c:
        port = free_port()
        p = c.prefill("prefill0", port, serve_bootstrap=True)
        d0 = c.decode("decode0", instance=0)
        d1 = c.decode("decode1", instance=1)
        c.ready()
        addr = f"127.0.0.1:{port}"

        _run_ok(p, d1, make_requests(3, 20, tokens=(16, 64)), addr)
        one_peer = p.call("state")["tables"]
        _run_ok(p, d0, make_requests(3, 21, tokens=(16, 64)), addr)
        two_peers = p.call("state")
        assert two_peers["tables"]["nixl.peer"] == one_peer["nixl.peer"] + 1 == 2, two_peers
        assert two_peers["peers"] == sorted([d0.info["agent"], d1.info["agent"]])

        held = make_requests(8, 22, tokens=(48, 128), chunks=2)
        _hold(p, d0, held, addr)
        # The prefill watches decodes it owes data: wait until that connection is up.
        target = (d0.info["ip"], d0.info["port"])
        poll_until(lambda: p.call("state")["watched"], lambda w: w.get(target) is True, 10)

        # Half the rooms stay held (they must fail); the other half's last chunks are
        # posted as the decode is killed, so their WRITEs race the death of their target
        # (each such room may end either way, but must end).
        stay = {r.room for r in held[:4]}
        race = _rooms(held) - stay
        rid = p.send("release", rooms=sorted(race))
        t_kill = d0.kill()
        posted = p.result(rid)
        ended = p.wait_done(_rooms(held), 2 * DECODE_DEATH_S)
        for room in stay:
            r = ended[room]
            assert not r["ok"] and f"{target[0]}:{target[1]}" in r["reason"], r
        reasons = Counter((r["reason"] or "ok").split("): ", 1)[-1][:70] for r in ended.values())

        def clean(st: dict[str, Any]) -> bool:
            t = st["tables"]
            return (
                not _room_tables(t)
                and t["nixl.xfer"] == 0
                and t["nixl.peer"] == one_peer["nixl.peer"]
                and t["nixl.dlist"] == one_peer["nixl.dlist"]
                and st["peers"] == [d1.info["agent"]]
                and st["active"] == 0
            )

        try:
            st, t_clean = poll_until(lambda: p.call("state"), clean, 3 * DECODE_DEATH_S, 0.02)
        except TimeoutError as exc:
            raise AssertionError(
                f"prefill did not clean up after the dead decode: {exc}\n{c.logs()}"
            ) from None
        fail_s = max(ended[room]["t"] for room in stay) - t_kill
        print(
            f"\ndecode kill -> prefill rooms failed {fail_s * 1e3:.0f} ms, state clean "
            f"{(t_clean - t_kill) * 1e3:.0f} ms; {len(posted)} last chunks posted after the kill; "
            f"reasons {dict(reasons)}"
        )
        assert t_clean - t_kill <= DECODE_DEATH_S, f"cleanup took {t_clean - t_kill:.2f}s"

        _run_ok(p, d1, make_requests(8, 23, tokens=(16, 128), chunks=2), addr)
        assert p.alive()


@pytest.mark.timeout(180)
def test_idle_decode_killed_prefill_drops_its_peer(tmp_path: Path) -> None:
    """SIGKILL a decode that has nothing in flight: the prefill (which only pings decodes it
    owes data) still sees the connection go and, within 5 s, drops that decode's NIXL peer
    and prepared lists; a decode restarted on another port would otherwise leave one more
    behind at every restart. The other decode keeps being served."""
    with FaultCluster(TINY, tmp_path) as c:
        port = free_port()
        p = c.prefill("prefill0", port, serve_bootstrap=True)
        d0 = c.decode("decode0", instance=0)
        d1 = c.decode("decode1", instance=1)
        c.ready()
        addr = f"127.0.0.1:{port}"
        _run_ok(p, d1, make_requests(3, 25, tokens=(16, 64)), addr)
        one_peer = p.call("state")["tables"]
        _run_ok(p, d0, make_requests(3, 26, tokens=(16, 64)), addr)
        assert p.call("state")["tables"]["nixl.peer"] == 2
        t_kill = d0.kill()

        def dropped(st: dict[str, Any]) -> bool:
            t = st["tables"]
            return (
                st["peers"] == [d1.info["agent"]]
                and t["nixl.peer"] == one_peer["nixl.peer"]
                and t["nixl.dlist"] == one_peer["nixl.dlist"]
            )

        try:
            _, t_drop = poll_until(lambda: p.call("state"), dropped, 3 * DECODE_DEATH_S, 0.05)
        except TimeoutError as exc:
            raise AssertionError(f"the dead idle decode's peer stayed: {exc}") from None
        print(f"\nidle decode kill -> prefill dropped its peer in {(t_drop - t_kill) * 1e3:.0f} ms")
        assert t_drop - t_kill <= DECODE_DEATH_S
        _run_ok(p, d1, make_requests(4, 27, tokens=(16, 128), chunks=2), addr)


# ---------------------------------------------------------------------------------------
# 3. prefill restarted behind the same bootstrap server
# ---------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_prefill_restart_on_same_bootstrap_decode_recovers(tmp_path: Path) -> None:
    """Kill the prefill rank and start a new one that registers to the same bootstrap
    server: the decode (not restarted) drops the stale peer and its route, and its next
    request reaches the new prefill and arrives byte-exact. Done twice: once killed while
    idle, once mid-transfer."""
    with FaultCluster(TINY, tmp_path) as c:
        port = free_port()
        boot = c.bootstrap("boot", port)
        d = c.decode("decode0")
        first = c.prefill("prefillA", port, serve_bootstrap=False)
        c.ready()
        addr = f"127.0.0.1:{port}"
        _run_ok(first, d, make_requests(4, 30, tokens=(16, 128), chunks=2), addr)

        def dropped(ep: tuple[str, int]) -> Any:
            return poll_until(
                lambda: d.call("state"),
                lambda st: (
                    ep not in st["known"]
                    and ep not in st["watched"]
                    and f"tcp://{ep[0]}:{ep[1]}" not in st["sockets"]
                ),
                5,
            )

        # (a) killed while idle: only the connection watch can tell the decode.
        old = (first.info["ip"], first.info["port"])
        t_kill = first.kill()
        _, t_drop = dropped(old)
        second = c.prefill("prefillB", port, serve_bootstrap=False)
        second.wait_ready()
        new = (second.info["ip"], second.info["port"])
        assert new != old
        _run_ok(second, d, make_requests(6, 31, tokens=(16, 128), chunks=2), addr)
        st = d.call("state")
        assert st["known"] == [new], st
        print(
            f"\nidle prefill kill -> decode dropped its route in {(t_drop - t_kill) * 1e3:.0f} ms"
        )

        # (b) killed mid-transfer: the held rooms fail naming the old rank, then recovery.
        held = make_requests(4, 32, tokens=(48, 128), chunks=2)
        _hold(second, d, held, addr)
        t_kill = second.kill()
        for r in d.wait_done(_rooms(held), 10).values():
            assert not r["ok"] and f"{new[0]}:{new[1]}" in r["reason"], r
            assert r["t"] - t_kill <= PREFILL_DEATH_S, r["t"] - t_kill
        dropped(new)
        third = c.prefill("prefillC", port, serve_bootstrap=False)
        third.wait_ready()
        _run_ok(third, d, make_requests(6, 33, tokens=(16, 128), chunks=2), addr)
        st = d.call("state")
        assert st["known"] == [(third.info["ip"], third.info["port"])], st
        assert not _room_tables(st["tables"]), st["tables"]
        assert boot.alive()


# ---------------------------------------------------------------------------------------
# 4. decode abort with deferred KV release
# ---------------------------------------------------------------------------------------

#: 512 KiB pages (16 regions x 8 heads x 256 B x 16 tokens): a room's last chunk is a
#: multi-MiB WRITE, so the abort has a chance to arrive while it is in flight.
BIG = Workload(
    ModelShape("abort-test", layers=8, kv_heads=8, head_dim=128),
    page_size=PAGE,
    max_tokens=256,
    concurrency=12,
)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("path", ["direct", "staging"])
def test_decode_abort_ack_only_after_writes_drained(tmp_path: Path, path: str) -> None:
    """With SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1, the decode loop aborts each
    room (SGLang's ``receiver.abort()``) as soon as the first bytes of its last chunk land,
    i.e. with that chunk's WRITEs in flight: every abort is acknowledged
    (``is_abort_release_safe``), and no byte of the room's pages, aux row or state row
    changes after the ack, even once the prefill has finished everything."""
    env = {
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1",
        "SGLANG_NIXL_PLUGIN_TRANSFER_PATH": path,
        "SGLANG_NIXL_PLUGIN_STAGING_BYTES": str(64 << 20),
        "SGLANG_NIXL_PLUGIN_STAGING_PIECE_BYTES": str(1 << 20),
    }
    with FaultCluster(BIG, tmp_path, env) as c:
        port = free_port()
        p = c.prefill("prefill0", port, serve_bootstrap=True)
        d = c.decode("decode0")
        c.ready()
        addr = f"127.0.0.1:{port}"
        _run_ok(p, d, make_requests(2, 40, tokens=(128, 256), chunks=2), addr)

        stats: list[tuple[int, int, int]] = []  # (pages landing at abort, of, complete at ack)
        for attempt in range(3):
            reqs = make_requests(10, 41 + attempt, tokens=(224, 256), chunks=2)
            rooms = _rooms(reqs)
            _hold(p, d, reqs, addr)
            d.call(
                "arm_abort", rooms=sorted(rooms), from_page={r.room: _first_chunk(r) for r in reqs}
            )
            p.call("release", rooms=sorted(rooms))

            def progress(rooms: set[int] = rooms) -> tuple[dict[int, Any], set[int], set[int]]:
                aborted = {e["room"]: e for e in d.events("aborted") if e["room"] in rooms}
                return aborted, {e["room"] for e in d.events("acked")}, set(d.done(rooms))

            def settled(
                v: tuple[dict[int, Any], set[int], set[int]], rooms: set[int] = rooms
            ) -> bool:
                aborted, acked, finished = v
                return (set(aborted) | finished) >= rooms and set(aborted) <= acked

            try:
                (aborted, acked, finished), _ = poll_until(progress, settled, 15)
            except TimeoutError as exc:
                raise AssertionError(f"ABORT_ACK missing: {exc}\n{c.logs()}") from None
            # Let the prefill finish everything else: every room ended, nothing in flight.
            p.wait_done(rooms, 15)
            poll_until(
                lambda: p.call("state")["tables"],
                lambda t: not _room_tables(t) and t["nixl.xfer"] == 0,
                10,
            )
            changed = d.call("check_unchanged", rooms=sorted(aborted))
            touched = {room: v for room, v in changed.items() if v["changed"]}
            assert not touched, f"bytes changed after ABORT_ACK: {touched}\n{c.logs()}"
            _assert_byte_exact(d.done(finished))
            stats += [
                (e["landing"], e["of"], changed[room]["landed_at_ack"])
                for room, e in aborted.items()
            ]
            if any(landing < of for landing, of, _ in stats):
                break  # an abort landed while the last chunk was only partly written
        print(f"\n{path}: aborts (last-chunk pages landed at abort / of them, pages complete")
        print(f"at ack): {sorted(stats)}")
        assert stats, "no room could be aborted mid-transfer"
        st = d.call("state")
        assert not _room_tables(st["tables"]), st["tables"]
        # The pair still works after the aborts.
        _run_ok(p, d, make_requests(2, 49, tokens=(128, 256), chunks=2), addr)


# ---------------------------------------------------------------------------------------
# 5. network partition between two hosts (network namespaces)
# ---------------------------------------------------------------------------------------

LIVENESS_INTERVAL_S = 0.5
LIVENESS_MISSES = 4
PARTITION_MARGIN_S = 2.0


@pytest.mark.timeout(240)
def test_network_partition_fails_rooms_within_liveness_deadline(tmp_path: Path) -> None:
    """Prefill and decode in two network namespaces joined by a veth pair, UCX over TCP.
    Cutting the link mid-transfer fails the rooms on both sides within the liveness
    deadline (interval x misses) plus a margin; after the link is restored, the state
    drains and new requests succeed byte-exact."""
    why = netns_unavailable()
    if why:
        pytest.skip(f"network namespaces unavailable: {why}")
    deadline = LIVENESS_INTERVAL_S * LIVENESS_MISSES
    with netns_pair() as net:
        common = {
            "UCX_TLS": "tcp,self",
            "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": str(LIVENESS_INTERVAL_S),
            "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": str(LIVENESS_MISSES),
        }
        with FaultCluster(TINY, tmp_path, common) as c:
            port = free_port()
            p = c.prefill(
                "prefill0",
                port,
                serve_bootstrap=True,
                netns=net.ns[0],
                env={"SGLANG_HOST_IP": net.addr[0], "UCX_NET_DEVICES": net.dev[0]},
                # inside the namespace only: its loopback (where the prefill registers) and the veth
                opts={"bootstrap_host": "0.0.0.0"},
            )
            d = c.decode(
                "decode0",
                netns=net.ns[1],
                env={"SGLANG_HOST_IP": net.addr[1], "UCX_NET_DEVICES": net.dev[1]},
            )
            c.ready()
            assert p.info["ip"] == net.addr[0] and d.info["ip"] == net.addr[1]
            addr = f"{net.addr[0]}:{port}"
            _run_ok(p, d, make_requests(4, 50, tokens=(16, 128), chunks=2), addr)

            held = make_requests(8, 51, tokens=(48, 128), chunks=2)
            _hold(p, d, held, addr)
            into_void = sorted(_rooms(held))[:4]
            # Before the cut, held rooms outlive the ping deadline: failures below are the
            # partition's, not a healthy peer declared dead.
            _stays_held(p, d, _rooms(held), deadline + 1)

            t_cut = time.time()
            net.link(0, "down")
            # Half the last chunks are posted into the partition: those WRITEs hang.
            p.call("release", rooms=into_void)
            dec = d.wait_done(_rooms(held), deadline + 3 * PARTITION_MARGIN_S)
            pre = p.wait_done(_rooms(held), deadline + 3 * PARTITION_MARGIN_S)
            dec_s = max(r["t"] for r in dec.values()) - t_cut
            pre_s = max(r["t"] for r in pre.values()) - t_cut
            print(
                f"\npartition: decode rooms failed after {dec_s:.2f}s, prefill rooms after "
                f"{pre_s:.2f}s (deadline {deadline:.1f}s + margin {PARTITION_MARGIN_S:.1f}s)"
            )
            for r in dec.values():
                assert not r["ok"] and "stopped answering" in r["reason"], r
            assert not any(r["ok"] for r in pre.values()), pre
            assert dec_s <= deadline + PARTITION_MARGIN_S, dec_s
            assert pre_s <= deadline + PARTITION_MARGIN_S, pre_s

            t_up = time.time()
            net.link(0, "up")
            p.call("release", rooms=sorted(_rooms(held)))  # no-op: those rooms have ended
            try:
                _, t_drained = poll_until(
                    lambda: p.call("state")["tables"],
                    lambda t: not _room_tables(t) and t["nixl.xfer"] == 0,
                    60,
                    0.1,
                )
            except TimeoutError as exc:
                raise AssertionError(
                    f"prefill state did not drain after the link came back: {exc}\n{c.logs()}"
                ) from None
            t0 = time.time()
            _run_ok(p, d, make_requests(8, 52, tokens=(16, 128), chunks=2), addr, timeout=60)
            print(
                f"link restored: prefill drained in {t_drained - t_up:.2f}s, "
                f"8 new requests served in {time.time() - t0:.2f}s"
            )
            st = d.call("state")
            assert not _room_tables(st["tables"]), st["tables"]


# ---------------------------------------------------------------------------------------
# 6. a decode the prefill refuses
# ---------------------------------------------------------------------------------------

#: How soon both sides of a refused room must have failed (the brief: no client timeout).
REFUSAL_S = 2.0


@pytest.mark.timeout(180)
@pytest.mark.parametrize("sender_first", [True, False], ids=["sender-first", "decode-first"])
def test_refused_decode_fails_the_room_on_both_sides_fast(
    tmp_path: Path, sender_first: bool
) -> None:
    """The prefill refuses a decode of another layout (one more layer). SGLang's decode fails
    such a room at its handshake and sends the prefill nothing more (no metadata, no abort),
    so the plugin must tell it: the prefill's sender fails with the refusal's reason within
    2 s, whether it existed before the decode gave up or was created after (the router sends
    a request to both servers at once, either can see it first)."""
    other = Workload(
        ModelShape("tiny-5-layers", 5, 4, 16, "float16"),
        page_size=PAGE,
        max_tokens=128,
        concurrency=32,
    )
    why = "num_layers: prefill=8 decode=10"  # K and V buffers per layer
    with FaultCluster(TINY, tmp_path) as c:
        port = free_port()
        p = c.prefill("prefill0", port, serve_bootstrap=True)
        d = c.add("decode0", RankSpec("decode", 0, 1, 0, other, bootstrap_port=0, env=dict(c.env)))
        c.ready()
        addr = f"127.0.0.1:{port}"
        reqs = make_requests(4, 40, tokens=(16, 64))
        rooms = _rooms(reqs)
        if sender_first:
            p.call("expect", reqs=reqs)
        assert d.call("submit", reqs=reqs, addr=addr, metadata=False) == {}
        failed = d.wait_done(rooms, 20)
        assert set(failed) == rooms
        for r in failed.values():
            assert not r["ok"], r
            assert "refused this decode" in r["reason"] and why in r["reason"], r["reason"]
        t_known = max(r["t"] for r in failed.values())
        if not sender_first:
            t_known = time.time()
            p.call("expect", reqs=reqs)
        sent = p.wait_done(rooms, 20)
        assert set(sent) == rooms
        for r in sent.values():
            assert not r["ok"], r
            assert why in (r["reason"] or ""), r["reason"]
        late = {
            room: round(r["t"] - t_known, 2)
            for room, r in sent.items()
            if r["t"] - t_known > REFUSAL_S
        }
        assert not late, f"prefill rooms failed later than {REFUSAL_S}s: {late}\n{c.logs()}"
        assert not _room_tables(p.call("state")["tables"])
        assert not _room_tables(d.call("state")["tables"])
