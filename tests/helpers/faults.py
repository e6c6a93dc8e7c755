"""Fault-injection orchestration for PD tests: rank processes the test steers step by step.

``bench.session`` runs a whole workload and reports at the end; failure tests need more
control: hold a room's last chunk so a kill lands mid-transfer, kill one process and time
what the others observe, restart a prefill on the same bootstrap server, abort from the
decode loop, run a soak inside one long-lived pair, or start ranks in network namespaces.

Each rank is a process forked from the bench's preloaded forkserver (``bench.procs``), or a
fresh interpreter under ``ip netns exec`` for a rank in a network namespace. It steps the
bench's own drivers (``PrefillDriver``, ``DecodeDriver``: pools, manager, allocators, the
byte patterns and checks), its rooms opened by commands sent over a socketpair
(``multiprocessing.connection``) instead of from the workload. It
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
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from helpers.waiting import poll_until
from sgl_nixl_plugin.adapter import harness
from sgl_nixl_plugin.bench import procs
from sgl_nixl_plugin.bench.decode_driver import DecodeDriver
from sgl_nixl_plugin.bench.pools import Pools
from sgl_nixl_plugin.bench.prefill_driver import PrefillDriver, PrefillRoom
from sgl_nixl_plugin.bench.rank import RankSpec, setup
from sgl_nixl_plugin.bench.session import LOOPBACK_ENV, free_port
from sgl_nixl_plugin.bench.workload import (
    AUX_ITEM_BYTES,
    Request,
    Workload,
    pattern,
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
        self.env = setup(spec)
        host = opts.get("bootstrap_host", "127.0.0.1")
        self.server = self.env["classes"]["bootstrap_server"](host=host, port=spec.bootstrap_port)
        self.emit("ready", pid=os.getpid(), port=spec.bootstrap_port)

    def close(self) -> None:
        self.server.close()


class _PrefillRank(_Rank):
    """The bench's prefill driver, its rooms opened by the test (``expect``) instead of
    from the workload, each room's arrival and end reported as events."""

    def __init__(
        self, conn: Connection, spec: RankSpec, opts: dict[str, Any], deadline: float
    ) -> None:
        super().__init__(conn, spec, opts, deadline)
        self.env = setup(spec)
        host = opts.get("bootstrap_host", "127.0.0.1")
        self.driver = PrefillDriver(spec, self.env, requests=[], bootstrap_host=host, reports=False)
        self.mgr = self.driver.mgr
        if opts.get("report_bound"):  # the decode's request reached this rank
            self.driver.on_bound = lambda room: self.emit("bound", room=room)
        self.driver.on_done = lambda room, res: self.emit(
            "done", room=room, ok=res["ok"], reason=res["reason"]
        )
        self.emit(
            "ready",
            pid=os.getpid(),
            ip=self.mgr.local_ip,
            port=self.mgr.rank_port,
            agent=self.mgr.engine.name,
            bootstrap_port=spec.bootstrap_port,
        )

    def close(self) -> None:
        self.driver.close()

    # -- commands ------------------------------------------------------------------------
    def do_expect(self, reqs: list[Request], plans: dict[int, str] | None = None) -> int:
        """Create a sender per request now (as SGLang does when the request arrives); a
        room planned ``hold`` sends every chunk but its last until ``release``."""
        plans = plans or {}
        for r in reqs:
            if self.driver.open(r, hold=plans.get(r.room) == "hold") is None:
                raise RuntimeError("prefill page pool exhausted")
        return len(self.driver.active)

    def do_release(self, rooms: list[int]) -> list[int]:
        """Send the held chunks of ``rooms`` (those still active); returns which were sent.
        A room whose sender has not started yet (its decode's request is still on its way)
        is released too: it sends every chunk when it starts, instead of holding its last
        one for good."""
        return [room for room in rooms if self.driver.release(room)]

    def do_held(self) -> list[int]:
        return self.driver.holding()

    def do_state(self) -> dict[str, Any]:
        mgr = self.mgr
        return {
            "tables": self.driver.tables(),
            "peers": sorted(mgr.prefill.ctx.peers.accepted),
            "watched": {
                ep: w.connected for ep, w in list(mgr.prefill.control.watch._peers.items())
            },
            "active": len(self.driver.active),
        }

    def do_soak(self, plan: SoakPlan) -> dict[str, Any]:
        return soak_prefill(self, plan)

    def step(self) -> bool:
        self.driver.step()
        return bool(self.driver.active)


