"""Run PD sessions (``sgl_nixl_plugin.bench``) from tests and check what they report.

``run_pd`` starts a session with a hermetic environment (the rank processes are spawned,
so they inherit ``os.environ``: variables that change which plugins SGLang loads are
removed for the duration of the session). ``session_problems`` lists every way a session
fell short of "every request arrived byte-exact and every per-room table drained", so a
test can ``assert not problems`` and still print everything that went wrong at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from helpers.subproc import _SCRUBBED
from sgl_nixl_plugin.bench.session import SessionConfig, SessionResult, run_session
from sgl_nixl_plugin.bench.workload import PRESETS, ModelShape, Workload

#: Session deadline; ``Session.wait`` allows another 60 s, which stays under the tests'
#: 180 s pytest timeout so a stuck session fails with its own message, not a pytest kill.
SESSION_TIMEOUT_S = 110.0

#: Extra environment of every rank. These tests check the data path, not failure detection
#: (other tests cover liveness), and CI hosts are often overloaded: a prefill can advertise
#: itself on the bootstrap server seconds before its control thread answers pings (see
#: NixlPluginKVManager.__init__), which a loaded host stretches past the 5 s default.
#: A long liveness deadline keeps that from failing rooms here; a dead rank still shows up
#: as a failed or timed-out room.
E2E_ENV = {
    "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "1.0",
    "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "30",
}


@contextmanager
def hermetic_environ() -> Iterator[None]:
    """Remove plugin-affecting variables from ``os.environ`` while ranks are spawned."""
    saved = {k: os.environ.pop(k) for k in _SCRUBBED if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def workload(
    shape: str,
    page_size: int,
    requests: int = 14,
    *,
    min_tokens: int = 16,
    max_tokens: int = 160,
    concurrency: int = 6,
    chunks: tuple[int, ...] = (1, 1, 3, 3),
    chunk_gap_ms: float = 0.0,
    send_delays_ms: tuple[float, ...] = (0.0,),
    fragmentation: str = "mixed",
    state: bool = True,
    host_every: int = 0,
    decode_page_size: int = 0,
    state_kind: str = "mamba",
) -> Workload:
    """A small workload. The default ``chunks`` cycles with period 4 while ``mixed``
    alternates with period 2, so every (chunks, contiguous) combination occurs."""
    return Workload(
        PRESETS[shape],
        page_size=page_size,
        requests=requests,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        concurrency=concurrency,
        chunks=chunks,
        chunk_gap_ms=chunk_gap_ms,
        send_delays_ms=send_delays_ms,
        fragmentation=fragmentation,
        state=state,
        host_every=host_every,
        decode_page_size=decode_page_size,
        state_kind=state_kind,
    )


def run_pd(w: Workload, **kwargs: Any) -> SessionResult:
    kwargs.setdefault("timeout_s", SESSION_TIMEOUT_S)
    kwargs["env"] = {**E2E_ENV, **kwargs.get("env", {})}
    with hermetic_environ():
        return run_session(SessionConfig(w, **kwargs))


def expected_bytes(cfg: SessionConfig, pages: int) -> int:
    """KV bytes a room lands summed over the decode ranks that receive it, the attention TP
    ranks of one attention DP group (MLA is replicated per rank)."""
    w = cfg.workload
    attn_tp = cfg.decode_tp // cfg.decode_dp
    return pages * w.page_size_of("decode") * w.shape.token_bytes(attn_tp) * attn_tp


def room_tables(tables: dict[str, int]) -> dict[str, int]:
    """The per-room tables of a rank (``nixl.*`` counts engine resources, ``count.*`` events)."""
    return {k: v for k, v in tables.items() if not k.startswith(("nixl.", "count."))}


def leaked_tables(res: SessionResult) -> dict[str, dict[str, int]]:
    """``{"prefill0.1": {"table": size}}`` for every rank whose per-room tables are not empty
    or that still holds live NIXL transfer handles."""
    out: dict[str, dict[str, int]] = {}
    for role, ranks in (("prefill", res.prefill), ("decode", res.decode)):
        for (inst, rank), r in sorted(ranks.items()):
            tables = r.get("tables", {})
            bad = {k: v for k, v in room_tables(tables).items() if v}
            if tables.get("nixl.xfer"):
                bad["nixl.xfer"] = tables["nixl.xfer"]
            if bad:
                out[f"{role}{inst}.{rank}"] = bad
    return out


def session_problems(res: SessionResult, *, check_tables: bool = True) -> list[str]:
    """Everything that is not "all requests ok, byte-exact, nothing left behind"."""
    problems: list[str] = [f"rank error: {e}" for e in res.errors]
    problems += _rank_problems(res)
    problems += _room_set_problems(res)
    problems += _decode_room_problems(res)
    if check_tables:
        problems += [
            f"{rank}: per-room state left behind: {t}" for rank, t in leaked_tables(res).items()
        ]
    return problems


def _rank_problems(res: SessionResult) -> list[str]:
    """Every rank reported, ran the backend asked for, and finished its rooms."""
    cfg = res.config
    problems: list[str] = []
    ranks = {("prefill", i, r) for i in range(cfg.n_prefill) for r in range(cfg.ranks("prefill"))}
    ranks |= {("decode", i, r) for i in range(cfg.n_decode) for r in range(cfg.ranks("decode"))}
    got = {("prefill", *k) for k in res.prefill} | {("decode", *k) for k in res.decode}
    problems += [f"no result from {k}" for k in sorted(ranks - got)]

    # Which backend really ran: only our manager exposes its NIXL engine (``nixl.*``).
    for key, r in {**res.prefill, **res.decode}.items():
        has_engine = any(k.startswith("nixl.") for k in r.get("tables", {}))
        if has_engine != (cfg.backend == "plugin"):
            problems.append(f"rank {key} did not run the {cfg.backend} backend: {r.get('tables')}")

    for role, ranks_ in (("prefill", res.prefill), ("decode", res.decode)):
        for (inst, rank), r in sorted(ranks_.items()):
            if r.get("timed_out"):
                problems.append(f"{role}{inst}.{rank}: {len(r['timed_out'])} rooms not finished")
            if r.get("host_pages_held"):
                problems.append(
                    f"{role}{inst}.{rank}: host pages of failed rooms never released: "
                    f"{r['host_pages_held']}"
                )
    return problems


def _room_set_problems(res: SessionResult) -> list[str]:
    """Prefill: each rank of instance i sends rooms i, i + n_prefill, ... (with DP
    attention, those of its DP group); a decode rank receives its rooms only."""
    cfg = res.config
    problems: list[str] = []
    for (inst, rank), r in sorted(res.decode.items()):
        got_rooms = set(r.get("results", {})) | set(r.get("timed_out", []))
        if "error" not in r and got_rooms != cfg.rooms_of("decode", inst, rank):
            problems.append(f"decode{inst}.{rank}: rooms other than its own: {len(got_rooms)}")
    for (inst, rank), r in sorted(res.prefill.items()):
        mine = cfg.rooms_of("prefill", inst, rank)
        results = r.get("results", {})
        if set(results) != mine:
            problems.append(f"prefill{inst}.{rank}: {len(results)} results for {len(mine)} rooms")
        bad = {room: x.get("reason") for room, x in results.items() if not x["ok"]}
        if bad:
            problems.append(
                f"prefill{inst}.{rank}: {len(bad)} rooms failed, e.g. {next(iter(bad.values()))}"
            )
    return problems


def _decode_room_problems(res: SessionResult) -> list[str]:
    """Decode: every room, merged over the decode TP ranks of its instance."""
    cfg = res.config
    w = cfg.workload
    reqs = w.make_requests()
    problems: list[str] = []
    dr = res.decode_results()
    missing = [q.room for q in reqs if q.room not in dr]
    if missing:
        problems.append(f"decode: no result for {len(missing)} of {len(reqs)} rooms")
    for q in reqs:
        d = dr.get(q.room)
        if d is None:
            continue
        if not d["ok"]:
            problems.append(f"room {q.room}: failed on decode: {d.get('reason')!r}")
            continue
        if bool(d.get("host")) != q.host:
            problems.append(f"room {q.room}: host={d.get('host')!r}, asked for {q.host}")
        for k in ("bad_pages", "bad_aux") + (("bad_state",) if q.with_state else ()):
            if k not in d:
                problems.append(f"room {q.room}: decode did not verify ({k} missing)")
            elif d[k]:
                problems.append(
                    f"room {q.room}: {k}={d[k]} (tokens={q.tokens}, chunks={q.chunks}, contiguous={q.contiguous})"
                )
        want = expected_bytes(cfg, q.pages(w.page_size_of("decode")))
        if not d.get("bytes") or d["bytes"] != want:
            problems.append(f"room {q.room}: bytes={d.get('bytes')} expected {want}")
    return problems


def timeline_problems(res: SessionResult, staged: bool = False) -> list[str]:
    """Each room's stamps, from both sides' events, on the one clock of the machine: the
    decode's ``ReceiveEvent`` came with its absolute stamps, in order, and the prefill's
    first WRITE went out before the decode received the status, which it did before its
    bench loop saw Success (prefill ``TransferEvent.timeline`` and decode ``ReceiveEvent``
    stamps, as the bench drivers report them). ``staged``: every room came in staged
    pieces, whose stamps the decode's event must carry too."""
    problems: list[str] = []
    first_post: dict[int, float] = {}
    for key, rank in res.prefill.items():
        for room, r in rank.get("results", {}).items():
            t = r.get("timeline", {})
            if r["ok"] and not {"started_at", "ended_at"} <= set(t):
                problems.append(f"prefill {key} room {room}: no absolute stamps in {t}")
            if "first_post_at" in t:  # a rank with nothing to send (MLA's extra) has none
                first_post[room] = min(first_post.get(room, t["first_post_at"]), t["first_post_at"])
    for key, rank in res.decode.items():
        for room, r in rank.get("results", {}).items():
            if not r["ok"]:
                continue
            t, seen = r.get("timeline", {}), r["stamps"]["end_seen_at"]
            need = ("requested_at", "status_at", "applied_at", "ended_at")
            if staged:
                need += ("first_piece_at", "last_piece_at", "scattered_at")
            if not set(need) <= set(t):
                problems.append(f"decode {key} room {room}: ReceiveEvent stamps {sorted(t)}")
                continue
            order = [
                first_post.get(room, 0.0),
                t["status_at"],
                t["applied_at"],
                seen,
                t["ended_at"],
            ]
            if room not in first_post or order != sorted(order):
                problems.append(
                    f"room {room}: prefill first WRITE, decode status received, applied, "
                    f"Success seen, cleared out of order: {order}"
                )
            if "first_piece_at" in t and not (
                t["requested_at"]
                <= t["first_piece_at"]
                <= t["last_piece_at"]
                <= t["scattered_at"]
                <= t["applied_at"]
            ):
                problems.append(f"decode {key} room {room}: piece stamps out of order: {t}")
    return problems


