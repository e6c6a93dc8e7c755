"""A decode-like NIXL peer in its own process, driven over a pipe (``tests/component/test_engine.py``).

The peer allocates numpy DRAM buffers, creates a ``TransferEngine`` over them and sends its
agent metadata and buffer layout back; the test process then links to it and WRITEs into
it. On request the peer returns the bytes of its pages, drains its NIXL notifications, or
closes. Every wait is bounded: pipe round-trips have a timeout, and the peer exits by itself
when the test process goes away or stays silent for ``IDLE_EXIT_S``.

The same ``Buffers`` class lays out the test process's own (source) memory, so both sides
share one picture of where each page lives.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.engine import Memory
from sgl_nixl_plugin.engine.layout import RegionSet

#: Seconds a pipe round-trip (or the peer's start) may take before the test fails.
TIMEOUT_S = 60.0
#: The peer exits on its own after this long without a command (the test process is stuck).
IDLE_EXIT_S = 120.0
#: Bytes left between regions, so that no two regions are adjacent in memory and NIXL
#: cannot merge descriptors across them; the gaps also reveal writes outside any region.
GAP = 4096
#: Where NIXL's UCX backend may send traffic: loopback only.
UCX_ENV = {"UCX_NET_DEVICES": "lo"}


@dataclass(frozen=True)
class GroupSpec:
    """``regions`` buffers of ``items`` items (pages, aux rows, state slots) each."""

    regions: int
    items: int
    item_bytes: int


@dataclass(frozen=True)
class PeerSpec:
    """What a peer allocates; ``sentinel`` fills every byte of it until a WRITE lands."""

    kv: GroupSpec
    aux: GroupSpec | None = None
    state: tuple[GroupSpec, ...] = ()
    sentinel: int = 0xA5
    name: str | None = None
    scratch: bool = False  # also register the warm-up scratch buffer (a decode's)

    def groups(self) -> dict[str, GroupSpec]:
        out = {"kv": self.kv}
        if self.aux is not None:
            out["aux"] = self.aux
        out.update({f"state{i}": s for i, s in enumerate(self.state)})
        return out


class Buffers:
    """One group's regions in a single numpy DRAM allocation, ``GAP`` bytes apart."""

    def __init__(self, spec: GroupSpec, fill: int | None = None, seed: int | None = None) -> None:
        self.spec = spec
        self.region_bytes = spec.items * spec.item_bytes
        self.stride = self.region_bytes + GAP
        self.raw = np.empty(spec.regions * self.stride, dtype=np.uint8)
        if seed is not None:
            self.raw[:] = np.random.default_rng(seed).integers(0, 256, self.raw.size, np.uint8)
        else:
            self.raw.fill(0 if fill is None else fill)
        # items x item_bytes per region, as one (regions, items, item_bytes) strided view
        self.pages = np.lib.stride_tricks.as_strided(
            self.raw,
            shape=(spec.regions, spec.items, spec.item_bytes),
            strides=(self.stride, spec.item_bytes, 1),
            writeable=True,
        )

    @property
    def base(self) -> int:
        return int(self.raw.ctypes.data)

    def regions(self) -> RegionSet:
        n = self.spec.regions
        return RegionSet.of(
            [self.base + r * self.stride for r in range(n)],
            [self.region_bytes] * n,
            [self.spec.item_bytes] * n,
            "DRAM",
        )

    def gaps(self) -> np.ndarray:
        """Every byte that belongs to no region."""
        return self.raw.reshape(self.spec.regions, self.stride)[:, self.region_bytes :]

    def fill(self, value: int) -> None:
        self.raw.fill(value)


def empty_regions() -> RegionSet:
    return RegionSet.of([], [], [], "DRAM")


def allocate(
    spec: PeerSpec, *, fill: int | None = None, seed: int | None = None
) -> tuple[dict[str, Buffers], Memory]:
    """Buffers for every group of ``spec`` and the ``Memory`` over them.

    With ``seed`` every byte is random (a source); otherwise every byte is ``fill``
    (default: the spec's sentinel).
    """
    fill = spec.sentinel if fill is None else fill
    bufs = {
        g: Buffers(s, fill=fill, seed=None if seed is None else seed + i)
        for i, (g, s) in enumerate(spec.groups().items())
    }
    memory = Memory(
        bufs["kv"].regions(),
        bufs["aux"].regions() if "aux" in bufs else empty_regions(),
        tuple(bufs[f"state{i}"].regions() for i in range(len(spec.state))),
    )
    return bufs, memory