class _DecodeRank(_Rank):
    """The bench's decode driver (its pools, manager, allocators, receivers, metadata gate
    and checks), its rooms started by the test (``submit``) and ended as fault tests need:
    aborts armed on landed bytes, pages snapshotted at the ack, quarantined failures."""

    def __init__(
        self, conn: Connection, spec: RankSpec, opts: dict[str, Any], deadline: float
    ) -> None:
        super().__init__(conn, spec, opts, deadline)
        self.env = setup(spec)
        self.driver = DecodeDriver(spec, self.env, requests=[], reports=False)
        self.KVPoll = self.driver.KVPoll
        self.pools, self.mgr = self.driver.pools, self.driver.mgr
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
        mgr, pools, driver = self.mgr, self.pools, self.driver
        if not mgr.try_ensure_parallel_info(addr):
            return f"no parallel info from {addr}"
        # the prefill DP rank that holds the room, as SGLang's decode picks it: 0 for a
        # prefill without DP attention, ``room % dp_size`` for one that follows the room
        dp_rank = harness.resolve_prefill_dp_rank(mgr, addr, r.room)
        if dp_rank is None:
            return f"no prefill DP rank known for room {r.room}"
        pool = driver.host_pool if r.host else driver.pool
        pages = pool.alloc(r.pages(pools.page_size), r.contiguous)
        if pages is None:
            return "decode page pool exhausted"
        if zero:
            for k in range(len(pools.kv_ptrs)):
                pools.region_words(k, r.host)[pages] = 0
        receiver, slot = driver.open_receiver(r, addr, dp_rank)
        if r.with_state:
            pools.state_row(slot)[:] = 0
        sent = pages[:-1] if short else pages
        if not metadata:
            sent = pages[:0]
        else:
            driver.send_metadata(receiver, r, sent, slot)
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
            "tables": self.driver.tables(),
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
                "aux_landed": self.driver.aux_landed(ctx.slot),
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
        (self.driver.host_pool if ctx.req.host else self.driver.pool).release(ctx.pages)
        self.driver.slots.append(ctx.slot)
        del self.active[room]

    def _release_safe(self, ctx: _DRoom) -> bool:
        """SGLang's drain check of an aborted room: for a host destination the receiver's
        (0.5.22+; 0.5.21 has only the manager's), else the manager's count of abort ACKs."""
        from sglang.srt.disaggregation.base.conn import BaseKVReceiver

        if ctx.req.host and hasattr(BaseKVReceiver, "is_abort_release_safe"):
            return bool(ctx.receiver.is_abort_release_safe())
        return bool(self.mgr.is_abort_release_safe(ctx.req.room, ctx.required_acks))

    def step(self) -> bool:
        for room, ctx in list(self.active.items()):
            self._step_room(room, ctx)
        while self.quarantine and self.quarantine[0][0] <= time.monotonic():
            _, pages, slot = self.quarantine.pop(0)
            self.driver.pool.release(pages)
            self.driver.slots.append(slot)
        return bool(self.active)

    def _step_room(self, room: int, ctx: _DRoom) -> None:
        if ctx.failed_at is not None:
            self._release_failed_host(room, ctx)
        elif ctx.aborted:
            self._check_acked(room, ctx)
        elif ctx.arm_from >= 0 and self._abort_if_landing(room, ctx):
            return
        else:
            status = ctx.receiver.poll()
            if status == self.KVPoll.Success and not self.driver.aux_landed(ctx.slot):
                return  # SGLang's metadata gate
            if status in (self.KVPoll.Success, self.KVPoll.Failed):
                self._finish(room, ctx, status == self.KVPoll.Success)

    def _release_failed_host(self, room: int, ctx: _DRoom) -> None:
        """SGLang's DecodeTransferQueue.resolve_deferred_releases for a host room: no
        timeout, only the receiver's word frees the pages."""
        assert ctx.failed_at is not None
        if self._release_safe(ctx):
            ctx.receiver.clear()
            self.driver.host_pool.release(ctx.pages)
            self.driver.slots.append(ctx.slot)
            del self.active[room]
            self.emit("host_released", room=room, held_s=time.time() - ctx.failed_at)

    def _check_acked(self, room: int, ctx: _DRoom) -> None:
        if ctx.acked_at is not None or not self._release_safe(ctx):
            return
        ctx.acked_at = time.time()
        if ctx.keep:
            ctx.snapshot = self._snap(ctx)
            ctx.snapshot_landed = int(page_matches(self.pools, room, ctx.pages, ctx.req.host).sum())
        self.emit("acked", room=room)
        if not ctx.keep:
            self._release(room, ctx)

    def _abort_if_landing(self, room: int, ctx: _DRoom) -> bool:
        started, whole = self._landing(ctx)
        if not started:
            return False
        ctx.landing_at_abort = whole
        self._abort(ctx, ctx.keep)
        self.emit("aborted", room=room, landing=whole, of=len(ctx.pages) - ctx.arm_from)
        return True

    def _finish(self, room: int, ctx: _DRoom, ok: bool) -> None:
        res: dict[str, Any] = {"ok": ok, "reason": None, "t0": ctx.t0}
        if not ok:
            if ctx.req.host:
                ctx.receiver.abort()  # SGLang's _abort_failed_transfer for a host room
            try:
                ctx.receiver.failure_exception()
            except Exception as exc:
                res["reason"] = str(exc)
            if ctx.req.host:
                ctx.failed_at = time.time()
                self.emit("done", room=room, **res)
                return
        else:
            ctx.receiver.clear()
            res.update(self.driver.verify(ctx.req, ctx.pages, ctx.slot))
        hold_s = float(self.opts.get("quarantine_failed_s", 0))
        if not ok and hold_s > 0:
            self.quarantine.append((time.monotonic() + hold_s, ctx.pages, ctx.slot))
        else:
            (self.driver.host_pool if ctx.req.host else self.driver.pool).release(ctx.pages)
            self.driver.slots.append(ctx.slot)
        del self.active[room]
        self.emit("done", room=room, **res)


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
    driver = rank.driver
    KVPoll = driver.KVPoll
    w = plan.workload
    reqs = w.make_requests()
    fates = [plan.fate(i) for i in range(len(reqs))]
    index = {r.room: i for i, r in enumerate(reqs)}
    pending = list(range(len(reqs)))
    pending.reverse()
    active = driver.active
    outcomes: Counter[str] = Counter()
    done = 0
    rss_warm = tables_warm = None
    t_start = time.monotonic()
    t_warm = None
    deadline = t_start + plan.time_limit_s
    while (pending or active) and time.monotonic() < deadline:
        while pending and len(active) < w.concurrency:
            if driver.open(reqs[pending[-1]]) is None:
                break
            pending.pop()
        for room, ctx in list(active.items()):
            i = index[room]
            status = ctx.sender.poll()
            if status == KVPoll.WaitingForInput and not ctx.sent:
                _soak_send(ctx, fates[i])
            elif status in (KVPoll.Success, KVPoll.Failed):
                ok = status == KVPoll.Success
                if ok:
                    ctx.sender.clear()
                else:
                    try:
                        ctx.sender.failure_exception()
                    except Exception:
                        pass
                outcomes[f"{fates[i]}:{'ok' if ok else 'failed'}"] += 1
                driver.pool.release(ctx.pages)
                driver.slots.append(ctx.slot)
                del active[room]
                done += 1
                if done == plan.warmup:
                    rss_warm, tables_warm, t_warm = (
                        _rss_after_gc(),
                        driver.tables(),
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
        "tables_end": driver.tables(),
        "peers": sorted(rank.mgr.prefill.ctx.peers.accepted),
        "wall_s": t_end - t_start,
        "steady_s": (t_end - t_warm) if t_warm else None,
    }


