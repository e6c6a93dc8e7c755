"""The bench's summary: the first request of a fresh pair apart from the steady state."""

from __future__ import annotations

import pytest

from sgl_nixl_plugin.bench.report import summarize, table
from sgl_nixl_plugin.bench.session import SessionConfig, SessionResult
from sgl_nixl_plugin.bench.workload import PRESETS, Workload


def _room(wall0: float, latency_ms: float, mib: int = 1) -> dict:
    return {
        "ok": True,
        "latency_s": latency_ms / 1e3,
        "wall0": wall0,
        "wall1": wall0 + 1,
        "bytes": mib << 20,
    }


def test_the_first_request_is_reported_apart_from_the_steady_state():
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=4)
    rooms = {1: _room(10.0, 90.0), 2: _room(10.5, 20.0), 3: _room(11.0, 10.0), 4: _room(11.5, 30.0)}
    decode = {(0, 0): {"results": rooms, "ready_s": 0.6}, (0, 1): {"results": {}, "ready_s": 0.8}}
    result = SessionResult(SessionConfig(w), 3.0, {}, decode, [])
    s = summarize(result)
    assert s["first_request_ms"] == 90.0  # the room that started first, whatever its id
    assert s["steady_p50_ms"] == 20.0  # p50 of the other three
    assert s["first_vs_steady_p50"] == 4.5
    assert s["time_to_ready_s"] == 0.8  # the slowest decode rank
    text = table([s])
    assert "first request / steady p50" in text and "90.0 / 20.0 ms (4.50x per byte)" in text
    assert "time to ready (decode)" in text and "800 ms" in text


def test_the_ratio_compares_time_per_byte_since_requests_differ_in_size():
    """A first request twice the size of the others, taking twice as long, is not cold."""
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=3)
    rooms = {1: _room(1.0, 40.0, mib=2), 2: _room(2.0, 20.0), 3: _room(3.0, 20.0)}
    result = SessionResult(SessionConfig(w), 3.0, {}, {(0, 0): {"results": rooms}}, [])
    s = summarize(result)
    assert (s["first_request_ms"], s["steady_p50_ms"]) == (40.0, 20.0)
    assert s["first_vs_steady_p50"] == 1.0


def test_a_session_with_one_request_has_no_steady_state():
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=1)
    result = SessionResult(
        SessionConfig(w), 1.0, {}, {(0, 0): {"results": {7: _room(1.0, 50.0)}}}, []
    )
    s = summarize(result)
    assert (s["first_request_ms"], s["steady_p50_ms"], s["first_vs_steady_p50"]) == (50.0, 0.0, 0.0)
    row = next(line for line in table([s]).splitlines() if line.startswith("time to ready"))
    assert s["time_to_ready_s"] is None and row.split()[-1] == "-"


def test_a_transfer_is_timed_from_when_both_sides_are_ready():
    """A prefill that makes its sender (ends its forward pass) after the decode's request
    arrived: the wait for it is kept apart, not counted as transfer time; a prefill already
    waiting changes nothing."""
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=2)
    decode = {(0, 0): {"results": {1: _room(10.0, 600.0), 2: _room(20.0, 30.0)}}}
    prefill = {
        (0, 0): {
            "results": {
                1: {"ok": True, "open_wall": 10.5, "send_wall": 10.502},
                2: {"open_wall": 19.0, "send_wall": 20.001},
            }
        }
    }
    rooms = SessionResult(SessionConfig(w), 30.0, prefill, decode, []).decode_results()
    assert round(rooms[1]["latency_s"], 6) == 0.1 and round(rooms[1]["prefill_late_s"], 6) == 0.5
    assert rooms[2]["latency_s"] == 0.03 and "prefill_late_s" not in rooms[2]


def test_the_wait_for_our_set_up_counts_though_the_prefill_sees_the_request_late():
    """The prefill's sender was made before the decode's request, but the prefill saw the
    request (WaitingForInput) 40 ms after it: the request crossing over, a fresh pair's
    set-up (registration, link, warm-up) and the room's filing are the backend's time and
    count (before, the 40 ms were subtracted as the prefill's lateness, and a first room
    of a fresh pair reported a fraction of what its user waited)."""
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=2)
    decode = {(0, 0): {"results": {1: _room(10.0, 60.0), 2: _room(20.0, 15.0)}}}
    prefill = {
        (0, 0): {
            "results": {
                1: {"ok": True, "open_wall": 9.9, "send_wall": 10.04},
                2: {"ok": True, "open_wall": 19.99, "send_wall": 20.0003},
            }
        }
    }
    rooms = SessionResult(SessionConfig(w), 30.0, prefill, decode, []).decode_results()
    assert rooms[1]["latency_s"] == 0.06 and "prefill_late_s" not in rooms[1]
    assert rooms[2]["latency_s"] == 0.015 and "prefill_late_s" not in rooms[2]