def memory_from_layout(layout: dict[str, tuple[list[int], list[int], list[int]]]) -> Memory:
    """The peer's ``Memory`` rebuilt in the test process from the (ptrs, lens, item_lens)."""

    def rs(group: str) -> RegionSet:
        if group not in layout:
            return empty_regions()
        ptrs, lens, item_lens = layout[group]
        return RegionSet.of(list(ptrs), list(lens), list(item_lens), "DRAM")

    n_state = sum(1 for g in layout if g.startswith("state"))
    return Memory(rs("kv"), rs("aux"), tuple(rs(f"state{i}") for i in range(n_state)))


# -- the peer process -------------------------------------------------------------------


def _serve(conn: Any, spec: PeerSpec) -> None:
    """The peer's main loop (runs in the child process)."""
    os.environ.update(UCX_ENV)  # before NIXL (and so UCX) is loaded in this process
    from sgl_nixl_plugin.engine.engine import TransferEngine
    from sgl_nixl_plugin.registry.spec import AgentConfig

    bufs, memory = allocate(spec)
    engine = TransferEngine(AgentConfig(), memory, name=spec.name, scratch=spec.scratch)
    closed = False
    try:
        layout = {
            g: (list(rs.ptrs), list(rs.lens), list(rs.item_lens))
            for g, rs in memory.groups().items()
        }
        sc = engine.scratch
        scratch = None if sc is None else (sc.ptrs[0], sc.lens[0])
        info = {"name": engine.name, "metadata": engine.metadata, "layout": layout}
        conn.send(("ok", {**info, "scratch": scratch}))
        idle_until = time.monotonic() + IDLE_EXIT_S
        while True:
            # A target must progress its agent for two-sided transports (UCX over TCP here),
            # as the decode listener does: every millisecond while waiting for a command.
            if not conn.poll(0.001):
                engine.agent.progress()
                if time.monotonic() > idle_until:
                    return
                continue
            idle_until = time.monotonic() + IDLE_EXIT_S
            try:
                op, args = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if op == "close":
                    engine.close()
                    closed = True
                    conn.send(("ok", dict(engine.agent.live)))
                    return
                reply = _handle(engine, bufs, spec, op, args)
            except Exception as exc:  # reported to the test, which raises PeerError
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send(("ok", reply))
    finally:
        if not closed:
            engine.close()
        conn.close()


def _handle(engine: Any, bufs: dict[str, Buffers], spec: PeerSpec, op: str, args: Any) -> Any:
    if op == "read":
        group, pages = args
        view = bufs[group].pages
        return view.copy() if pages is None else view[:, np.asarray(pages, np.int64)].copy()
    if op == "gaps_intact":
        (group,) = args
        return bool(np.all(bufs[group].gaps() == spec.sentinel))
    if op == "fill":
        (value,) = args
        for b in bufs.values():
            b.fill(spec.sentinel if value is None else value)
        return None
    if op == "notifs":
        return _drain(engine, *args)
    if op == "live":
        return dict(engine.agent.live)
    if op == "read_scratch":
        return engine._scratch.copy()
    raise ValueError(f"unknown peer command {op!r}")


def _drain(engine: Any, want: int, timeout: float, sender: str | None) -> dict[str, list[bytes]]:
    """Collect notifications until ``want`` (from ``sender``, or from anyone) or the deadline.

    ``want`` 0 drains for the whole ``timeout`` (to prove that nothing more arrives).
    """
    got: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + timeout
    while True:
        for name, msgs in engine.agent.notifications().items():
            got.setdefault(name, []).extend(bytes(m) for m in msgs)
        have = len(got.get(sender, [])) if sender else sum(map(len, got.values()))
        if (want and have >= want) or time.monotonic() >= deadline:
            return got
        time.sleep(0.001)  # a poll interval (yield the core to UCX), not synchronisation


# -- the test process's handle on a peer ------------------------------------------------------


