"""Fault-injection orchestration for PD tests: rank processes the test steers step by step.

``bench.session`` runs a whole workload and reports at the end; failure tests need more
control: hold a room's last chunk so a kill lands mid-transfer, kill one process and time
what the others observe, restart a prefill on the same bootstrap server, abort from the
decode loop, run a soak inside one long-lived pair, or start ranks in network namespaces.

Each rank is a process forked from the bench's preloaded forkserver (``bench.procs``), or a
fresh interpreter under ``ip netns exec`` for a rank in a network namespace. It reuses the
bench harness (``RankSpec``, ``Pools``, ``_setup``, ``_tables``, ``PagePool``, the byte
patterns) and obeys commands sent over a socketpair (``multiprocessing.connection``). It
reports asynchronous events, every one stamped with ``time.time()`` taken in that process
(all ranks run on one host, so wall clocks of different processes compare). Every process
gets a hard deadline of its own (it exits by itself) and ``FaultCluster.close`` kills
whatever is left.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from helpers.waiting import poll_until
from sgl_nixl_plugin.adapter import harness
from sgl_nixl_plugin.bench import procs
from sgl_nixl_plugin.bench.driver import room_tables as _tables
from sgl_nixl_plugin.bench.pools import Pools
from sgl_nixl_plugin.bench.rank import RankSpec
from sgl_nixl_plugin.bench.rank import setup as _setup
from sgl_nixl_plugin.bench.session import LOOPBACK_ENV, free_port
from sgl_nixl_plugin.bench.workload import (
    AUX_ITEM_BYTES,
    STATE_ITEM_BYTES,
    PagePool,
    Request,
    Workload,
    aux_pattern,
    pattern,
    state_pattern,
)

TESTS_DIR = str(Path(__file__).resolve().parents[1])

#: Extra environment of every rank in these tests. Failure detection under test is the
#: connection watch (a killed process resets its TCP connections); a long ping deadline
#: keeps a loaded CI host from failing rooms by silence instead, so a pass proves the
#: reset path. The partition test sets its own short deadline.
FAULT_ENV = {
    "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": "1.0",
    "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": "30",
    "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "120",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
}


class RankDied(RuntimeError):
    """The rank process went away (its end of the socketpair closed)."""


# ======================================================================================
# parent side
# ======================================================================================


class RankProc:
    """One rank process and its command channel."""

    def __init__(
        self,
        name: str,
        spec: RankSpec,
        logdir: Path,
        *,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        opts: dict[str, Any] | None = None,
        lifetime_s: float = 240.0,
    ) -> None:
        self.name = name
        self.spec = spec
        self.log_path = logdir / f"{name}.log"
        self.netns = netns
        self.opts = dict(opts or {})
        self.lifetime_s = lifetime_s
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.info: dict[str, Any] = {}
        self._events: list[dict[str, Any]] = []
        self._replies: dict[int, tuple[bool, Any]] = {}
        self._next_id = 0
        self.killed_at: float | None = None

    # -- lifecycle ------------------------------------------------------------------------
    def start(self) -> RankProc:
        """Fork the rank from the bench's preloaded forkserver (SGLang imported once per test
        run); a rank in a network namespace is a fresh interpreter under ``ip netns exec``."""
        from helpers.subproc import clean_env, sglang_env_problems

        ours = {**LOOPBACK_ENV, **FAULT_ENV, **self.spec.env, **self.env}
        bad = sglang_env_problems(ours)
        if bad:  # SGLang would run the rank with its defaults instead
            raise ValueError(f"{self.name}: SGLang would ignore " + "; ".join(bad))
        env = clean_env(ours)
        if self.netns:
            self._exec_in_netns(env)
        else:
            ctx = procs.context("DRAM")
            parent, child = ctx.Pipe()
            forked = ctx.Process(
                target=forked_main,
                args=(child, procs.Inherited(env), str(self.log_path)),
                name=self.name,
            )
            forked.start()
            child.close()
            self.proc = ForkedProc(forked)
            self.conn = parent
        assert self.conn is not None
        self.conn.send({"spec": self.spec, "opts": self.opts, "lifetime_s": self.lifetime_s})
        return self

    def _exec_in_netns(self, env: dict[str, str]) -> None:
        assert self.netns is not None
        parent, child = socket.socketpair()
        env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        argv = [
            "ip", "netns", "exec", self.netns, sys.executable, "-c",
            f"from helpers.faults import child_main; child_main({child.fileno()})",
        ]  # fmt: skip
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=[child.fileno()],
                cwd=TESTS_DIR,
                start_new_session=True,
            )
        child.close()
        self.conn = Connection(parent.detach())

    def wait_ready(self, timeout: float = 90.0) -> dict[str, Any]:
        ev = self.wait_event(lambda e: e["kind"] in ("ready", "fatal"), timeout)
        if ev["kind"] == "fatal":
            raise RuntimeError(f"{self.name} failed to start:\n{ev['error']}\n{self.log_tail()}")
        self.info = ev
        return ev

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> float:
        """SIGKILL; returns ``time.time()`` taken just before the signal."""
        assert self.proc is not None
        t = time.time()
        self.proc.send_signal(signal.SIGKILL)
        self.killed_at = t
        self.proc.wait(timeout=10)
        return t

    def close(self) -> None:
        """Graceful stop if possible (the rank closes its manager), then kill."""
        if self.proc is None:
            return
        if self.alive() and self.conn is not None:
            try:
                self.conn.send(("stop", -1, {}))
                self.proc.wait(timeout=10)
            except Exception:
                pass
        if self.alive():
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def log_tail(self, n: int = 4000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return f"--- {self.name} log (tail) ---\n{text[-n:]}"

    # -- messages -------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Read whatever the rank sent within ``timeout`` seconds (at least one poll)."""
        assert self.conn is not None
        try:
            ready = self.conn.poll(max(0.0, timeout))
        except (EOFError, OSError) as exc:
            raise RankDied(f"{self.name} is gone") from exc
        while ready:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError) as exc:
                raise RankDied(
                    f"{self.name} is gone (exit {self.proc.poll() if self.proc else None})"
                ) from exc
            kind = msg[0]
            if kind == "event":
                self._events.append(msg[1])
            else:
                self._replies[msg[1]] = (kind == "reply", msg[2])
            ready = self.conn.poll(0)

    def send(self, op: str, **kw: Any) -> int:
        assert self.conn is not None
        self._next_id += 1
        self.conn.send((op, self._next_id, kw))
        return self._next_id

    def result(self, rid: int, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while rid not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no reply to request {rid} in {timeout:.0f}s")
            self._pump(min(left, 0.2))
        ok, value = self._replies.pop(rid)
        if not ok:
            raise RuntimeError(f"{self.name} raised:\n{value}")
        return value

    def call(self, op: str, timeout: float = 60.0, **kw: Any) -> Any:
        return self.result(self.send(op, **kw), timeout)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Every event received so far (of ``kind``), without consuming them."""
        if self.conn is not None and self.alive():
            try:
                self._pump(0)
            except RankDied:
                pass
        return [e for e in self._events if kind is None or e["kind"] == kind]

    def wait_event(self, pred: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            # the list stays append-only: readers keep their place in it by index (the chaos
            # checker), and removing an event there made it skip the next one
            for e in self._events[seen:]:
                if pred(e):
                    return e
            seen = len(self._events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.name}: no matching event in {timeout:.0f}s\n{self.log_tail()}"
                )
            self._pump(min(left, 0.2))

    def done(self, rooms: set[int] | None = None) -> dict[int, dict[str, Any]]:
        """Final results reported so far, per room."""
        return {e["room"]: e for e in self.events("done") if rooms is None or e["room"] in rooms}

    def wait_done(self, rooms: set[int], timeout: float) -> dict[int, dict[str, Any]]:
        """Bounded wait until every room in ``rooms`` reported its final result."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.done(rooms)
            if set(got) >= rooms:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"{self.name}: {len(rooms - set(got))}/{len(rooms)} rooms unfinished after "
                    f"{timeout:.0f}s\n{self.log_tail()}"
                )
            self._pump(min(left, 0.2))