def test_the_first_request_is_clocked_from_the_decodes_request_handshake_included():
    """As a user sees it: a fresh pair's first request waits for the bootstrap query, the
    registration, the link and the warm-up before its transfer; that wait counts."""
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=3)
    first = {**_room(1.0, 10.0), "handshake_s": 0.06}
    rooms = {1: first, 2: _room(2.0, 10.0), 3: _room(3.0, 10.0)}
    result = SessionResult(SessionConfig(w), 3.0, {}, {(0, 0): {"results": rooms}}, [])
    s = summarize(result)
    got = (s["first_request_ms"], s["handshake_ms"], s["steady_p50_ms"], s["first_vs_steady_p50"])
    assert got == pytest.approx((70.0, 60.0, 10.0, 7.0))
    assert (s["first_after_handshake_ms"], s["first_after_handshake_vs_steady_p50"]) == (10.0, 1.0)
    text = table([s])
    assert "70.0 / 10.0 ms (7.00x per byte)" in text
    assert "of which handshake" in text and "60.0 ms (after it: 10.0 ms, 1.00x)" in text


def test_the_cpu_of_a_session_is_every_ranks_or_unknown():
    w = Workload(PRESETS["tiny"], requests=2)
    prefill = {(0, 0): {"results": {}, "cpu_s": 0.5}, (0, 1): {"results": {}, "cpu_s": 0.25}}
    decode = {(0, 0): {"results": {}, "cpu_s": 1.0}}
    assert SessionResult(SessionConfig(w), 3.0, prefill, decode, []).cpu_s() == 1.75
    decode[(0, 1)] = {"error": "Traceback ..."}  # a rank that did not say
    assert SessionResult(SessionConfig(w), 3.0, prefill, decode, []).cpu_s() is None


def test_the_table_gives_cpu_per_request_and_how_much_less_ours_takes():
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=4)
    rooms = {i: _room(float(i), 10.0) for i in range(1, 5)}

    def summary(backend: str, cpu_s: float | None) -> dict:
        decode = {(0, 0): {"results": rooms, "cpu_s": cpu_s}}
        prefill = {(0, 0): {"results": {}, "cpu_s": 0.0 if cpu_s is not None else None}}
        return summarize(SessionResult(SessionConfig(w, backend=backend), 3.0, prefill, decode, []))

    ours, theirs = summary("plugin", 0.02), summary("in-tree", 0.05)
    assert ours["cpu_ms_per_request"] == 5.0 and theirs["cpu_ms_per_request"] == 12.5
    row = next(r for r in table([ours, theirs]).splitlines() if r.startswith("CPU per request"))
    assert row.split()[-6:] == ["5.0", "ms", "12.5", "ms", "2.50x", "less"], row
    old = summary("plugin", None)  # a tree whose ranks do not report their CPU
    assert old["cpu_ms_per_request"] is None
    assert next(r for r in table([old]).splitlines() if r.startswith("CPU")).split()[-1] == "-"


def test_the_first_requests_steps_are_reported_from_both_sides_stamps():
    """``first_request_steps_ms``: where the first request's time went, on the machine's
    one clock, from the decode's request; the earliest prefill rank for each step."""
    w = Workload(shape=PRESETS["tiny"], page_size=16, requests=2)
    first = {**_room(1.0, 30.0), "stamps": {"request_at": 100.0}}
    first["timeline"] = {"requested_at": 100.0, "applied_at": 100.030, "status_ms": 3.0}
    rooms = {5: first, 6: {**_room(2.0, 10.0), "stamps": {"request_at": 200.0}}}
    prefill = {
        (0, 0): {"results": {5: {"timeline": {"started_at": 100.006, "ended_at": 100.029}}}},
        (0, 1): {"results": {5: {"timeline": {"started_at": 100.004, "ended_at": 100.028}}}},
    }
    result = SessionResult(SessionConfig(w), 3.0, prefill, {(0, 0): {"results": rooms}}, [])
    steps = summarize(result)["first_request_steps_ms"]
    assert list(steps) == [
        "decode.requested", "prefill.started", "prefill.ended", "decode.applied",
    ]  # fmt: skip
    assert steps["decode.requested"] == 0.0
    assert steps["prefill.started"] == pytest.approx(4.0)  # rank 1's, the earlier
    assert steps["prefill.ended"] == pytest.approx(28.0)
    assert steps["decode.applied"] == pytest.approx(30.0)
    no_stamps = SessionResult(
        SessionConfig(w), 3.0, {}, {(0, 0): {"results": {1: _room(1.0, 5.0)}}}, []
    )
    assert summarize(no_stamps)["first_request_steps_ms"] == {}
