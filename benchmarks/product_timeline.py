"""Where one request's time goes through the product path, both processes on one clock.

``sgl-nixl-plugin bench`` reports a request's latency from the moment both sides are ready
(the prefill's sender saw WaitingForInput) to the moment the decode's poll loop sees
Success. ``benchmarks/bench_staging.py`` (row "ours", the engine path) times the same
staged pipeline from the first gather to the receiver's last "scattered" reply. This
script runs the product's session (``sgl_nixl_plugin.bench.session``, SGLang's real
classes, our plugin) with probes that record absolute ``time.perf_counter`` stamps
(CLOCK_MONOTONIC: one clock for every process of the machine) at each step of each room,
on both sides, and prints per step the median over the steady rooms (the first room of
the fresh pair is left out), so the two figures can be put side by side step by step:

    prefill bench sees WaitingForInput (the product's clock starts)
      -> SGLang sender init()+send() return -> the transfer worker claims the chunk
      -> first gather (source index upload) -> first WRITE posted -> last WRITE done
    decode: PieceReady received -> scatter launched -> scattered (PieceDone)
      -> TransferStatus received -> applied behind the scatters
      -> the bench's decode poll loop sees Success (the product's clock stops)

The probes only wrap methods (no product file changes) and keep their stamps in memory;
each rank process writes them to ``--out`` when it ends. ``--poll-wait-us`` sets the longest
wait of the bench's poll loops between polls (500 us; 0 spins), ``--no-bell`` makes them
sleep that long without waking on a status change (the loops before the bell), to measure
what the loop itself costs. ``--switch-interval-us`` sets the rank processes' GIL switch
interval (Python's default is 5 ms), to see what the threads' wait for the GIL costs.
A rank still running after ``--stack-dump-s`` seconds prints every thread's stack to its
stderr (a stalled run says where it waits).

On the one-pass path (CUDA IPC) there are no pieces: the prefill rows are the worker's
launch (``_one_pass`` entered and returned) and the first poll that saw the copy's event
complete.

    python3 benchmarks/product_timeline.py --mem VRAM --page-size 16 --requests 24 \
        --min-tokens 4096 --max-tokens 8192 --concurrency 1 --no-verify --label p16_c1

Every other argument is ``sgl-nixl-plugin bench``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_REPO = Path(__file__).resolve().parent.parent
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # the tree's package, before any installed wheel

import numpy as np  # noqa: E402

EV: list[tuple[str, int, Any, float]] = []  # (kind, room, detail, perf_counter)
_now = time.perf_counter
TRACES: dict[int, list[Any]] = {}  # room -> its staged jobs' trace lists
POLL_NAMES: dict[int, str] = {}  # SGLang's KVPoll is a class of int constants, not an enum


def _name(s: Any) -> str:
    return POLL_NAMES.get(s, str(s)) if isinstance(s, int) else getattr(s, "name", str(s))


def _ev(kind: str, room: Any, detail: Any = None, t: float | None = None) -> None:
    EV.append((kind, int(room) if room is not None else -1, detail, _now() if t is None else t))


# ----------------------------------------------------------------------- probes (children)
def _wrap_sender(base: type) -> type:
    class ProbedSender(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            self._pr_room = kw.get("bootstrap_room", -1)
            self._pr_last = None
            super().__init__(*a, **kw)
            _ev("p_sender_made", self._pr_room)

        def poll(self) -> Any:
            s = super().poll()
            if s != self._pr_last:
                self._pr_last = s
                _ev("p_poll", self._pr_room, _name(s))
            return s

        def init(self, *a: Any, **kw: Any) -> Any:
            _ev("p_init0", self._pr_room)
            out = super().init(*a, **kw)
            _ev("p_init1", self._pr_room)
            return out

        def send(self, *a: Any, **kw: Any) -> Any:
            _ev("p_send0", self._pr_room)
            out = super().send(*a, **kw)
            _ev("p_send1", self._pr_room)
            return out

    ProbedSender.__name__ = base.__name__
    return ProbedSender


def _wrap_receiver(base: type) -> type:
    class ProbedReceiver(base):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            self._pr_room = kw.get("bootstrap_room", -1)
            self._pr_last = None
            super().__init__(*a, **kw)

        def poll(self) -> Any:
            s = super().poll()
            if s != self._pr_last:
                self._pr_last = s
                _ev("d_poll", self._pr_room, _name(s))
            return s

        def send_metadata(self, *a: Any, **kw: Any) -> Any:
            _ev("d_meta0", self._pr_room)
            out = super().send_metadata(*a, **kw)
            _ev("d_meta1", self._pr_room)
            return out

    ProbedReceiver.__name__ = base.__name__
    return ProbedReceiver


def _patch(cls: type, name: str, before: Any = None, after: Any = None) -> None:
    real = getattr(cls, name)

    def wrapped(self: Any, *a: Any, **kw: Any) -> Any:
        if before is not None:
            try:
                before(self, *a, **kw)
            except Exception:
                pass
        out = real(self, *a, **kw)
        if after is not None:
            try:
                after(self, out, *a, **kw)
            except Exception:
                pass
        return out

    setattr(cls, name, wrapped)


def _install(role: str, poll_wait_us: float, bell: bool) -> None:
    import sgl_nixl_plugin.bench.driver as R
    from sgl_nixl_plugin.adapter import harness

    wait_s = poll_wait_us * 1e-6
    R.StatusBell.WAIT_S = wait_s  # the longest wait between two polls
    if not bell:  # the loops as they were before the bell: a plain sleep between polls

        class Sleeper:
            def __init__(self, mgr: Any) -> None:
                pass

            def wait(self, timeout_s: float | None = None) -> None:
                time.sleep(wait_s if timeout_s is None else timeout_s)

        R.StatusBell = Sleeper  # type: ignore[misc, assignment]

    real_boot = harness.boot

    def boot(**kw: Any) -> Any:
        sa, classes = real_boot(**kw)
        classes = dict(classes)
        classes["sender"] = _wrap_sender(classes["sender"])
        classes["receiver"] = _wrap_receiver(classes["receiver"])
        return sa, classes

    harness.boot = boot
    kv_poll = harness.kv_poll()
    POLL_NAMES.update(
        {
            int(v): k
            for k, v in vars(kv_poll).items()
            if not k.startswith("_") and isinstance(v, int)
        }
    )
    if role == "prefill":
        from sgl_nixl_plugin.engine.staging import StagedSend
        from sgl_nixl_plugin.sides.context import PrefillContext
        from sgl_nixl_plugin.sides.prefill_control import PrefillControl

        real_init = StagedSend.__init__

        def init(self: Any, *a: Any, **kw: Any) -> None:
            real_init(self, *a, **kw)
            if self.trace is None:
                self.trace = []

        StagedSend.__init__ = init  # type: ignore[method-assign]
        from sgl_nixl_plugin.sides.transfer_worker import TransferWorker

        def keep_traces(self: Any, rec: Any, *a: Any, **kw: Any) -> None:
            # the worker drops a room's finished jobs before the room ends: keep their traces
            kept = TRACES.setdefault(rec.room, [])
            for job in rec.jobs:
                tr = job.send.trace
                if tr is not None and not any(tr is k for k in kept):
                    kept.append(tr)

        _patch(TransferWorker, "_step_jobs", before=keep_traces)

        from sgl_nixl_plugin.engine.one_pass import KernelXfer

        kernel_rooms: dict[int, int] = {}  # id(KernelXfer) -> room

        entered: dict[int, float] = {}  # room -> when the worker entered ``_one_pass``

        def one_pass_in(self: Any, rec: Any, *a: Any, **kw: Any) -> None:
            entered[rec.room] = _now()
            current["room"] = rec.room

        def one_pass_out(self: Any, out: Any, rec: Any, *a: Any, **kw: Any) -> None:
            t0 = entered.pop(rec.room, None)
            if out is not None:  # it launched (None: the chunk takes another path)
                kernel_rooms[id(out)] = rec.room
                _ev("p_op_launch0", rec.room, t=t0)
                _ev("p_op_launch1", rec.room)

        _patch(TransferWorker, "_one_pass", before=one_pass_in, after=one_pass_out)

        def tail_in(self: Any, rec: Any, *a: Any, **kw: Any) -> None:
            _ev("p_tail0", rec.room)

        def tail_out(self: Any, out: Any, rec: Any, *a: Any, **kw: Any) -> None:
            _ev("p_tail1", rec.room)

        _patch(TransferWorker, "_post_tail", before=tail_in, after=tail_out)  # aux, state

        def kernel_polled(self: Any, out: Any, *a: Any, **kw: Any) -> None:
            room = kernel_rooms.get(id(self))
            if room is not None and out != "PROC":
                del kernel_rooms[id(self)]
                _ev("p_op_done", room, out)

        _patch(KernelXfer, "poll", after=kernel_polled)

        # completion flags: when the worker queued them (the aux rows and state landed)
        flags_before: dict[int, int] = {}

        def flags_in(self: Any, rec: Any, *a: Any, **kw: Any) -> None:
            flags_before[rec.room] = len(rec.flags_due)

        def flags_out(self: Any, out: Any, rec: Any, *a: Any, **kw: Any) -> None:
            if flags_before.pop(rec.room, 0) and not rec.flags_due:
                _ev("p_flag_queued", rec.room)

        _patch(TransferWorker, "_store_flags", before=flags_in, after=flags_out)

        # the launch's host steps, stamped with the room the worker is launching for
        current: dict[str, int] = {"room": -1}
        import sgl_nixl_plugin.engine.one_pass as one_pass_mod
        from sgl_nixl_plugin.engine.copy_triton import TritonCopier

        def stamp(step: str) -> Any:
            return lambda *a, **kw: _ev("p_op_step", current["room"], step)

        for name in ("prepare_units", "prepare_bases", "pair_copy", "release_units"):
            _patch(TritonCopier, name, before=stamp(f"{name}0"), after=stamp(f"{name}1"))
        from sgl_nixl_plugin.engine.copy_triton_fast_launch import _FastLaunch

        def fast_taken(self: Any, out: Any, kind: str, *a: Any, **kw: Any) -> None:
            if kind == "pair":  # rows "fast pair launch: taken" / "not taken" count the rooms
                _ev("p_op_step", current["room"], f"fast_{bool(out)}")

        _patch(_FastLaunch, "launch", after=fast_taken)
        real_units = one_pass_mod.unit_indices_of

        def unit_indices_of(*a: Any, **kw: Any) -> Any:
            stamp("unit_indices0")()
            out = real_units(*a, **kw)
            stamp("unit_indices1")()
            return out

        one_pass_mod.unit_indices_of = unit_indices_of
        from sgl_nixl_plugin.adapter.manager import NixlPluginKVManager

        _patch(
            NixlPluginKVManager,
            "_encode_kv_status_message",
            before=lambda self, *a, **kw: _ev("p_status_enc", kw.get("bootstrap_room", -1)),
        )

        def status_sent(self: Any, out: Any, *a: Any, **kw: Any) -> None:
            _ev("p_status_sent", kw.get("bootstrap_room", -1))

        _patch(NixlPluginKVManager, "send_kv_status_message", after=status_sent)

        def on_msg(self: Any, msg: Any, *a: Any, **kw: Any) -> None:
            _ev("p_rx", getattr(msg, "room", -1), type(msg).__name__)

        _patch(PrefillControl, "_dispatch", before=on_msg)

        def on_observe(self: Any, rec: Any, ok: bool, *a: Any, **kw: Any) -> None:
            t = _now()
            marks = {
                "started": rec.started,
                "ready_at": rec.ready_at,
                "claimed_at": rec.claimed_at,
                "first_post_at": rec.first_post_at,
                "ended": t,
            }
            trace = []
            for tr in TRACES.pop(rec.room, []):
                trace += [(i, step, ts) for i, step, ts in tr]
            _ev("p_room", rec.room, {"ok": ok, "bytes": rec.nbytes, "marks": marks,
                                     "trace": trace, "path": rec.path}, t)  # fmt: skip

        _patch(PrefillContext, "observe", before=on_observe)
    elif role == "decode":
        from sgl_nixl_plugin.engine.scatter_queue import ScatterQueue
        from sgl_nixl_plugin.sides.decode_listener import DecodeListener
        from sgl_nixl_plugin.sides.decode_side import DecodeSide
        from sgl_nixl_plugin.sides.decode_staging import DecodeStaging

        frames_at = {"t": 0.0}  # when the listener took the frames being handled

        def on_msg(self: Any, msg: Any, *a: Any, **kw: Any) -> None:
            room, kind = getattr(msg, "room", -1), type(msg).__name__
            _ev("d_frames", room, kind, frames_at["t"])
            _ev("d_rx", room, kind)

        _patch(DecodeListener, "_dispatch", before=on_msg)
        _patch(DecodeListener, "on_frames", before=lambda *a, **kw: frames_at.update(t=_now()))
        _patch(
            DecodeStaging,
            "_launch",
            before=lambda self, m, *a, **kw: _ev("d_launch0", m.room, m.seq),
            after=lambda self, out, m, *a, **kw: _ev("d_launch1", m.room, m.seq),
        )

        def on_out(self: Any, out: Any, *a: Any, **kw: Any) -> None:
            t = _now()
            for tok in out:
                _ev("d_out", getattr(tok, "room", -1), type(tok).__name__, t)

        _patch(ScatterQueue, "wait", after=on_out)

        def on_close(self: Any, room: int, ok: bool, *a: Any, **kw: Any) -> None:
            rec = self.ctx.rooms.get(room)
            if rec is not None:
                _ev("d_room", room, {"ok": ok, "times": dict(rec.times)})

        _patch(DecodeSide, "close_room", before=on_close)
        due_before: dict[int, int] = {}

        def check_in(self: Any, room: int, *a: Any, **kw: Any) -> None:
            rec = self.ctx.rooms.get(room)
            due_before[room] = len(rec.flags_due) if rec is not None else 0

        def check_out(self: Any, out: Any, room: int, *a: Any, **kw: Any) -> None:
            rec = self.ctx.rooms.get(room)
            if rec is not None and len(rec.flags_due) < due_before.pop(room, 0):
                _ev("d_flag_seen", room)

        _patch(DecodeSide, "check_flags", before=check_in, after=check_out)


def _probed_rank(spec: Any, out: Any, done: Any, release: Any, opts: dict[str, Any]) -> None:
    """A rank process (as ``session._rank_process``) with the probes installed."""
    import faulthandler

    from sgl_nixl_plugin.bench.rank import rank_main

    faulthandler.dump_traceback_later(opts["stack_dump_s"], exit=False)
    if opts["switch_us"]:  # how long a thread waits for the GIL before asking for it
        sys.setswitchinterval(opts["switch_us"] * 1e-6)
    try:
        _install(spec.role, opts["poll_wait_us"], opts["bell"])
    except Exception as exc:  # a probe must never stop the run
        print(f"[product_timeline] probes not installed: {exc!r}", file=sys.stderr)
    try:
        rank_main(spec, out, done, release)
    finally:
        path = Path(opts["out"]) / f"{spec.role}{spec.instance}.{spec.tp_rank}.{os.getpid()}.json"
        try:
            path.write_text(json.dumps({"role": spec.role, "events": list(EV)}, default=float))
        except Exception as exc:
            print(f"[product_timeline] could not write {path}: {exc!r}", file=sys.stderr)
    out.close()
    out.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------- analysis (parent)
STEPS = [  # (label, side, how to find it): medians over steady rooms, ms after T0
    ("decode request sent (send_metadata returned)", "d_meta1"),
    ("prefill control: TransferRequest received", "p_rx:TransferRequest"),
    ("prefill room ready (destinations filed)", "m:ready_at"),
    ("T0 prefill bench sees WaitingForInput", "p_poll:WaitingForInput"),
    ("prefill bench: init()+send() returned", "p_send1"),
    ("worker claimed the chunk", "m:claimed_at"),
    ("one pass: worker enters the launch", "p_op_launch0"),
    ("one pass: source units computed", "p_op_step:first:unit_indices1"),
    ("one pass: destination units computed", "p_op_step:last:unit_indices1"),
    ("one pass: units prepared (both)", "p_op_step:last:prepare_units1"),
    ("one pass: bases prepared (both)", "p_op_step:last:prepare_bases1"),
    ("one pass: pair_copy entered", "p_op_step:first:pair_copy0"),
    ("one pass: pair_copy returned", "p_op_step:first:pair_copy1"),
    ("one pass: fast pair launch taken (n = rooms)", "p_op_step:first:fast_True"),
    ("one pass: fast pair launch not taken (n = rooms)", "p_op_step:first:fast_False"),
    ("one pass: units released", "p_op_step:last:release_units1"),
    ("one pass: launch returned", "p_op_launch1"),
    ("aux and state WRITEs: posting begins", "p_tail0"),
    ("aux and state WRITEs: posted", "p_tail1"),
    ("one pass: completion flag queued (aux, state landed)", "p_flag_queued"),
    ("one pass: copy seen done (event)", "p_op_done:DONE"),
    ("decode: completion flag seen", "d_flag_seen"),
    ("first gather: index upload begins", "tr:first gather"),
    ("indices ready (uploaded)", "tr:indices ready"),
    ("first gather launched", "tr:first:gather launched"),
    ("first gather done (event seen)", "tr:first:gather done"),
    ("first WRITE posted", "tr:first:write posted"),
    ("first WRITE done", "tr:first:write done"),
    ("decode: first PieceReady received", "d_rx:first:PieceReady"),
    ("decode: first scatter launched", "d_launch1:first"),
    ("decode: first piece scattered", "d_out:first:PieceReady"),
    ("prefill: first PieceDone received", "p_rx:first:PieceDone"),
    ("last gather launched", "tr:last:gather launched"),
    ("last WRITE posted", "tr:last:write posted"),
    ("last WRITE done", "tr:last:write done"),
    ("decode: last PieceReady received", "d_rx:last:PieceReady"),
    ("decode: last piece scattered", "d_out:last:PieceReady"),
    ("prefill room observed (its status went out before)", "m:ended"),
    ("prefill: status encoded (sent next)", "p_status_enc"),
    ("prefill: status handed to ZMQ", "p_status_sent"),
    ("decode: listener took the status frames", "d_frames:TransferStatus"),
    ("decode: TransferStatus received", "d_rx:TransferStatus"),
    ("decode: status applied (behind scatters)", "d_out:TransferStatus"),
    ("T1 decode bench sees Success", "d_poll:Success"),
    ("prefill bench sees Success", "p_poll:Success"),
]


def _rooms(events: list[tuple[str, int, Any, float]]) -> dict[int, dict[str, Any]]:
    rooms: dict[int, dict[str, Any]] = {}
    for kind, room, detail, t in sorted(events, key=lambda e: e[3]):
        r = rooms.setdefault(room, {"multi": {}})
        if kind == "p_room":
            r["bytes"] = detail["bytes"]
            r["path"] = detail["path"]
            for k, v in detail["marks"].items():
                if v:
                    r[f"m:{k}"] = v
            by_step: dict[str, list[float]] = {}
            for _, step, ts in detail["trace"]:
                by_step.setdefault(step, []).append(ts)
            for step, ts in by_step.items():
                r[f"tr:{step}"] = min(ts)
                r[f"tr:first:{step}"] = min(ts)
                r[f"tr:last:{step}"] = max(ts)
                r["pieces"] = max(r.get("pieces", 0), len(ts))
            continue
        if kind == "d_room":
            continue
        key = f"{kind}:{detail}" if isinstance(detail, str) else kind
        r.setdefault(key, t)  # the first occurrence
        r["multi"].setdefault(key, []).append(t)
    for r in rooms.values():
        for key, ts in r.pop("multi").items():
            kind, _, what = key.partition(":")  # "d_rx:PieceReady" -> "d_rx:first:PieceReady"
            for tag, t in (("first", ts[0]), ("last", ts[-1])):
                r[f"{kind}:{tag}:{what}" if what else f"{kind}:{tag}"] = t
    return rooms


def analyse(out_dir: Path, label: str) -> dict[str, Any]:
    events: list[tuple[str, int, Any, float]] = []
    for f in sorted(out_dir.glob("*.json")):
        events += [tuple(e) for e in json.loads(f.read_text())["events"]]  # type: ignore[misc]
    rooms = {k: v for k, v in _rooms(events).items() if k != -1 and "d_poll:Success" in v}
    order = sorted(rooms, key=lambda k: rooms[k].get("d_meta1", 0.0))
    steady = order[1:]
    rows = []
    for name, key in STEPS:
        vals = []
        for k in steady:
            r = rooms[k]
            t0 = r.get("p_poll:WaitingForInput")
            if t0 is not None and key in r:
                vals.append((r[key] - t0) * 1e3)
        first = float("nan")  # the fresh pair's first room, for the cold-start figure
        if order and key in rooms[order[0]] and "p_poll:WaitingForInput" in rooms[order[0]]:
            r = rooms[order[0]]
            first = (r[key] - r["p_poll:WaitingForInput"]) * 1e3
        if vals:
            a = np.asarray(vals)
            rows.append((name, float(np.median(a)), float(np.percentile(a, 10)),
                         float(np.percentile(a, 90)), len(a), first))  # fmt: skip
    per_room = []
    for k in order:
        r = rooms[k]
        t0 = max(r.get("p_poll:WaitingForInput", 0.0), r.get("d_meta1", 0.0))
        nbytes = r.get("bytes", 0)
        rec = {"room": k, "bytes": nbytes, "pieces": r.get("pieces", 0), "path": r.get("path")}
        if "d_poll:Success" in r and t0:
            rec["product_ms"] = (r["d_poll:Success"] - t0) * 1e3
        if "tr:first gather" in r and "d_out:last:PieceReady" in r:
            rec["engine_like_ms"] = (r["d_out:last:PieceReady"] - r["tr:first gather"]) * 1e3
        if "tr:first gather" in r and "d_out:TransferStatus" in r:
            rec["gather_to_applied_ms"] = (r["d_out:TransferStatus"] - r["tr:first gather"]) * 1e3
        if "p_op_launch0" in r and "p_op_done:DONE" in r:  # one pass: launch to copy seen done
            rec["engine_like_ms"] = (r["p_op_done:DONE"] - r["p_op_launch0"]) * 1e3
        if "p_op_launch0" in r and "d_rx:TransferStatus" in r:  # to the status received
            rec["gather_to_applied_ms"] = (r["d_rx:TransferStatus"] - r["p_op_launch0"]) * 1e3
        launch = r.get("p_op_launch0", r.get("tr:first gather"))
        if launch is not None and "d_poll:Success" in r:  # issue 19's clock
            rec["launch_to_success_ms"] = (r["d_poll:Success"] - launch) * 1e3
        if "p_poll:WaitingForInput" in r and "d_meta1" in r:
            rec["prefill_late_ms"] = (r["p_poll:WaitingForInput"] - r["d_meta1"]) * 1e3
        per_room.append(rec)

    def med(key: str, rows_: list[dict[str, Any]]) -> float:
        v = [x[key] for x in rows_ if key in x]
        return float(np.median(v)) if v else float("nan")

    def gbps(key: str, rows_: list[dict[str, Any]]) -> float:
        v = [x["bytes"] / (x[key] * 1e-3) / 1e9 for x in rows_ if x.get(key) and x["bytes"]]
        return float(np.median(v)) if v else float("nan")

    st = per_room[1:]
    summary = {
        "label": label,
        "rooms": len(per_room),
        "product_ms_p50": med("product_ms", st),
        "engine_like_ms_p50": med("engine_like_ms", st),
        "gather_to_applied_ms_p50": med("gather_to_applied_ms", st),
        "product_gbps_p50": gbps("product_ms", st),
        "engine_like_gbps_p50": gbps("engine_like_ms", st),
        "gather_to_applied_gbps_p50": gbps("gather_to_applied_ms", st),
        "launch_to_success_ms_p50": med("launch_to_success_ms", st),
        "launch_to_success_gbps_p50": gbps("launch_to_success_ms", st),
        "pieces_p50": med("pieces", st),
        "bytes_p50": med("bytes", st),
    }
    print(f"=== product timeline {label}: {len(per_room)} rooms, steady = all but the first")
    head = f"{'step (steady rooms, ms after T0)':50s} {'p50':>8s} {'p10':>8s} {'p90':>8s}"
    print(f"{head}  n  {'first':>8s}")
    for name, p50, p10, p90, n, first in rows:
        print(f"{name:50s} {p50:8.3f} {p10:8.3f} {p90:8.3f}  {n} {first:8.3f}")
    print(
        "per room p50: product (T0->T1) {product_ms_p50:.2f} ms = {product_gbps_p50:.0f} GB/s; "
        "first gather -> last piece scattered (the engine's clock) {engine_like_ms_p50:.2f} ms = "
        "{engine_like_gbps_p50:.0f} GB/s; first gather -> status applied "
        "{gather_to_applied_ms_p50:.2f} ms = {gather_to_applied_gbps_p50:.0f} GB/s; "
        "worker's launch (or first gather) -> decode sees Success "
        "{launch_to_success_ms_p50:.2f} ms = {launch_to_success_gbps_p50:.0f} GB/s; "
        "{pieces_p50:.0f} pieces, {bytes_p50:.3g} bytes".format(**summary)
    )
    print("SUMMARY " + json.dumps(summary))
    return {"summary": summary, "steps": rows, "rooms": per_room}


# ----------------------------------------------------------------------- driver
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--label", default="run")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    p.add_argument("--poll-wait-us", type=float, default=500.0)
    p.add_argument("--no-bell", action="store_true")
    p.add_argument("--switch-interval-us", type=float, default=0.0)
    p.add_argument("--stack-dump-s", type=float, default=60.0)
    mine, rest = p.parse_known_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from sgl_nixl_plugin.bench import session as S
    from sgl_nixl_plugin.bench.report import summarize
    from sgl_nixl_plugin.cli.bench import build_parser, workload_of

    args = build_parser().parse_args(rest)
    workload = workload_of(args)
    cfg = S.SessionConfig(
        workload,
        mem_kind=args.mem,
        prefill_gpu=args.prefill_gpu,
        decode_gpu=args.decode_gpu,
        timeout_s=args.timeout,
        verify=not args.no_verify,
    )
    out_dir = Path(mine.out) / f"timeline_{mine.label}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in out_dir.glob("*.json"):
        f.unlink()
    opts = {
        "out": str(out_dir),
        "poll_wait_us": mine.poll_wait_us,
        "bell": not mine.no_bell,
        "switch_us": mine.switch_interval_us,
        "stack_dump_s": mine.stack_dump_s,
    }
    sess = S.Session(cfg, start_method="spawn")  # _probed_rank lives in this script
    for spec in sess.specs:  # Session.start, with the probed entry point
        proc = sess.ctx.Process(
            target=_probed_rank,
            args=(spec, sess.out, sess.done, sess.release, opts),
            daemon=True,
            name=f"{spec.role}{spec.instance}.{spec.tp_rank}",
        )
        proc.start()
        sess.procs[(spec.role, spec.instance, getattr(spec, "rank", spec.tp_rank))] = proc
    result = sess.wait()
    s = summarize(result)
    print(
        f"=== bench figures {mine.label} (poll wait {mine.poll_wait_us:g} us, bell {not mine.no_bell}): "
        f"ok {s['ok']}/{s['requests']}, corrupt {s['corrupt_pages']}, per-request GB/s p50 "
        f"{s['per_request_gbps_p50']:.1f}, latency p50/p99 {s['latency_p50_ms']:.2f}/"
        f"{s['latency_p99_ms']:.2f} ms, first/steady {s['first_request_ms']:.2f}/"
        f"{s['steady_p50_ms']:.2f} ms, all-requests {s['gbps']:.1f} GB/s, errors {s['errors']}"
    )
    time.sleep(0.5)
    doc = analyse(out_dir, mine.label)
    doc["bench"] = {k: v for k, v in s.items() if not isinstance(v, list | dict)}
    (Path(mine.out) / f"timeline_{mine.label}.json").write_text(json.dumps(doc, indent=1))
    return 0 if s["ok"] == s["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