class FaultCluster:
    """The ranks of one test; ``close`` (always called, in ``finally``) ends them all."""

    def __init__(self, workload: Workload, logdir: Path, env: dict[str, str] | None = None) -> None:
        self.workload = workload
        self.logdir = logdir
        self.env = {**(env or {})}
        self.ranks: dict[str, RankProc] = {}

    def __enter__(self) -> FaultCluster:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def spec(
        self,
        role: str,
        instance: int = 0,
        bootstrap_port: int = 0,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        **kw: Any,
    ) -> RankSpec:
        """A rank of server ``instance``: TP ``tp_size``, this rank ``tp_rank``; ``kw`` are
        further ``RankSpec`` fields (``dp_size`` > 1: DP attention; ``pp_size``...)."""
        return RankSpec(
            role,
            instance,
            tp_size,
            tp_rank,
            self.workload,
            bootstrap_port=bootstrap_port,
            env={**self.env, **kw.pop("env", {})},
            **kw,
        )

    def add(self, name: str, spec: RankSpec, **kw: Any) -> RankProc:
        r = RankProc(name, spec, self.logdir, **kw).start()
        self.ranks[name] = r
        return r

    def bootstrap(self, name: str, port: int | None = None, **kw: Any) -> RankProc:
        port = port or free_port()
        return self.add(name, self.spec("bootstrap", bootstrap_port=port), **kw)

    def prefill(
        self, name: str, port: int, serve_bootstrap: bool, instance: int = 0, **kw: Any
    ) -> RankProc:
        spec = self.spec("prefill", instance, bootstrap_port=port, serve_bootstrap=serve_bootstrap)
        return self.add(name, spec, **kw)

    def decode(self, name: str, instance: int = 0, **kw: Any) -> RankProc:
        return self.add(name, self.spec("decode", instance), **kw)

    def ready(self, *names: str, timeout: float = 120.0) -> None:
        for n in names or list(self.ranks):
            if not self.ranks[n].info:
                self.ranks[n].wait_ready(timeout)

    def logs(self) -> str:
        return "\n".join(r.log_tail() for r in self.ranks.values())

    def close(self) -> None:
        for r in self.ranks.values():
            try:
                r.close()
            except Exception:
                if r.proc is not None and r.proc.poll() is None:
                    r.proc.kill()


def make_requests(
    n: int,
    seed: int,
    *,
    tokens: tuple[int, int],
    chunks: int = 1,
    contiguous: bool = False,
    host: bool = False,
) -> list[Request]:
    """``n`` requests with fresh random rooms (``chunks`` > 1 lets a prefill hold the last;
    ``host``: into the decode's host pool, without state, as SGLang's host receive)."""
    rng = np.random.default_rng(seed)
    return [
        Request(
            int(rng.integers(1, 2**63 - 1)),
            int(rng.integers(tokens[0], tokens[1] + 1)),
            chunks,
            contiguous,
            not host,
            host=host,
        )
        for _ in range(n)
    ]


def first_chunk_pages(r: Request, page_size: int) -> int:
    """Pages of the first of a request's chunks (``Request.split`` into two)."""
    return -(-r.pages(page_size) // 2)


def hold_mid_transfer(
    prefill: RankProc, decode: RankProc, reqs: list[Request], addr: str, page_size: int,
    timeout: float = 30,
) -> None:  # fmt: skip
    """Start ``reqs`` (two chunks each) with the prefill holding each last chunk; return once
    every room's first chunk has landed on the decode (the rooms are then mid-transfer)."""
    prefill.call("expect", reqs=reqs, plans={r.room: "hold" for r in reqs})
    assert decode.call("submit", reqs=reqs, addr=addr) == {}
    want = {r.room: first_chunk_pages(r, page_size) for r in reqs}
    poll_until(
        lambda: decode.call("landed", rooms=list(want)),
        lambda got: all(got.get(room, 0) >= n for room, n in want.items()),
        timeout,
    )
    held = set(prefill.call("held"))
    assert held >= set(want), f"prefill no longer holds {set(want) - held}"
    assert not decode.done(set(want)), "a held room finished early"


def aborted_and_acked(
    decode: RankProc, rooms: set[int], timeout: float = 20
) -> tuple[dict[int, Any], set[int]]:
    """Bounded wait, after ``arm_abort``, until every room was either aborted or finished
    and every aborted room was acked: (aborted rooms with their events, finished rooms)."""

    def progress() -> tuple[dict[int, Any], set[int], set[int]]:
        aborted = {e["room"]: e for e in decode.events("aborted") if e["room"] in rooms}
        return aborted, {e["room"] for e in decode.events("acked")}, set(decode.done(rooms))

    (aborted, _, finished), _ = poll_until(
        progress, lambda v: (set(v[0]) | v[2]) >= rooms and set(v[0]) <= v[1], timeout
    )
    return aborted, finished


def changed_after_ack(decode: RankProc, aborted: dict[int, Any]) -> dict[int, Any]:
    """The acked rooms whose bytes changed since their ACK (``check_unchanged``, which then
    releases them as SGLang does), with what changed."""
    changed = decode.call("check_unchanged", rooms=sorted(aborted))
    return {room: v for room, v in changed.items() if v["changed"]}


# ======================================================================================
# network namespaces
# ======================================================================================


@dataclass
class NetnsPair:
    ns: tuple[str, str]
    dev: tuple[str, str]
    addr: tuple[str, str] = ("10.250.0.1", "10.250.0.2")

    def ip(self, side: int, *args: str) -> None:
        _ip("-n", self.ns[side], *args)

    def link(self, side: int, state: str) -> None:
        self.ip(side, "link", "set", self.dev[side], state)


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=False)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")
    return r