class PeerError(RuntimeError):
    """The peer failed a command (its message), died, or did not answer in time."""


class PeerProcess:
    """A started peer; ``wait_ready`` (or any use) waits for its metadata."""

    def __init__(self, spec: PeerSpec, *, timeout: float = TIMEOUT_S) -> None:
        self.spec = spec
        self.timeout = timeout
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, spec), daemon=True)
        saved = {k: os.environ.get(k) for k in UCX_ENV}
        os.environ.update(UCX_ENV)  # the child inherits it from its very start
        try:
            self.proc.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            child.close()
        self._info: dict[str, Any] | None = None

    # -- protocol --------------------------------------------------------------------------
    def _recv(self, timeout: float | None, what: str) -> Any:
        timeout = self.timeout if timeout is None else timeout
        if not self._conn.poll(timeout):
            raise PeerError(f"peer did not answer {what} within {timeout:.0f}s")
        try:
            kind, payload = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise PeerError(f"peer died during {what} (exit code {self.proc.exitcode})") from exc
        if kind != "ok":
            raise PeerError(f"peer failed {what}: {payload}")
        return payload

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        self.wait_ready()
        try:
            self._conn.send((op, args))
        except (BrokenPipeError, OSError) as exc:
            raise PeerError(f"peer is gone (exit code {self.proc.exitcode})") from exc
        return self._recv(timeout, op)

    def wait_ready(self) -> PeerProcess:
        if self._info is None:
            self._info = self._recv(None, "start-up")
        return self

    # -- what the test needs ------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.wait_ready()._info["name"]  # type: ignore[index]

    @property
    def metadata(self) -> bytes:
        return self.wait_ready()._info["metadata"]  # type: ignore[index]

    @property
    def memory(self) -> Memory:
        return memory_from_layout(self.wait_ready()._info["layout"])  # type: ignore[index]

    @property
    def scratch(self) -> tuple[int, int] | None:
        """(address, length) of the peer's warm-up scratch buffer, when it has one."""
        return self.wait_ready()._info["scratch"]  # type: ignore[index]

    def read_scratch(self) -> np.ndarray:
        return self._call("read_scratch")

    def read(self, group: str = "kv", pages: Any = None) -> np.ndarray:
        """(regions, pages, item_bytes) copy of ``pages`` (all when None) of every region."""
        return self._call("read", group, None if pages is None else list(map(int, pages)))

    def gaps_intact(self, group: str = "kv") -> bool:
        """Whether every byte between this group's regions still holds the sentinel."""
        return self._call("gaps_intact", group)

    def fill(self, value: int | None = None) -> None:
        """Refill every buffer (regions and gaps) with ``value``, default the sentinel."""
        self._call("fill", value)

    def notifications(
        self, want: int = 0, timeout: float = 10.0, sender: str | None = None
    ) -> dict[str, list[bytes]]:
        """Drain notifications until ``want`` arrived (from ``sender``) or ``timeout`` passed."""
        return self._call("notifs", want, timeout, sender, timeout=timeout + self.timeout)

    def live(self) -> dict[str, int]:
        return self._call("live")

    def close(self) -> dict[str, int]:
        """Close the peer's engine (its live counts come back) and let the process exit."""
        live = self._call("close")
        self.proc.join(self.timeout)
        return live

    def kill(self) -> None:
        """SIGKILL: the peer vanishes without closing anything, like a crashed decode rank."""
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(self.timeout)

    def stop(self) -> None:
        """Always safe: a graceful close if possible, then kill; the process is joined."""
        try:
            if self.proc.is_alive() and self._info is not None:
                with contextlib.suppress(PeerError):
                    self.close()
        finally:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(self.timeout)
            self._conn.close()


@contextlib.contextmanager
def peers(*specs: PeerSpec, timeout: float = TIMEOUT_S) -> Iterator[list[PeerProcess]]:
    """Start every peer at once (start-up overlaps), wait until all are ready, stop them all."""
    started: list[PeerProcess] = []
    try:
        for spec in specs:
            started.append(PeerProcess(spec, timeout=timeout))
        for p in started:
            p.wait_ready()
        yield started
    finally:
        for p in started:
            p.stop()
