"""Chaos soak: requests flow in waves while a seeded scheduler of overlapping faults kills
and restarts prefill and decode ranks, cuts and restores a netns link, and fires garbage at
live ZMQ control sockets and at the bootstrap's HTTP port. A checker then judges every
request and every surviving process.

The run is one thread in the test process steering rank processes (``helpers.faults``):
it pumps their events, submits a wave when there is room, and fires the next fault when
it is due, so every time it records is ``time.time()`` on one host and faults, submissions
and outcomes compare directly. The rules the checker applies (:meth:`Chaos.judge`):

- a request is *hit* by a fault that concerns it (its prefill or decode was killed, or the
  link it crosses was cut) while it was in flight on that side: submitted, not yet ended;
- each side of a request whose process survived reports an outcome (else: a hang);
- a Success on the decode has every page, aux row and state row byte-exact;
- a Failure carries a reason and comes from a fault that hit that side, within
  ``fail_bound_s`` of it (a cut: within the liveness deadline plus that bound; a prefill
  sender the dead decode's request never reached: within SGLang's bootstrap timeout);
- a request no fault hit succeeds on both sides; garbage hits nothing.

At the end every surviving rank's room tables and NIXL transfer handles are empty, their
peers are the live ones, only killed processes died, no log holds a Python traceback, and
every garbage message was counted and logged by the process it reached.
"""

from __future__ import annotations

import random
import re
import socket
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_readable
from pathlib import Path
from typing import Any

import requests
import zmq

from helpers.faults import FaultCluster, NetnsPair, RankDied, RankProc
from helpers.hostile import garbage, mutate, random_request, raw_garbage
from helpers.prom import multiproc_registry, rejected_counts
from helpers.subproc import TIMEOUT_SCALE
from helpers.waiting import poll_until
from sgl_nixl_plugin.bench.session import free_port
from sgl_nixl_plugin.bench.workload import PRESETS, Request, Workload
from sgl_nixl_plugin.wire.codec import Codec
from sgl_nixl_plugin.wire.messages import Abort, AbortAck, PieceDone, Pong, TransferStatus

#: Tiny requests (1-8 pages of 16 tokens), at most 24 in flight per process.
#: Spare pages hold failed rooms' pages while they are quarantined (the netns run).
WORKLOAD = Workload(
    PRESETS["tiny"], page_size=16, max_tokens=128, concurrency=32, extra_pool_pages=768
)
TRACEBACK = "Traceback (most recent call last)"
#: Rejections the codec counts for a message that can never decode (test_hostile's list).
CODEC_REASONS = (
    "not_ours",
    "malformed",
    "protocol_version",
    "frame_count",
    "index_frame_size",
    "oversized",
    "duplicate_kv_frame",
    "unexpected",
)
HTTP_ALLOWED = {200, 400, 401, 404, 405, 413, 503}
GHOST = 4242  # rooms of the forged messages: no real room is this small


@dataclass(frozen=True)
class ChaosConfig:
    seconds: float
    seed: int
    netns: NetnsPair | None = None
    decodes: int = 2
    fault_gap_s: tuple[float, float] = (1.0, 3.5)
    overlap_p: float = 0.25  # chance that the next fault follows within 0.3 s
    restart_after_s: tuple[float, float] = (0.2, 1.5)
    cut_s: tuple[float, float] = (0.5, 3.0)
    fail_bound_s: float = 2.0 * TIMEOUT_SCALE
    bootstrap_timeout_s: int = 10  # SGLang reads it as an integer ("10.0" is not one)
    liveness: tuple[float, int] = (1.0, 30)  # loopback: a kill is seen by the connection watch
    max_in_flight: int = 24  # per process: the page pools hold 32 of the largest requests
    wave: tuple[int, int] = (2, 6)
    wave_gap_s: float = 0.02
    hold_p: float = 0.4  # waves whose two-chunk rooms wait for their last chunk
    hold_s: tuple[float, float] = (0.2, 2.0)
    prefill_first_p: float = 0.3
    start_timeout_s: float = 120.0 * TIMEOUT_SCALE
    ok_bound_s: float = 15.0 * TIMEOUT_SCALE  # a request no fault hit ends within this
    quarantine_failed_s: float = 0.0  # decode: reuse a failed room's pages after this long

    @property
    def cut_bound_s(self) -> float:
        interval, misses = self.liveness
        return interval * misses + self.fail_bound_s