def describe(res: SessionResult) -> str:
    """One line about the session for failure messages and logs."""
    c = res.config
    w = c.workload
    return (
        f"{c.backend} {w.shape.name} TP {c.prefill_tp}->{c.decode_tp} "
        f"PP {c.prefill_pp}->{c.decode_pp} DP {c.prefill_dp}->{c.decode_dp} "
        f"P{c.n_prefill}xD{c.n_decode} page_size={w.page_size} requests={w.requests} "
        f"wall={res.wall_s:.1f}s"
    )


def assert_clean(res: SessionResult, *, check_tables: bool = True) -> None:
    problems = session_problems(res, check_tables=check_tables)
    assert not problems, describe(res) + "\n" + "\n".join(problems[:40])


#: Decode aborts wait for the prefills' ABORT_ACKs before the pages go back (SGLang's
#: deferred KV release), the rule ``abort_workload``'s checks rely on.
ABORT_ENV = {"SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE": "1"}


def abort_workload(shape: ModelShape, **kw) -> Workload:
    return Workload(
        shape,
        page_size=16,
        requests=kw.pop("requests", 24),
        min_tokens=kw.pop("min_tokens", 1024),
        max_tokens=kw.pop("max_tokens", 2048),
        concurrency=6,
        state=False,
        abort_every=3,
        abort_within_ms=kw.pop("abort_within_ms", 8.0),
        **kw,
    )


def assert_aborts_fenced(res: SessionResult) -> dict[str, int]:
    """Aborted rooms untouched after their ACK, the others byte-exact, nothing left over;
    returns counts for the test's report."""
    assert not res.errors, res.errors
    for role, ranks in (("prefill", res.prefill), ("decode", res.decode)):
        for key, r in ranks.items():
            assert not r.get("timed_out"), f"{role}{key}: rooms not finished {r['timed_out']}"
    rooms = res.decode_results()
    aborted = {k: v for k, v in rooms.items() if v.get("aborted")}
    others = {k: v for k, v in rooms.items() if not v.get("aborted")}
    assert aborted, "no room was aborted before it finished"
    written = {k: v.get("written_after_ack") for k, v in aborted.items()}
    assert set(written.values()) == {0}, f"pages written after the ABORT_ACK: {written}"
    bad = {k: (v.get("reason"), v.get("bad_pages")) for k, v in others.items() if not v["ok"]}
    assert not bad, bad
    assert not any(v.get("bad_pages") for v in others.values())
    return {"aborted": len(aborted), "finished": len(others)}