def netns_unavailable() -> str | None:
    """Why namespaces can't be made here (None if ``ip netns add`` works)."""
    name = f"sglnp{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        return "the ip command (iproute2) is not installed"
    except Exception as exc:
        return f"`ip netns add` does not work here (needs root / CAP_SYS_ADMIN): {exc}"
    try:
        _ip("netns", "del", name)
    except Exception:
        pass
    return None


def _reap_namespaces() -> None:
    """Delete the namespaces of test runs whose process is gone (a run killed outright
    does not reach its cleanup); they are named after the pid that made them."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=20, check=False
    ).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        m = re.fullmatch(r"sglp(\d+)[ab]", name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            subprocess.run(["ip", "netns", "del", name], timeout=20, check=False)
        except PermissionError:
            pass  # alive, someone else's


@contextmanager
def netns_pair() -> Iterator[NetnsPair]:
    """Two namespaces joined by a veth pair, 10.250.0.1/24 and 10.250.0.2/24 inside them
    only (and loopback up in each). Both are deleted on exit, whatever happened."""
    _reap_namespaces()
    tag = f"{os.getpid()}"
    pair = NetnsPair((f"sglp{tag}a", f"sglp{tag}b"), (f"sgv{tag}a", f"sgv{tag}b"))
    made: list[str] = []
    try:
        for ns in pair.ns:
            _ip("netns", "add", ns)
            made.append(ns)
        _ip(
            "-n",
            pair.ns[0],
            "link",
            "add",
            pair.dev[0],
            "type",
            "veth",
            "peer",
            "name",
            pair.dev[1],
            "netns",
            pair.ns[1],
        )
        for side in (0, 1):
            pair.ip(side, "addr", "add", f"{pair.addr[side]}/24", "dev", pair.dev[side])
            pair.ip(side, "link", "set", pair.dev[side], "up")
            pair.ip(side, "link", "set", "lo", "up")
        yield pair
    finally:
        for ns in made:
            try:
                _ip("netns", "del", ns)
            except Exception:
                pass


# ======================================================================================
# child side
# ======================================================================================


@dataclass
class _PRoom:
    req: Request
    sender: Any
    pages: np.ndarray
    slot: int
    plan: str = "normal"  # normal | hold (send every chunk but the last until ``release``)
    parts: list[np.ndarray] = field(default_factory=list)
    next_part: int = 0
    inited: bool = False
    held: bool = False


@dataclass
class _DRoom:
    req: Request
    receiver: Any
    pages: np.ndarray
    slot: int
    sent_pages: int
    t0: float
    aborted: bool = False
    required_acks: int = 0
    acked_at: float | None = None
    snapshot: list[np.ndarray] | None = None
    snapshot_landed: int = -1
    keep: bool = False  # hold the pages after the ack until ``check_unchanged``
    abort_after: int = -1  # soak: abort after this many polls
    polls: int = 0
    arm_from: int = -1  # abort once a page from this index on shows bytes (``arm_abort``)
    landing_at_abort: int = -1
    failed_at: float | None = None  # a host room: failed, its pages held until safe


class _Rank:
    """Shared plumbing: the command loop, events and resource probes."""

    def __init__(
        self, conn: Connection, spec: RankSpec, opts: dict[str, Any], deadline: float
    ) -> None:
        self.conn = conn
        self.spec = spec
        self.opts = opts
        self.deadline = deadline
        self.stopping = False

    def emit(self, kind: str, **kw: Any) -> None:
        self.conn.send(("event", {"kind": kind, "t": time.time(), **kw}))

    def loop(self) -> None:
        while not self.stopping and time.monotonic() < self.deadline:
            busy = self.step()
            if self.conn.poll(0.0005 if busy else 0.05):
                while self.conn.poll(0):
                    self.command(self.conn.recv())

    def command(self, msg: tuple[str, int, dict[str, Any]]) -> None:
        op, rid, kw = msg
        if op == "stop":
            self.stopping = True
            return
        try:
            value = getattr(self, f"do_{op}")(**kw)
            self.conn.send(("reply", rid, value))
        except Exception:
            self.conn.send(("error", rid, traceback.format_exc()))

    def step(self) -> bool:
        return False

    def close(self) -> None:
        pass

    # -- probes ------------------------------------------------------------------------
    def do_rss(self) -> int:
        gc.collect()
        return rss_bytes()

    def do_cpu(self, seconds: float) -> dict[str, Any]:
        """CPU time this whole process (every thread) used over ``seconds`` of idling in its
        normal loop, with the busiest threads for a diagnosis, and how often the manager's
        control thread woke up meanwhile (-1: this rank has none)."""
        loop = _control_loop(getattr(self, "mgr", None))
        wakeups0 = loop.wakeups if loop is not None else 0
        threads0 = _thread_cpu()
        c0, w0 = time.process_time(), time.monotonic()
        end = w0 + seconds
        while time.monotonic() < end:
            self.step()
            self.conn.poll(min(0.05, max(0.0, end - time.monotonic())))  # an idle rank's loop
        c1, w1 = time.process_time(), time.monotonic()
        threads1 = _thread_cpu()
        per = {k: threads1[k] - threads0.get(k, 0.0) for k in threads1}
        top = sorted(per.items(), key=lambda kv: -kv[1])[:6]
        wakeups = loop.wakeups - wakeups0 if loop is not None else -1
        return {"cpu_s": c1 - c0, "wall_s": w1 - w0, "top_threads": top, "wakeups": wakeups}


def _control_loop(mgr: Any) -> Any:
    """The manager's control thread (the prefill's control loop, the decode's listener)."""
    if mgr is None:
        return None
    side = getattr(mgr, "side", None)
    return getattr(side, "control", None) or getattr(side, "listener", None)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, keyed ``name/tid``: a Python thread by its
    ``threading`` name (the OS name of every thread Python starts is the process's)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    py_names = {t.native_id: t.name for t in threading.enumerate()}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                raw = f.read()
            name = py_names.get(int(tid)) or raw[raw.index("(") + 1 : raw.rindex(")")]
            fields = raw[raw.rindex(")") + 2 :].split()
            out[f"{name}/{tid}"] = (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError):
            continue
    return out


class _BootstrapRank(_Rank):
    def __init__(
        self, conn: Connection, spec: RankSpec, opts: dict[str, Any], deadline: float
    ) -> None:
        super().__init__(conn, spec, opts, deadline)
        self.env = _setup(spec)
        host = opts.get("bootstrap_host", "127.0.0.1")
        self.server = self.env["classes"]["bootstrap_server"](host=host, port=spec.bootstrap_port)
        self.emit("ready", pid=os.getpid(), port=spec.bootstrap_port)

    def close(self) -> None:
        self.server.close()


def _fill_slot(pools: Pools, room: int, slot: int, with_state: bool) -> None:
    for b, buf in enumerate(pools.aux):
        n = AUX_ITEM_BYTES[b]
        buf[slot * n : (slot + 1) * n] = aux_pattern(room, b, n)
    if with_state:
        pools.state_row(slot)[:] = state_pattern(room, STATE_ITEM_BYTES)


class _PrefillRank(_Rank):
    def __init__(
        self, conn: Connection, spec: RankSpec, opts: dict[str, Any], deadline: float
    ) -> None:
        super().__init__(conn, spec, opts, deadline)
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.KVPoll = KVPoll
        self.env = _setup(spec)
        cls = self.cls = self.env["classes"]
        self.pools = Pools(spec)
        self.server = None
        if spec.serve_bootstrap:
            host = opts.get("bootstrap_host", "127.0.0.1")
            self.server = cls["bootstrap_server"](host=host, port=spec.bootstrap_port)
        self.mgr = cls["manager"](
            self.pools.kv_args(cls["kvargs"], spec),
            DisaggregationMode.PREFILL,
            self.env["server_args"],
            spec.workload.shape.mla,
        )
        self.page_pool = PagePool(
            self.pools.pages, seed=spec.workload.seed + 17 * spec.instance + 1
        )
        self.slots = list(range(1, self.pools.aux_rows))
        self.active: dict[int, _PRoom] = {}
        self.bootstrap_addr = f"127.0.0.1:{spec.bootstrap_port}"
        self.emit(
            "ready",
            pid=os.getpid(),
            ip=self.mgr.local_ip,
            port=self.mgr.rank_port,
            agent=self.mgr.engine.name,
            bootstrap_port=spec.bootstrap_port,
        )

    def close(self) -> None:
        self.mgr.close()
        if self.server is not None:
            self.server.close()

    # -- commands ------------------------------------------------------------------------
    def do_expect(self, reqs: list[Request], plans: dict[int, str] | None = None) -> int:
        """Create a sender per request now (as SGLang does when the request arrives)."""
        plans = plans or {}
        for r in reqs:
            pages = self.page_pool.alloc(r.pages(self.spec.workload.page_size), r.contiguous)
            if pages is None:
                raise RuntimeError("prefill page pool exhausted")
            slot = self.slots.pop()
            self.pools.fill(r.room, pages)
            _fill_slot(self.pools, r.room, slot, r.with_state)
            sender = self.cls["sender"](
                mgr=self.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=r.room
            )
            self.active[r.room] = _PRoom(
                r,
                sender,
                pages,
                slot,
                plans.get(r.room, "normal"),
                parts=r.split(pages),
            )
        return len(self.active)

    def do_release(self, rooms: list[int]) -> list[int]:
        """Send the held chunks of ``rooms`` (those still active); returns which were sent.
        A room whose sender has not started yet (its decode's request is still on its way)
        is released too: it sends every chunk when it starts, instead of holding its last
        one for good."""
        sent = []
        for room in rooms:
            ctx = self.active.get(room)
            if ctx is not None and ctx.held:
                ctx.held = False
                self._send_parts(ctx, len(ctx.parts))
                sent.append(room)
            elif ctx is not None and not ctx.inited:
                ctx.plan = "normal"
        return sent

    def do_held(self) -> list[int]:
        return [room for room, c in self.active.items() if c.held]

    def do_state(self) -> dict[str, Any]:
        mgr = self.mgr
        return {
            "tables": _tables(mgr),
            "peers": sorted(mgr.prefill.ctx.peers.accepted),
            "watched": {
                ep: w.connected for ep, w in list(mgr.prefill.control.watch._peers.items())
            },
            "active": len(self.active),
        }

    def do_soak(self, plan: SoakPlan) -> dict[str, Any]:
        return soak_prefill(self, plan)

    # -- the scheduler loop ----------------------------------------------------------------
    def _send_parts(self, ctx: _PRoom, upto: int) -> None:
        r = ctx.req
        while ctx.next_part < upto:
            i = ctx.next_part
            last = i == len(ctx.parts) - 1
            state = [np.array([ctx.slot], dtype=np.int32)] if (last and r.with_state) else None
            tokens = r.chunk_tokens([len(p) for p in ctx.parts], self.pools.page_size)[i]
            ctx.sender.send(
                ctx.parts[i].astype(np.int32), state_indices=state, num_kv_tokens=tokens
            )
            ctx.next_part += 1

    def step(self) -> bool:
        KVPoll = self.KVPoll
        for room, ctx in list(self.active.items()):
            status = ctx.sender.poll()
            if status == KVPoll.WaitingForInput and not ctx.inited:
                ctx.inited = True
                if self.opts.get("report_bound"):
                    self.emit("bound", room=room)  # the decode's request reached this rank
                ctx.sender.init(len(ctx.pages), ctx.slot)
                ctx.held = ctx.plan == "hold"
                self._send_parts(ctx, len(ctx.parts) - 1 if ctx.held else len(ctx.parts))
            elif status in (KVPoll.Success, KVPoll.Failed):
                self._finish(room, ctx, status == KVPoll.Success)
        return bool(self.active)

    def _finish(self, room: int, ctx: _PRoom, ok: bool) -> None:
        reason = None
        if ok:
            ctx.sender.clear()
        else:
            try:
                ctx.sender.failure_exception()
            except Exception as exc:
                reason = str(exc)
        self.page_pool.release(ctx.pages)
        self.slots.append(ctx.slot)
        del self.active[room]
        self.emit("done", room=room, ok=ok, reason=reason)


class _DecodeRank(_Rank):
    def __init__(
        self, conn: Connection, spec: RankSpec, opts: dict[str, Any], deadline: float
    ) -> None:
        super().__init__(conn, spec, opts, deadline)
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import DisaggregationMode

        self.KVPoll = KVPoll
        self.env = _setup(spec)
        cls = self.cls = self.env["classes"]
        self.pools = Pools(spec)
        self.mgr = cls["manager"](
            self.pools.kv_args(cls["kvargs"], spec),
            DisaggregationMode.DECODE,
            self.env["server_args"],
            spec.workload.shape.mla,
        )
        self.page_pool = PagePool(
            self.pools.pages, seed=spec.workload.seed + 31 * spec.instance + 2
        )
        # the host pool's allocator: SGLang's hands out page 0 too
        self.host_pool = PagePool(self.pools.pages, seed=spec.workload.seed + 5, padding_page=False)
        self.slots = list(range(1, self.pools.aux_rows))
        self.active: dict[int, _DRoom] = {}
        # ``opts["quarantine_failed_s"]``: a failed room's pages and slot are reused only
        # after this long (late WRITEs of a partitioned prefill can still land in them)
        self.quarantine: list[tuple[float, np.ndarray, int]] = []
        self.emit(
            "ready",
            pid=os.getpid(),
            ip=self.mgr.local_ip,
            port=self.mgr.rank_port,
            agent=self.mgr.engine.name,
        )

    def close(self) -> None:
        self.mgr.close()

    # -- commands ------------------------------------------------------------------------
    def do_submit(
        self,
        reqs: list[Request],
        addr: str,
        short: list[int] | None = None,
        metadata: bool = True,
    ) -> dict[int, str]:
        """Allocate pages and send each request's metadata (``short`` rooms get one page
        fewer than the prefill sends: a transfer the prefill must fail; ``metadata=False``
        stops after ``init``, as SGLang's decode does for a room that fails before its
        pages are allocated). Returns the rooms that could not start, with why."""
        problems = {}
        for r in reqs:
            why = self.start_room(r, addr, short=r.room in (short or ()), metadata=metadata)
            if why:
                problems[r.room] = why
        return problems

    def start_room(
        self,
        r: Request,
        addr: str,
        short: bool = False,
        zero: bool = True,
        metadata: bool = True,
    ) -> str | None:
        mgr, pools = self.mgr, self.pools
        if not mgr.try_ensure_parallel_info(addr):
            return f"no parallel info from {addr}"
        # the prefill DP rank that holds the room, as SGLang's decode picks it: 0 for a
        # prefill without DP attention, ``room % dp_size`` for one that follows the room
        dp_rank = harness.resolve_prefill_dp_rank(mgr, addr, r.room)
        if dp_rank is None:
            return f"no prefill DP rank known for room {r.room}"
        pool = self.host_pool if r.host else self.page_pool
        pages = pool.alloc(r.pages(pools.page_size), r.contiguous)
        if pages is None:
            return "decode page pool exhausted"
        slot = self.slots.pop()
        if zero:
            for k in range(len(pools.kv_ptrs)):
                pools.region_words(k, r.host)[pages] = 0
        for buf, n in zip(pools.aux, AUX_ITEM_BYTES, strict=False):
            buf[slot * n : (slot + 1) * n] = 0
        if r.with_state:
            pools.state_row(slot)[:] = 0
        receiver = self.cls["receiver"](mgr=mgr, bootstrap_addr=addr, bootstrap_room=r.room)
        receiver.init(dp_rank)
        state = [np.array([slot], dtype=np.int32)] if r.with_state else None
        sent = pages[:-1] if short else pages
        if not metadata:
            sent = pages[:0]
        elif r.host:
            from sglang.srt.disaggregation.base.conn import KVTransferDestination

            receiver.send_metadata(sent, slot, None, destination=KVTransferDestination.HOST)
        else:
            receiver.send_metadata(sent, slot, state)
        self.active[r.room] = _DRoom(r, receiver, pages, slot, len(sent), time.time())
        return None

    def do_abort(self, rooms: list[int], keep: bool = True) -> list[int]:
        """SGLang's ``receiver.abort()`` for each still-active room; with deferred release the
        room's pages stay held until every prefill rank acked (``acked`` event)."""
        done = []
        for room in rooms:
            ctx = self.active.get(room)
            if ctx is None or ctx.aborted:
                continue
            self._abort(ctx, keep)
            done.append(room)
        return done

    def _abort(self, ctx: _DRoom, keep: bool) -> None:
        ctx.receiver.abort()
        ctx.aborted, ctx.keep = True, keep
        rcv = ctx.receiver
        # SGLang's DecodeTransferQueue._defer_release: one ack per prefill rank notified.
        ctx.required_acks = (
            len(rcv.bootstrap_infos) if rcv.abort_notified and rcv.bootstrap_infos else 0
        )

    def do_arm_abort(self, rooms: list[int], from_page: dict[int, int], keep: bool = True) -> None:
        """Abort each room from this loop as soon as any byte of its pages from
        ``from_page[room]`` on has landed: the abort then lands mid-transfer."""
        for room in rooms:
            ctx = self.active.get(room)
            if ctx is not None:
                ctx.arm_from, ctx.keep = from_page[room], keep

    def _landing(self, ctx: _DRoom) -> tuple[int, int]:
        """Pages from ``arm_from`` on with bytes written (pages were zeroed) in any region,
        and in every region, sampled at the first word of every token row: cheap enough
        for every loop."""
        pages = ctx.pages[ctx.arm_from :]
        any_ = np.zeros(len(pages), dtype=bool)
        all_ = np.ones(len(pages), dtype=bool)
        for r in range(len(self.pools.kv_ptrs)):
            hit = self.pools.region_words(r, ctx.req.host)[pages, :, 0, 0].any(axis=1)
            any_ |= hit
            all_ &= hit
        return int(any_.sum()), int(all_.sum())

    def do_landed(self, rooms: list[int]) -> dict[int, int]:
        """How many pages of each active room already hold the expected bytes."""
        return {
            room: int(
                page_matches(
                    self.pools, room, self.active[room].pages, self.active[room].req.host
                ).sum()
            )
            for room in rooms
            if room in self.active
        }

    def do_check_unchanged(self, rooms: list[int]) -> dict[int, dict[str, int]]:
        """Compare held, acked rooms with their snapshot at ack time, then release them as
        SGLang's ``_do_release`` does. Per room: bytes changed since the ack, and how many
        of its pages held the full pattern at the ack."""
        out = {}
        for room in rooms:
            ctx = self.active.get(room)
            if ctx is None or ctx.snapshot is None:
                out[room] = {"changed": -1, "landed_at_ack": -1}
                continue
            now = self._snap(ctx)
            changed = sum(
                int(np.count_nonzero(a != b)) for a, b in zip(ctx.snapshot, now, strict=True)
            )
            out[room] = {"changed": changed, "landed_at_ack": ctx.snapshot_landed}
            self._release(room, ctx)
        return out

    def do_state(self) -> dict[str, Any]:
        from sglang.srt.disaggregation.common.conn import CommonKVReceiver

        mgr = self.mgr
        watch = mgr.decode.listener.watch
        return {
            "tables": _tables(mgr),
            "known": sorted(mgr.decode.policy.known_endpoints()),
            "watched": {ep: w.connected for ep, w in list(watch._peers.items())},
            "pool_keys": _keys(mgr.connection_pool),
            "sockets": _keys(CommonKVReceiver._socket_cache),
            "active": len(self.active),
        }

    def do_soak(self, plan: SoakPlan) -> dict[str, Any]:
        return soak_decode(self, plan)

    def do_room(self, room: int) -> dict[str, Any]:
        """What this decode knows of ``room`` (for a checker that found it without an
        outcome): SGLang's status, this harness's view, and the plugin's record."""
        mgr, ctx = self.mgr, self.active.get(room)
        rec = mgr.decode.rooms.get(room)
        now = time.perf_counter()
        return {
            "sglang_status": mgr.request_status.get(room),
            "failure": mgr.failure_records.get(room),
            "harness": None
            if ctx is None
            else {
                "slot": ctx.slot,
                "aborted": ctx.aborted,
                "aux_landed": _aux_landed(self.pools, ctx.slot),
                "polled_status": int(ctx.receiver.poll()),
            },
            "record": None
            if rec is None
            else {
                "staged": rec.staged,
                "sent_to": sorted(rec.sent_to),
                "steps_ms_ago": {k: round((now - t) * 1e3, 1) for k, t in rec.times.items()},
            },
        }

    # -- the scheduler loop ----------------------------------------------------------------
    def _snap(self, ctx: _DRoom) -> list[np.ndarray]:
        p = self.pools
        out = [p.region_words(k, ctx.req.host)[ctx.pages].copy() for k in range(len(p.kv_ptrs))]
        out += [
            buf[ctx.slot * n : (ctx.slot + 1) * n].copy()
            for buf, n in zip(p.aux, AUX_ITEM_BYTES, strict=False)
        ]
        if ctx.req.with_state:
            out.append(np.array(p.state_row(ctx.slot), copy=True))
        return out

    def _release(self, room: int, ctx: _DRoom) -> None:
        """SGLang's release of a finished request: forget the abort generation, clear the
        receiver, return the pages and the metadata slot."""
        if ctx.aborted:
            self.mgr.clear_deferred_abort_state(room)
            try:
                ctx.receiver.failure_exception()  # clear() and pop the failure record
            except Exception:
                pass
        (self.host_pool if ctx.req.host else self.page_pool).release(ctx.pages)
        self.slots.append(ctx.slot)
        del self.active[room]

    def _release_safe(self, ctx: _DRoom) -> bool:
        """SGLang's drain check of an aborted room: for a host destination the receiver's
        (0.5.22+; 0.5.21 has only the manager's), else the manager's count of abort ACKs."""
        from sglang.srt.disaggregation.base.conn import BaseKVReceiver

        if ctx.req.host and hasattr(BaseKVReceiver, "is_abort_release_safe"):
            return bool(ctx.receiver.is_abort_release_safe())
        return bool(self.mgr.is_abort_release_safe(ctx.req.room, ctx.required_acks))

    def step(self) -> bool:
        KVPoll = self.KVPoll
        pools = self.pools
        for room, ctx in list(self.active.items()):
            if ctx.failed_at is not None:
                # SGLang's DecodeTransferQueue.resolve_deferred_releases for a host room:
                # no timeout, only the receiver's word frees the pages
                if self._release_safe(ctx):
                    ctx.receiver.clear()
                    self.host_pool.release(ctx.pages)
                    self.slots.append(ctx.slot)
                    del self.active[room]
                    self.emit("host_released", room=room, held_s=time.time() - ctx.failed_at)
                continue
            if ctx.aborted:
                if ctx.acked_at is None and self._release_safe(ctx):
                    ctx.acked_at = time.time()
                    if ctx.keep:
                        ctx.snapshot = self._snap(ctx)
                        ctx.snapshot_landed = int(
                            page_matches(pools, room, ctx.pages, ctx.req.host).sum()
                        )
                    self.emit("acked", room=room)
                    if not ctx.keep:
                        self._release(room, ctx)
                continue
            if ctx.arm_from >= 0:
                started, whole = self._landing(ctx)
                if started:
                    ctx.landing_at_abort = whole
                    self._abort(ctx, ctx.keep)
                    self.emit("aborted", room=room, landing=whole, of=len(ctx.pages) - ctx.arm_from)
                    continue
            status = ctx.receiver.poll()
            if status == KVPoll.Success and not _aux_landed(pools, ctx.slot):
                continue  # SGLang's metadata gate
            if status not in (KVPoll.Success, KVPoll.Failed):
                continue
            res: dict[str, Any] = {"ok": status == KVPoll.Success, "reason": None, "t0": ctx.t0}
            if status == KVPoll.Failed:
                if ctx.req.host:
                    ctx.receiver.abort()  # SGLang's _abort_failed_transfer for a host room
                try:
                    ctx.receiver.failure_exception()
                except Exception as exc:
                    res["reason"] = str(exc)
                if ctx.req.host:
                    ctx.failed_at = time.time()
                    self.emit("done", room=room, **res)
                    continue
            else:
                ctx.receiver.clear()
                res.update(verify_room(pools, ctx))
            hold_s = float(self.opts.get("quarantine_failed_s", 0))
            if status == KVPoll.Failed and hold_s > 0:
                self.quarantine.append((time.monotonic() + hold_s, ctx.pages, ctx.slot))
            else:
                (self.host_pool if ctx.req.host else self.page_pool).release(ctx.pages)
                self.slots.append(ctx.slot)
            del self.active[room]
            self.emit("done", room=room, **res)
        while self.quarantine and self.quarantine[0][0] <= time.monotonic():
            _, pages, slot = self.quarantine.pop(0)
            self.page_pool.release(pages)
            self.slots.append(slot)
        return bool(self.active)


def _aux_landed(pools: Pools, slot: int) -> bool:
    n = AUX_ITEM_BYTES[1]
    return bool(pools.aux[1][slot * n : (slot + 1) * n].any())


def _keys(d: dict) -> list[Any]:
    for _ in range(10):
        try:
            return sorted(d)
        except RuntimeError:  # changed size while another thread wrote it: read again
            continue
    return []


def page_matches(
    pools: Pools, room: int, pages: np.ndarray, host: bool = False, tokens: int | None = None
) -> np.ndarray:
    """Per page of a request (in the host pool: ``host``): True where every region holds
    the prefill's pattern, in the request's first ``tokens`` tokens (None: whole pages)."""
    n = np.arange(len(pages))
    ok = np.ones(len(pages), dtype=bool)
    for r, rid in enumerate(pools.region_ids):
        pat = pattern(room, rid, n, pools.page_size, pools.global_heads, pools.head_words)
        got = pools.region_words(r, host)[pages]
        right = (got == pat).reshape(len(pages) * pools.page_size, -1).all(axis=1)
        if tokens is not None:
            right[tokens:] = True  # past the request: no side's data
        ok &= right.reshape(len(pages), -1).all(axis=1)
    return ok


def verify_room(pools: Pools, ctx: _DRoom) -> dict[str, int]:
    room, slot = ctx.req.room, ctx.slot
    # across page sizes only the request's tokens travel; equal pages travel whole
    tokens = ctx.req.tokens if pools.pages_differ else None
    out = {"bad_pages": int((~page_matches(pools, room, ctx.pages, ctx.req.host, tokens)).sum())}
    out["bad_aux"] = sum(
        int(not np.array_equal(buf[slot * n : (slot + 1) * n], aux_pattern(room, b, n)))
        for b, (buf, n) in enumerate(zip(pools.aux, AUX_ITEM_BYTES, strict=False))
    )
    if ctx.req.with_state:
        out["bad_state"] = int(
            not np.array_equal(pools.state_row(slot), state_pattern(room, STATE_ITEM_BYTES))
        )
    return out


# ======================================================================================
# soak: one long-lived pair, many tiny requests, a mix of outcomes
# ======================================================================================


@dataclass(frozen=True)
class SoakPlan:
    """Both ranks derive the same requests and fates from ``workload`` (its seed)."""

    workload: Workload
    addr: str = ""
    warmup: int = 500
    decode_abort_every: int = 10  # fates by request index: see ``fate``
    client_abort_every: int = 13
    mismatch_every: int = 17
    ack_timeout_s: float = 10.0
    time_limit_s: float = 150.0

    def fate(self, i: int) -> str:
        """ok | decode_abort (the decode aborts 0-3 polls after sending its metadata) |
        client_abort (prefill ``sender.abort()``: before any chunk for one-chunk requests,
        after the first chunk otherwise; the decode aborts too, as a client abort reaches
        both servers) | mismatch (the decode offers one page fewer than the prefill sends:
        the prefill fails the transfer and tells the decode)."""
        if i % self.decode_abort_every == 3:
            return "decode_abort"
        if i % self.client_abort_every == 5:
            return "client_abort"
        if i % self.mismatch_every == 7:
            return "mismatch"
        return "ok"


def _rss_after_gc() -> int:
    gc.collect()
    return rss_bytes()


def soak_prefill(rank: _PrefillRank, plan: SoakPlan) -> dict[str, Any]:
    KVPoll = rank.KVPoll
    w = plan.workload
    reqs = w.make_requests()
    fates = [plan.fate(i) for i in range(len(reqs))]
    pending = list(range(len(reqs)))
    pending.reverse()
    active: dict[int, tuple[int, Any, np.ndarray, int, bool]] = {}
    outcomes: Counter[str] = Counter()
    done = 0
    rss_warm = tables_warm = None
    t_start = time.monotonic()
    t_warm = None
    deadline = t_start + plan.time_limit_s
    pools, pp = rank.pools, rank.page_pool
    while (pending or active) and time.monotonic() < deadline:
        while pending and len(active) < w.concurrency:
            i = pending[-1]
            r = reqs[i]
            pages = pp.alloc(r.pages(w.page_size), r.contiguous)
            if pages is None:
                break
            pending.pop()
            slot = rank.slots.pop()
            pools.fill(r.room, pages)
            _fill_slot(pools, r.room, slot, r.with_state)
            sender = rank.cls["sender"](
                mgr=rank.mgr, bootstrap_addr=rank.bootstrap_addr, bootstrap_room=r.room
            )
            active[r.room] = [i, sender, pages, slot, False]
        for room, ctx in list(active.items()):
            i, sender, pages, slot, inited = ctx
            status = sender.poll()
            if status == KVPoll.WaitingForInput and not inited:
                r = reqs[i]
                parts = r.split(pages)
                if fates[i] == "client_abort" and len(parts) == 1:
                    sender.abort()  # before any chunk was sent
                    continue
                ctx[4] = True
                sender.init(len(pages), slot)
                for k, part in enumerate(parts):
                    last = k == len(parts) - 1
                    if last and fates[i] == "client_abort":
                        sender.abort()  # mid-transfer: after the first chunk
                        break
                    state = [np.array([slot], dtype=np.int32)] if (last and r.with_state) else None
                    sender.send(part.astype(np.int32), state_indices=state)
            elif status in (KVPoll.Success, KVPoll.Failed):
                if status == KVPoll.Success:
                    sender.clear()
                    outcomes[f"{fates[i]}:ok"] += 1
                else:
                    try:
                        sender.failure_exception()
                    except Exception:
                        pass
                    outcomes[f"{fates[i]}:failed"] += 1
                pp.release(pages)
                rank.slots.append(slot)
                del active[room]
                done += 1
                if done == plan.warmup:
                    rss_warm, tables_warm, t_warm = (
                        _rss_after_gc(),
                        _tables(rank.mgr),
                        time.monotonic(),
                    )
        time.sleep(0.0005)
    t_end = time.monotonic()
    # Let the transfer workers settle the last rooms (bounded), then read the tables.
    settle = time.monotonic() + 10
    while time.monotonic() < settle and any(w_.active for w_ in rank.mgr.prefill.workers):
        time.sleep(0.01)
    return {
        "done": done,
        "unfinished": len(pending) + len(active),
        "outcomes": dict(outcomes),
        "rss_warm": rss_warm,
        "rss_end": _rss_after_gc(),
        "tables_warm": tables_warm,
        "tables_end": _tables(rank.mgr),
        "peers": sorted(rank.mgr.prefill.ctx.peers.accepted),
        "wall_s": t_end - t_start,
        "steady_s": (t_end - t_warm) if t_warm else None,
    }


def soak_decode(rank: _DecodeRank, plan: SoakPlan) -> dict[str, Any]:
    KVPoll = rank.KVPoll
    w = plan.workload
    reqs = w.make_requests()
    fates = [plan.fate(i) for i in range(len(reqs))]
    rng = np.random.default_rng(w.seed + 5)
    pending = list(range(len(reqs)))
    pending.reverse()
    outcomes: Counter[str] = Counter()
    bad: list[tuple[int, dict[str, int]]] = []
    unacked = 0
    ack_wait: list[float] = []
    done = 0
    rss_warm = tables_warm = None
    t_start = time.monotonic()
    t_warm = None
    deadline = t_start + plan.time_limit_s
    index = {r.room: i for i, r in enumerate(reqs)}
    active = rank.active
    pools = rank.pools

    def finished() -> None:
        nonlocal done, rss_warm, tables_warm, t_warm
        done += 1
        if done == plan.warmup:
            rss_warm, tables_warm, t_warm = _rss_after_gc(), _tables(rank.mgr), time.monotonic()

    while (pending or active) and time.monotonic() < deadline:
        while pending and len(active) < w.concurrency:
            i = pending[-1]
            why = rank.start_room(reqs[i], plan.addr, short=fates[i] == "mismatch", zero=False)
            if why == "decode page pool exhausted":
                break
            pending.pop()
            if why:
                outcomes[f"{fates[i]}:not_started"] += 1
                finished()
                continue
            if fates[i] in ("decode_abort", "client_abort"):
                active[reqs[i].room].abort_after = int(rng.integers(0, 4))
        for room, ctx in list(active.items()):
            i = index[room]
            if ctx.aborted:
                if ctx.acked_at is None and rank.mgr.is_abort_release_safe(room, ctx.required_acks):
                    ctx.acked_at = time.monotonic()
                    ack_wait.append(ctx.acked_at - ctx.t0)
                elif ctx.acked_at is None and time.monotonic() - ctx.t0 < plan.ack_timeout_s:
                    continue
                if ctx.acked_at is None:
                    unacked += 1
                outcomes[f"{fates[i]}:aborted"] += 1
                rank._release(room, ctx)
                finished()
                continue
            status = ctx.receiver.poll()
            if status == KVPoll.Success and not _aux_landed(pools, ctx.slot):
                status = KVPoll.Transferring
            if status not in (KVPoll.Success, KVPoll.Failed):
                if ctx.abort_after >= 0:
                    if ctx.polls >= ctx.abort_after:
                        rank._abort(ctx, keep=False)
                        ctx.t0 = time.monotonic()
                    ctx.polls += 1
                continue
            if status == KVPoll.Success:
                ctx.receiver.clear()
                v = verify_room(pools, ctx)
                if any(v.values()):
                    bad.append((room, v))
                outcomes[f"{fates[i]}:ok"] += 1
            else:
                try:
                    ctx.receiver.failure_exception()
                except Exception:
                    pass
                outcomes[f"{fates[i]}:failed"] += 1
            rank.page_pool.release(ctx.pages)
            rank.slots.append(ctx.slot)
            del active[room]
            finished()
        time.sleep(0.0005)
    t_end = time.monotonic()
    return {
        "done": done,
        "unfinished": len(pending) + len(active),
        "outcomes": dict(outcomes),
        "bad": bad[:10],
        "n_bad": len(bad),
        "unacked": unacked,
        "ack_wait_max_s": max(ack_wait, default=0.0),
        "ack_wait_p99_s": float(np.percentile(ack_wait, 99)) if ack_wait else 0.0,
        "ack_wait_slow": sorted(ack_wait)[-5:],
        "rss_warm": rss_warm,
        "rss_end": _rss_after_gc(),
        "tables_warm": tables_warm,
        "tables_end": _tables(rank.mgr),
        "wall_s": t_end - t_start,
        "steady_s": (t_end - t_warm) if t_warm else None,
    }


# ======================================================================================
# child entry point
# ======================================================================================

_ROLES = {"bootstrap": _BootstrapRank, "prefill": _PrefillRank, "decode": _DecodeRank}


class ForkedProc:
    """The part of ``subprocess.Popen`` these tests use, over a forked ``Process``."""

    def __init__(self, process: Any) -> None:
        self.process = process
        self.pid = process.pid

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(self.process.name, timeout or 0)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        if self.process.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def forked_main(conn: Connection, inherited: procs.Inherited, log_path: str) -> None:
    """A forked rank: the environment, session, output and directory ``Popen`` would give."""
    inherited.apply()
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(TESTS_DIR)
    serve(conn)


def child_main(fd: int) -> None:
    """A rank started as ``python -c`` (under ``ip netns exec``)."""
    serve(Connection(fd))


def serve(conn: Connection) -> None:
    init = conn.recv()
    spec, opts = init["spec"], init["opts"]
    deadline = time.monotonic() + float(init["lifetime_s"])
    logging.basicConfig(
        level=os.environ.get("SGLANG_NIXL_PLUGIN_BENCH_LOG", "WARNING"),
        format=f"%(asctime)s {spec.role}{spec.instance} %(name)s %(levelname)s: %(message)s",
    )
    # A hard deadline of its own: the process ends even if the test process vanished.
    signal.signal(signal.SIGALRM, lambda *_: os._exit(3))
    signal.alarm(int(init["lifetime_s"]) + 30)
    rank = None
    try:
        rank = _ROLES[spec.role](conn, spec, opts, deadline)
        rank.loop()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the test process went away
    except BaseException:
        try:
            conn.send(
                ("event", {"kind": "fatal", "t": time.time(), "error": traceback.format_exc()})
            )
        except Exception:
            pass
        traceback.print_exc()
    finally:
        try:
            if rank is not None:
                rank.close()
        except Exception:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


__all__ = [
    "FAULT_ENV",
    "FaultCluster",
    "NetnsPair",
    "RankDied",
    "RankProc",
    "SoakPlan",
    "make_requests",
    "netns_pair",
    "netns_unavailable",
    "poll_until",
]