def _soak_send(ctx: PrefillRoom, fate: str) -> None:
    """A soak room's chunks once its decode's request arrived; a ``client_abort`` room
    aborts before its only chunk, or before the last of several."""
    r, sender = ctx.req, ctx.sender
    parts = r.split(ctx.pages)
    if fate == "client_abort" and len(parts) == 1:
        sender.abort()  # before any chunk was sent
        return
    ctx.sent = True
    sender.init(len(ctx.pages), ctx.slot)
    for k, part in enumerate(parts):
        last = k == len(parts) - 1
        if last and fate == "client_abort":
            sender.abort()  # mid-transfer: after the first chunk
            break
        state = [np.array([ctx.slot], dtype=np.int32)] if (last and r.with_state) else None
        sender.send(part.astype(np.int32), state_indices=state)


def soak_decode(rank: _DecodeRank, plan: SoakPlan) -> dict[str, Any]:
    return _DecodeSoak(rank, plan).run()


class _DecodeSoak:
    """The decode side of a soak: its own loop over the rank's rooms, each request's fate
    by its index (``SoakPlan.fate``)."""

    def __init__(self, rank: _DecodeRank, plan: SoakPlan) -> None:
        self.rank, self.plan = rank, plan
        self.reqs = plan.workload.make_requests()
        self.fates = [plan.fate(i) for i in range(len(self.reqs))]
        self.index = {r.room: i for i, r in enumerate(self.reqs)}
        self.rng = np.random.default_rng(plan.workload.seed + 5)
        self.pending = list(range(len(self.reqs)))
        self.pending.reverse()
        self.outcomes: Counter[str] = Counter()
        self.bad: list[tuple[int, dict[str, int]]] = []
        self.unacked = 0
        self.ack_wait: list[float] = []
        self.done = 0
        self.rss_warm: int | None = None
        self.tables_warm: dict[str, int] | None = None
        self.t_warm: float | None = None

    def run(self) -> dict[str, Any]:
        rank, active = self.rank, self.rank.active
        t_start = time.monotonic()
        deadline = t_start + self.plan.time_limit_s
        while (self.pending or active) and time.monotonic() < deadline:
            self._admit()
            for room, ctx in list(active.items()):
                if ctx.aborted:
                    self._aborted(room, ctx)
                else:
                    self._poll(room, ctx)
            time.sleep(0.0005)
        t_end = time.monotonic()
        ack_wait = self.ack_wait
        return {
            "done": self.done,
            "unfinished": len(self.pending) + len(active),
            "outcomes": dict(self.outcomes),
            "bad": self.bad[:10],
            "n_bad": len(self.bad),
            "unacked": self.unacked,
            "ack_wait_max_s": max(ack_wait, default=0.0),
            "ack_wait_p99_s": float(np.percentile(ack_wait, 99)) if ack_wait else 0.0,
            "ack_wait_slow": sorted(ack_wait)[-5:],
            "rss_warm": self.rss_warm,
            "rss_end": _rss_after_gc(),
            "tables_warm": self.tables_warm,
            "tables_end": rank.driver.tables(),
            "wall_s": t_end - t_start,
            "steady_s": (t_end - self.t_warm) if self.t_warm else None,
        }

    def _finished(self) -> None:
        self.done += 1
        if self.done == self.plan.warmup:
            self.rss_warm, self.tables_warm = _rss_after_gc(), self.rank.driver.tables()
            self.t_warm = time.monotonic()

    def _admit(self) -> None:
        rank, fates = self.rank, self.fates
        while self.pending and len(rank.active) < self.plan.workload.concurrency:
            i = self.pending[-1]
            r = self.reqs[i]
            why = rank.start_room(r, self.plan.addr, short=fates[i] == "mismatch", zero=False)
            if why == "decode page pool exhausted":
                break
            self.pending.pop()
            if why:
                self.outcomes[f"{fates[i]}:not_started"] += 1
                self._finished()
                continue
            if fates[i] in ("decode_abort", "client_abort"):
                rank.active[r.room].abort_after = int(self.rng.integers(0, 4))

    def _aborted(self, room: int, ctx: _DRoom) -> None:
        """Released once every prefill rank acked, or after ``ack_timeout_s`` without."""
        if ctx.acked_at is None and self.rank.mgr.is_abort_release_safe(room, ctx.required_acks):
            ctx.acked_at = time.monotonic()
            self.ack_wait.append(ctx.acked_at - ctx.t0)
        elif ctx.acked_at is None and time.monotonic() - ctx.t0 < self.plan.ack_timeout_s:
            return
        if ctx.acked_at is None:
            self.unacked += 1
        self.outcomes[f"{self.fates[self.index[room]]}:aborted"] += 1
        self.rank._release(room, ctx)
        self._finished()

    def _poll(self, room: int, ctx: _DRoom) -> None:
        rank, KVPoll = self.rank, self.rank.KVPoll
        fate = self.fates[self.index[room]]
        status = ctx.receiver.poll()
        if status == KVPoll.Success and not rank.driver.aux_landed(ctx.slot):
            status = KVPoll.Transferring
        if status not in (KVPoll.Success, KVPoll.Failed):
            if ctx.abort_after >= 0:
                if ctx.polls >= ctx.abort_after:
                    rank._abort(ctx, keep=False)
                    ctx.t0 = time.monotonic()
                ctx.polls += 1
            return
        if status == KVPoll.Success:
            ctx.receiver.clear()
            v = rank.driver.verify(ctx.req, ctx.pages, ctx.slot)
            if any(v.values()):
                self.bad.append((room, v))
            self.outcomes[f"{fate}:ok"] += 1
        else:
            try:
                ctx.receiver.failure_exception()
            except Exception:
                pass
            self.outcomes[f"{fate}:failed"] += 1
        rank.driver.pool.release(ctx.pages)
        rank.driver.slots.append(ctx.slot)
        del rank.active[room]
        self._finished()


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