@dataclass
class Fault:
    kind: str  # kill_prefill | kill_decode | cut | garbage_zmq | garbage_http
    target: str  # the rank process's name, "link" or "bootstrap"
    t: float
    t_end: float | None = None  # a cut: when the link came back
    n: int = 0  # garbage: messages sent


@dataclass
class Req:
    room: int
    prefill: str
    decode: str
    t0: float
    final: bool = False  # the recovery wave after the faults
    dec: dict[str, Any] | None = None  # the decode's "done" event
    pre: dict[str, Any] | None = None  # the prefill's "done" event
    bound_t: float | None = None  # the decode's request reached the prefill (its sender)
    not_started: str | None = None
    how: str = ""  # chunks, held, sender first: what the request went through


@dataclass
class Verdict:
    problems: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    latency: dict[str, float] = field(default_factory=dict)  # max fault -> failure, by kind


class Chaos:
    """One soak: its cluster, its ledger of requests and faults, and the checks."""

    def __init__(self, cfg: ChaosConfig, tmp: Path) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.grng = random.Random(cfg.seed + 1)  # garbage contents
        self.tmp = tmp
        interval, misses = cfg.liveness
        env = {
            "SGLANG_NIXL_PLUGIN_LIVENESS_INTERVAL": str(interval),
            "SGLANG_NIXL_PLUGIN_LIVENESS_MISSES": str(misses),
            "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(cfg.bootstrap_timeout_s),
        }
        if cfg.netns is not None:
            env["UCX_TLS"] = "tcp,self"
        self.cluster = FaultCluster(WORKLOAD, tmp, env)
        self.port = free_port()
        host = cfg.netns.addr[0] if cfg.netns else "127.0.0.1"
        self.addr = f"{host}:{self.port}"
        self.gen: Counter[str] = Counter()
        self.current: dict[str, RankProc | None] = {}
        self.starting: dict[str, tuple[RankProc, float]] = {}
        self.restart_at: dict[str, float] = {}
        self.spawned: dict[str, float] = {}
        self.restart_s: list[float] = []  # spawn to ready of restarted ranks
        self.reqs: dict[int, Req] = {}
        self.open: dict[str, set[int]] = defaultdict(set)  # rooms a process owes an outcome
        self.faults: list[Fault] = []
        self.cut: Fault | None = None
        self.cut_wanted = False
        self.aim: tuple[str, str] | None = None  # a kill waiting for its target to be busy
        self.aim_until = 0.0
        self.seen: dict[str, int] = defaultdict(int)
        self.problems: list[str] = []
        self.waves = 0
        self.held: list[tuple[float, str, list[int]]] = []  # (due, prefill, rooms)
        self.next_wave = 0.0
        self.zmq = zmq.Context()
        self.push: dict[str, Any] = {}
        self.garbage_sent: Counter[str] = Counter()  # never-decodable messages, by process
        self.mutated_sent: Counter[str] = Counter()
        self.http = requests.Session()
        self.http_refusals = 0
        self.http_sent = 0
        self.raw_sent = 0
        self.raw_complete = 0  # raw garbage with a whole head: the bootstrap must refuse it
        codec = Codec(None)
        self.bases = [
            codec.encode(PieceDone(GHOST + 1, "ghost", 1, 1)),
            codec.encode(Abort(GHOST + 2, "127.0.0.1", 1)),
            codec.encode(Pong("ghost", 1, "127.0.0.1", 1)),
            codec.encode(TransferStatus(GHOST + 3, 0, 0, "forged", "127.0.0.1", 1)),
            codec.encode(AbortAck(GHOST + 4, 0)),
        ]
        self.t_start = self.t_faults_end = 0.0
        self.tables: dict[str, dict[str, int]] = {}

    # -- processes ----------------------------------------------------------------------
    def _side(self, slot: str) -> int:
        return 1 if slot.startswith("decode") else 0

    def _spawn(self, slot: str) -> RankProc:
        name = f"{slot}.g{self.gen[slot]}"
        self.gen[slot] += 1
        prom = self.tmp / "prom" / name
        prom.mkdir(parents=True)
        env = {"PROMETHEUS_MULTIPROC_DIR": str(prom)}
        opts: dict[str, Any] = {}
        net = self.cfg.netns
        if net is not None:
            side = self._side(slot)
            env.update(SGLANG_HOST_IP=net.addr[side], UCX_NET_DEVICES=net.dev[side])
        c = self.cluster
        if slot == "boot":
            spec = c.spec("bootstrap", bootstrap_port=self.port)
            opts["bootstrap_host"] = "0.0.0.0" if net else "127.0.0.1"
        elif slot == "prefill":
            spec = c.spec("prefill", 0, bootstrap_port=self.port, serve_bootstrap=False)
            opts["report_bound"] = True
        else:
            spec = c.spec("decode", int(slot[len("decode") :]))
            if self.cfg.quarantine_failed_s:
                opts["quarantine_failed_s"] = self.cfg.quarantine_failed_s
        lifetime = self.cfg.seconds + 300 * TIMEOUT_SCALE
        return c.add(
            name,
            spec,
            env=env,
            netns=net.ns[self._side(slot)] if net else None,
            opts=opts,
            lifetime_s=lifetime,
        )

    def start(self) -> None:
        """Bootstrap, prefill and decodes, all started at once, then ready."""
        slots = ["boot", "prefill", *(f"decode{i}" for i in range(self.cfg.decodes))]
        procs = {s: self._spawn(s) for s in slots}
        for s, p in procs.items():
            p.wait_ready(self.cfg.start_timeout_s)
            self.current[s] = p

    def _live(self) -> list[RankProc]:
        return [
            p
            for p in self.cluster.ranks.values()
            if p.killed_at is None and p.conn is not None and p.alive()
        ]

    def _pump(self, timeout: float) -> None:
        """Wait up to ``timeout`` for any rank to say something, then take every event."""
        live = self._live()
        if live:
            wait_readable([p.conn for p in live], timeout)
        for p in self.cluster.ranks.values():
            if p.conn is None or p.killed_at is not None:
                continue
            try:
                p._pump(0)
            except RankDied:
                self.problems.append(f"{p.name} died without being killed (exit {p.proc.poll()})")
                p.killed_at = -1.0  # noted once; never counts as a kill
            self._take(p)

    def _take(self, p: RankProc) -> None:
        events = p._events
        for e in events[self.seen[p.name] :]:
            kind = e["kind"]
            if kind == "fatal":
                self.problems.append(f"{p.name} fatal: {e['error'][-2000:]}")
            req = self.reqs.get(e.get("room", -1))
            if req is None:
                continue
            if kind == "bound":
                req.bound_t = e["t"]
            elif kind == "done":
                which = "dec" if p.spec.role == "decode" else "pre"
                if getattr(req, which) is not None:
                    self.problems.append(f"room {req.room}: two outcomes on {p.name}")
                setattr(req, which, e)
                self.open[p.name].discard(req.room)
        self.seen[p.name] = len(events)

    # -- traffic ------------------------------------------------------------------------
    def _request(self) -> Request:
        tokens = self.rng.randint(8, WORKLOAD.max_tokens)
        # Two chunks only with two pages or more: SGLang's sender calls a chunk last when it
        # reaches the page count, so a one-page room's first chunk would be its last.
        chunks = self.rng.choice((1, 1, 2)) if tokens > WORKLOAD.page_size else 1
        return Request(self.rng.getrandbits(62) + GHOST + 100, tokens, chunks, False, True)

    def wave(self, slot: str, n: int, final: bool = False) -> list[Req]:
        """``n`` requests from decode ``slot`` to the prefill. Some waves have the prefill
        hold each room's last chunk for a while (so faults find rooms mid-transfer), some
        create the senders before the decode asks (SGLang sees either first)."""
        p, d = self.current["prefill"], self.current[slot]
        assert p is not None and d is not None
        reqs = [self._request() for _ in range(n)]
        hold = not final and self.rng.random() < self.cfg.hold_p
        plans = {r.room: "hold" for r in reqs if r.chunks > 1} if hold else {}
        if plans:
            due = time.monotonic() + self.rng.uniform(*self.cfg.hold_s)
            self.held.append((due, p.name, sorted(plans)))
        prefill_first = not final and self.rng.random() < self.cfg.prefill_first_p
        t0 = time.time()
        if prefill_first:
            p.call("expect", reqs=reqs, plans=plans, timeout=60 * TIMEOUT_SCALE)
        refused = d.call("submit", reqs=reqs, addr=self.addr, timeout=60 * TIMEOUT_SCALE)
        out = []
        for r in reqs:
            q = Req(r.room, p.name, d.name, t0, final)
            q.how = (
                f"{r.chunks} chunk(s), {r.tokens} tokens"
                + (", held" if r.room in plans else "")
                + (", sender first" if prefill_first else "")
            )
            self.reqs[r.room] = q
            out.append(q)
            if r.room in refused:
                q.not_started = refused[r.room]
            else:
                self.open[d.name].add(r.room)
                self.open[p.name].add(r.room)
        started = [r for r in reqs if r.room not in refused]
        if started and not prefill_first:
            p.call("expect", reqs=started, plans=plans, timeout=60 * TIMEOUT_SCALE)
        self.waves += 1
        return out

    def _traffic(self, now: float) -> None:
        p = self.current.get("prefill")
        if p is None or self.cut is not None or now < self.next_wave:
            return
        slots = [s for s in self._decode_slots() if self.current.get(s) is not None]
        if not slots:
            return
        slot = slots[self.waves % len(slots)]
        d = self.current[slot]
        assert d is not None
        n = self.rng.randint(*self.cfg.wave)
        cap = self.cfg.max_in_flight
        if len(self.open[p.name]) + n > cap or len(self.open[d.name]) + n > cap:
            return
        self.wave(slot, n)
        self.next_wave = now + self.cfg.wave_gap_s

    def _release(self, everything: bool = False) -> None:
        """Send the held last chunks that are due (on a prefill still alive)."""
        now = time.monotonic()
        keep = []
        for due, name, rooms in self.held:
            if not everything and now < due:
                keep.append((due, name, rooms))
            elif self._is_live(name):
                self.cluster.ranks[name].call("release", rooms=rooms, timeout=60 * TIMEOUT_SCALE)
        self.held = keep

    def _decode_slots(self) -> list[str]:
        return [f"decode{i}" for i in range(self.cfg.decodes)]

    # -- faults -------------------------------------------------------------------------
    def _kill(self, slot: str, kind: str) -> None:
        p = self.current[slot]
        assert p is not None
        self._pump(0)  # outcomes it already reported count
        t = p.kill()
        self.faults.append(Fault(kind, p.name, t))
        try:
            p._pump(0)  # what it sent before it died
        except RankDied:
            pass
        self._take(p)
        self.current[slot] = None
        sock = self.push.pop(p.name, None)
        if sock is not None:
            sock.close(0)
        self.restart_at[slot] = time.monotonic() + self.rng.uniform(*self.cfg.restart_after_s)

    def _garbage_zmq(self) -> None:
        targets = [p for s, p in self.current.items() if p is not None and s != "boot"]
        p = self.rng.choice(targets)
        sock = self.push.get(p.name)
        if sock is None:
            sock = self.push[p.name] = self.zmq.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.connect(f"tcp://{p.info['ip']}:{p.info['port']}")
        n = self.rng.randint(20, 80)
        for _ in range(n):
            if self.grng.random() < 0.5:
                frames = garbage(self.grng)
                self.garbage_sent[p.name] += 1
            else:
                frames = mutate(self.grng, list(self.grng.choice(self.bases)))
                self.mutated_sent[p.name] += 1
            sock.send_multipart(frames, zmq.NOBLOCK)
        self.faults.append(Fault("garbage_zmq", p.name, time.time(), n=n))

    def _garbage_http(self) -> None:
        t = time.time()
        url = f"http://127.0.0.1:{self.port}"
        n = self.rng.randint(10, 30)
        for _ in range(n):
            method, path, body = random_request(self.grng)
            try:
                r = self.http.request(method, url + path, data=body, timeout=10 * TIMEOUT_SCALE)
            except requests.RequestException as exc:
                self.problems.append(f"bootstrap did not answer {method} {path[:60]}: {exc}")
                continue
            self.http_sent += 1
            if r.status_code not in HTTP_ALLOWED or TRACEBACK in r.text:
                self.problems.append(f"{method} {path[:60]} -> {r.status_code}: {r.text[:200]}")
            if 400 <= r.status_code < 500:
                self.http_refusals += 1
        for raw in raw_garbage(self.grng, self.rng.randint(2, 6)):
            with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                while s.recv(65536):
                    pass
            self.raw_sent += 1
            # a prefix of a request (no blank line) is no request: the server just sees
            # the connection close, and neither answers nor counts it
            self.raw_complete += b"\r\n\r\n" in raw
        self.faults.append(Fault("garbage_http", "bootstrap", t, n=n))

    def _cut(self) -> None:
        net = self.cfg.netns
        assert net is not None
        t = time.time()
        net.link(0, "down")
        self.cut = Fault("cut", "link", t)
        self.faults.append(self.cut)
        self.restart_at["link"] = time.monotonic() + self.rng.uniform(*self.cfg.cut_s)

    def _restore(self) -> None:
        net = self.cfg.netns
        assert net is not None and self.cut is not None
        net.link(0, "up")
        self.cut.t_end = time.time()
        self.cut = None

    def _aim(self, slot: str, kind: str) -> None:
        """Kill ``slot`` once it has rooms in flight (within 1 s): a kill of an idle rank
        tests little."""
        p = self.current[slot]
        if p is None:
            self.aim = None
            return
        if self.open[p.name] or time.monotonic() > self.aim_until:
            self.aim = None
            self._kill(slot, kind)
        else:
            self.aim = (slot, kind)

    def _fault(self) -> None:
        if self.cut_wanted:
            if not self.starting:  # a rank that is starting needs its device up
                self.cut_wanted = False
                self._cut()
            return
        choices: list[tuple[str, float]] = []
        kills = 1.0 if self.cfg.netns is None else 0.4  # (netns: leave room for cuts)
        if self.current.get("prefill") is not None:
            choices.append(("kill_prefill", 1.2 * kills))
        if any(self.current.get(s) is not None for s in self._decode_slots()):
            choices.append(("kill_decode", 1.6 * kills))
        if self.cfg.netns is None:
            if any(p is not None for s, p in self.current.items() if s != "boot"):
                choices.append(("garbage_zmq", 0.8))
            choices.append(("garbage_http", 0.4))
        elif self.cut is None:
            choices.append(("cut", 1.0))
        if not choices:
            return
        kind = self.rng.choices([k for k, _ in choices], [w for _, w in choices])[0]
        if kind == "kill_prefill":
            self.aim_until = time.monotonic() + 1.0
            self._aim("prefill", kind)
        elif kind == "kill_decode":
            slots = [s for s in self._decode_slots() if self.current.get(s) is not None]
            self.aim_until = time.monotonic() + 1.0
            self._aim(self.rng.choice(slots), kind)
        elif kind == "garbage_zmq":
            self._garbage_zmq()
        elif kind == "garbage_http":
            self._garbage_http()
        elif self.starting:
            self.cut_wanted = True
        else:
            self._cut()

    def _recover(self) -> None:
        """Restarts and link restores that are due; restarted ranks that became ready."""
        now = time.monotonic()
        for slot, due in list(self.restart_at.items()):
            if now < due or (slot != "link" and self.cut is not None):
                continue  # UCX can't start on a namespace whose only device is down
            del self.restart_at[slot]
            if slot == "link":
                self._restore()
            else:
                self.starting[slot] = (self._spawn(slot), now + self.cfg.start_timeout_s)
                self.spawned[slot] = now
        for slot, (p, deadline) in list(self.starting.items()):
            if any(e["kind"] in ("ready", "fatal") for e in p._events):
                p.wait_ready(1)
                del self.starting[slot]
                self.current[slot] = p
                self.restart_s.append(now - self.spawned.pop(slot))
            elif now > deadline:
                raise TimeoutError(f"{p.name} not ready after a restart\n{p.log_tail()}")

    # -- the run ------------------------------------------------------------------------
    def run(self) -> None:
        cfg = self.cfg
        self.t_start = time.monotonic()
        end = self.t_start + cfg.seconds
        next_fault = self.t_start + self.rng.uniform(*cfg.fault_gap_s)
        while time.monotonic() < end:
            self._pump(0.02)
            self._recover()
            now = time.monotonic()
            if self.aim is not None:
                self._aim(*self.aim)
            elif now >= next_fault:
                self._fault()
                overlap = self.rng.random() < cfg.overlap_p
                next_fault = now + (
                    self.rng.uniform(0.0, 0.3) if overlap else self.rng.uniform(*cfg.fault_gap_s)
                )
            self._release()
            self._traffic(now)
        self.t_faults_end = time.monotonic()
        self._release(everything=True)
        self._settle()

    def _settle(self) -> None:
        """No more faults: restore, restart, let every request end, then one recovery wave
        per decode that must arrive byte-exact."""
        for slot in list(self.restart_at):
            self.restart_at[slot] = 0.0
        deadline = time.monotonic() + self.cfg.start_timeout_s
        while self.restart_at or self.starting:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still starting: {sorted(self.starting)}")
            self._pump(0.05)
            self._recover()
        self._wait_open(self.cfg.bootstrap_timeout_s + self.cfg.cut_bound_s + 10)
        for slot in self._decode_slots():
            self.wave(slot, 4, final=True)
        self._wait_open(30 * TIMEOUT_SCALE)

    def _wait_open(self, timeout: float) -> None:
        """Bounded: until no live process owes an outcome (the checker names what's left)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._pump(0.05)
            owed = [n for n, rooms in self.open.items() if rooms and self._is_live(n)]
            if not owed:
                return

    def _is_live(self, name: str) -> bool:
        p = self.cluster.ranks[name]
        return p.killed_at is None and p.alive()

    # -- checks -------------------------------------------------------------------------
    def judge(self) -> Verdict:
        """Every request against the rules in the module docstring."""
        v = Verdict(list(self.problems))
        lat: dict[str, float] = defaultdict(float)
        for q in self.reqs.values():
            if q.not_started:
                v.problems.append(f"room {q.room} not started on {q.decode}: {q.not_started}")
                v.outcomes["not_started"] += 1
                continue
            v.outcomes[self._judge_side(q, "dec", v, lat)] += 1
            v.outcomes["prefill:" + self._judge_side(q, "pre", v, lat)] += 1
            if q.final and not (q.dec and q.dec["ok"] and q.pre and q.pre["ok"]):
                v.problems.append(f"room {q.room} of the recovery wave: {q.dec} / {q.pre}")
        v.latency = dict(lat)
        return v

    def _room_state(self, q: Req, name: str) -> str:
        """What a live decode knows of a room it never ended (evidence for the report)."""
        if not name.startswith("decode") or not self._is_live(name):
            return ""
        try:
            state = self.cluster.ranks[name].call("room", room=q.room, timeout=10)
        except Exception as exc:
            return f"; its state could not be read: {exc!r}"
        return f"; on {name}: {state}"

    def _in_flight(self, q: Req, f: Fault, t_end: float) -> bool:
        """Whether ``f`` happened while ``q`` was in flight. A cut lasts until the path is
        proven good again: TCP retransmits after a restore with its backed-off timer, so
        pings may go unanswered for up to a liveness deadline after the link is back."""
        if f.kind != "cut":
            return q.t0 <= f.t <= t_end
        interval, misses = self.cfg.liveness
        until = (f.t_end if f.t_end is not None else float("inf")) + interval * misses
        return f.t <= t_end and q.t0 <= until

    def _relevant(self, q: Req, side: str, f: Fault) -> bool:
        if f.kind == "cut":
            return True
        if side == "dec":
            return f.kind == "kill_prefill" and f.target == q.prefill
        return f.kind == "kill_decode" and f.target == q.decode

    def _allowed(self, q: Req, side: str, f: Fault) -> float:
        """The latest time ``q``'s ``side`` may end after fault ``f`` hit it.

        A link back before the liveness deadline gives no side up: the room goes on once TCP
        resends what the cut held, on its backed-off timer (resends at 0.2, 0.6, 1.4, 3.0 s
        after a segment's first send; a new connection's SYN at 1, 3, 7 s). The resend can
        come up to as long after the restore as the cut lasted, plus a second: a 1.5 s cut of
        a NIXL WRITE stream between two namespaces held every WRITE until 3.2-3.3 s after
        it began (its WRITEs took 2.9-3.2 s)."""
        bound = self.cfg.cut_bound_s if f.kind == "cut" else self.cfg.fail_bound_s
        allowed = max(f.t, q.t0) + bound
        interval, misses = self.cfg.liveness
        if f.kind == "cut" and f.t_end is not None and f.t_end - f.t < interval * misses:
            resent = f.t_end + (f.t_end - f.t) + 1.0
            allowed = max(allowed, resent + self.cfg.fail_bound_s)
        if side == "pre" and (q.bound_t is None or q.bound_t > f.t):
            # the decode's request never reached this sender: only SGLang's bootstrap
            # timeout can end it
            allowed = max(allowed, q.t0 + self.cfg.bootstrap_timeout_s + self.cfg.fail_bound_s)
        return allowed

    def _latest(self, q: Req, side: str, faults: list[Fault]) -> float:
        return max(self._allowed(q, side, f) for f in faults)

    def _judge_side(self, q: Req, side: str, v: Verdict, lat: dict[str, float]) -> str:
        ev = q.dec if side == "dec" else q.pre
        name = q.decode if side == "dec" else q.prefill
        proc = self.cluster.ranks[name]
        if ev is None:
            killed = proc.killed_at
            if killed is not None and killed >= q.t0:
                # lost with its process, unless it should have ended before the kill
                earlier = [
                    f
                    for f in self.faults
                    if self._relevant(q, side, f) and self._in_flight(q, f, killed)
                ]
                due = self._latest(q, side, earlier) if earlier else q.t0 + self.cfg.ok_bound_s
                if killed <= due:
                    return "lost with its killed process"
                v.problems.append(
                    f"room {q.room}: no outcome on {name} in {due - q.t0:.1f}s, until it was "
                    f"killed {killed - q.t0:.1f}s after the request (hung): {q}"
                )
                return "hung"
            v.problems.append(
                f"room {q.room}: no outcome on {name} (hung): {q}{self._room_state(q, name)}"
            )
            return "hung"
        t_end = ev["t"]
        hits = [
            f for f in self.faults if self._relevant(q, side, f) and self._in_flight(q, f, t_end)
        ]
        if ev["ok"]:
            if side == "dec":
                bad = {k: ev[k] for k in ("bad_pages", "bad_aux", "bad_state") if ev.get(k)}
                if bad or "bad_pages" not in ev:
                    v.problems.append(
                        f"room {q.room} ({q.how}): Success on {name} with wrong bytes {bad}"
                    )
            return "ok (hit)" if hits else "ok"
        reason = (ev.get("reason") or "").strip()
        if not reason:
            v.problems.append(f"room {q.room}: Failed on {name} without a reason")
        if not hits:
            v.problems.append(f"room {q.room}: Failed on {name} with no fault: {reason[:300]}")
            return "failed: no fault"
        # it may come from any fault that hit it: the first whose bound it keeps (a cut,
        # then the prefill's kill that ended the rooms the cut held), else the first
        f = next((h for h in hits if t_end <= self._allowed(q, side, h)), hits[0])
        allowed = self._latest(q, side, hits)
        key = f.kind
        if side == "pre" and (q.bound_t is None or q.bound_t > f.t):
            key += " (bootstrap timeout)"
        key = f"{'decode' if side == 'dec' else 'prefill'} after {key}"
        late = t_end - f.t
        lat[key] = max(lat[key], late)
        if t_end > allowed:
            v.problems.append(
                f"room {q.room}: Failed on {name} {late:.2f}s after {f.kind} of {f.target} "
                f"(bound {allowed - f.t:.2f}s): {reason[:200]}"
            )
        return f"failed after {f.kind}"

    def check_survivors(self, v: Verdict) -> None:
        """Drained tables and handles, live peers only, every survivor still alive."""
        for p in self.cluster.ranks.values():
            if p.killed_at is None and not p.alive():
                v.problems.append(f"{p.name} died without being killed (exit {p.proc.poll()})")
        pre = self.current["prefill"]
        decs = [self.current[s] for s in self._decode_slots()]
        assert pre is not None and all(d is not None for d in decs)
        want_peers = sorted(d.info["agent"] for d in decs if d is not None)
        ep = (pre.info["ip"], pre.info["port"])

        def pre_clean(st: dict[str, Any]) -> bool:
            t = st["tables"]
            return (
                not _room_tables(t)
                and t.get("nixl.xfer", 0) == 0
                and st["active"] == 0
                and st["peers"] == want_peers
                and set(st["watched"]) <= {(d.info["ip"], d.info["port"]) for d in decs if d}
            )

        def dec_clean(st: dict[str, Any]) -> bool:
            t = st["tables"]
            return (
                not _room_tables(t)
                and t.get("nixl.xfer", 0) == 0
                and st["active"] == 0
                and st["known"] == [ep]
                and set(st["watched"]) <= {ep}
                and set(st["sockets"]) <= {f"tcp://{ep[0]}:{ep[1]}"}
            )

        for p, clean in [(pre, pre_clean), *((d, dec_clean) for d in decs)]:
            assert p is not None
            try:
                st, _ = poll_until(lambda p=p: p.call("state"), clean, 15 * TIMEOUT_SCALE, 0.1)
            except TimeoutError as exc:
                v.problems.append(f"{p.name} did not drain: {exc}")
                st = p.call("state")
            self.tables[p.name] = st["tables"]

    def check_garbage(self, v: Verdict) -> None:
        """Every never-decodable message reaching a survivor was counted, every reason it
        counted is in its log, nothing turned into an internal error."""
        for name, sent in self.garbage_sent.items():
            if not self._is_live(name):
                continue
            prom = self.tmp / "prom" / name

            def codec(prom: Path = prom) -> int:
                c = rejected_counts(multiproc_registry(prom))
                return int(sum(c[k] for k in CODEC_REASONS))

            try:
                poll_until(codec, lambda n, sent=sent: n >= sent, 20 * TIMEOUT_SCALE, 0.2)
            except TimeoutError as exc:
                v.problems.append(f"{name}: {sent} garbage messages sent, counted: {exc}")
            counts = rejected_counts(multiproc_registry(prom))
            if counts["internal_error"]:
                v.problems.append(f"{name}: internal errors on garbage: {counts}")
            log = self.cluster.ranks[name].log_path.read_text(errors="replace")
            for reason, n in counts.items():
                if n and not re.search(rf"dropped control message from .+?: {reason}\b", log):
                    v.problems.append(f"{name}: {n} rejections '{reason}' and no log line")
        if not self.http_sent:
            return
        boot = self.current["boot"]
        assert boot is not None
        counts = rejected_counts(multiproc_registry(self.tmp / "prom" / boot.name))
        http = {k: int(n) for k, n in counts.items() if k.startswith("http_")}
        framing = http.pop("http_bad_framing", 0)
        log = boot.log_path.read_text(errors="replace")
        lines = len(re.findall(r"sgl-nixl bootstrap: 4\d\d for [A-Z]+ ", log))
        malformed = log.count("for a malformed HTTP request from")
        if sum(http.values()) != self.http_refusals:
            v.problems.append(f"bootstrap counted {http}, {self.http_refusals} 4xx answers seen")
        if lines != sum(http.values()):
            v.problems.append(
                f"bootstrap: {sum(http.values())} refusals {http} and {lines} log lines"
            )
        if malformed != framing or not self.raw_complete <= framing <= self.raw_sent:
            v.problems.append(
                f"bootstrap: {framing} bad framings, {malformed} log lines, for "
                f"{self.raw_sent} raw sent ({self.raw_complete} with a whole head)"
            )

    def check_logs(self, v: Verdict) -> None:
        """After ``close``: no Python traceback in any rank's log, killed ones included."""
        for p in self.cluster.ranks.values():
            text = p.log_path.read_text(errors="replace")
            if TRACEBACK in text:
                i = text.index(TRACEBACK)
                v.problems.append(f"{p.name} logged a traceback:\n{text[i : i + 3000]}")

    def summary(self, v: Verdict) -> str:
        kinds = Counter(f.kind for f in self.faults)
        dec = {k: n for k, n in v.outcomes.items() if not k.startswith("prefill:")}
        pre = {k[8:]: n for k, n in v.outcomes.items() if k.startswith("prefill:")}
        wall = self.t_faults_end - self.t_start
        lines = [
            f"chaos soak: seed {self.cfg.seed}, {wall:.0f}s of faults"
            f"{' (netns, link cuts)' if self.cfg.netns else ' (127.0.0.1)'}, "
            f"{len(self.reqs)} requests in {self.waves} waves ({len(self.reqs) / wall:.0f}/s)",
            f"  faults: {dict(kinds)}; processes started: {dict(self.gen)}, restarts ready "
            f"in {min(self.restart_s, default=0):.1f}-{max(self.restart_s, default=0):.1f}s",
            f"  decode outcomes: {dec}",
            f"  prefill outcomes: {pre}",
            "  max fault -> failure: "
            + (", ".join(f"{k} {s:.2f}s" for k, s in sorted(v.latency.items())) or "none"),
            f"  garbage: ZMQ {sum(self.garbage_sent.values())} undecodable + "
            f"{sum(self.mutated_sent.values())} mutated, HTTP {self.http_sent} requests "
            f"({self.http_refusals} refused) + {self.raw_sent} raw",
            f"  problems: {len(v.problems)}",
        ]
        return "\n".join(lines)

    def close(self) -> None:
        for sock in self.push.values():
            sock.close(0)
        self.zmq.term()
        self.http.close()
        self.cluster.close()


def _room_tables(tables: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in tables.items() if not k.startswith(("nixl.", "count.")) and v}
