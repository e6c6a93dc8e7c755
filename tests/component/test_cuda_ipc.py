"""CUDA IPC mappings of a peer's KV pool (``engine.cuda_ipc``) and the one-pass copy
through them.

CPU: the module imports without torch or cuda.bindings; ``available()`` is False without a
GPU; ``why_not`` refuses another host and our own process before touching CUDA; address
translation over unsorted blocks; a closed mapping; the exporter's identity as a spawned
process sees it.
CPU with a fake CUDA: the export/open/close call sequence, device restore, rollback.
GPU (skipped without CUDA, cuda.bindings or triton): a spawned process exports a paged
bf16 pool of several layers; this process maps it and writes random pages into it with
``TritonCopier.pair_copy`` (page sizes 1 and 16, head slices); the exporter checks its
bytes. Then a failed open leaves nothing open, and a range past its allocation is refused.
"""

from __future__ import annotations

import ctypes
import importlib.util
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sgl_nixl_plugin.engine import cuda_ipc
from sgl_nixl_plugin.engine.cuda_ipc import (
    IpcBlock,
    IpcError,
    IpcExport,
    IpcMapping,
    _translate,
    host_identity,
    open_mappings,
    why_not,
)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _export(host: str | None = None, pid: int | None = None, blocks=()) -> IpcExport:
    return IpcExport(
        host_identity() if host is None else host,
        "GPU-00000000-0000-0000-0000-000000000000",
        os.getpid() if pid is None else pid,
        tuple(blocks),
    )


# -- CPU -----------------------------------------------------------------------------------------


def test_importing_cuda_ipc_imports_neither_torch_nor_cuda_bindings() -> None:
    code = (
        "import sys, sgl_nixl_plugin.engine.cuda_ipc as m; m.host_identity(); "
        "bad = [k for k in ('torch', 'triton', 'cuda', 'cuda.bindings') if k in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_without_a_gpu_ipc_is_unavailable_and_says_why() -> None:
    if _cuda_available():
        pytest.skip("a CUDA device is present: this is the path for machines without one")
    assert cuda_ipc.available() is False
    crafted = _export(pid=os.getpid() + 1, blocks=[IpcBlock(bytes(64), 1 << 32, 4096)])
    assert "no CUDA" in why_not(crafted, 0)
    with pytest.raises(IpcError, match="no CUDA.*staged/direct path"):
        cuda_ipc.open_export(crafted, 0)
    with pytest.raises(IpcError, match="staged/direct path"):  # no device, or no driver
        cuda_ipc.export_ranges([(1 << 32, 64)], 0)
    assert open_mappings() == 0


def test_why_not_refuses_another_host_and_our_own_process_before_cuda() -> None:
    block = IpcBlock(bytes(64), 1 << 32, 4096)
    assert why_not(_export(host="elsewhere", pid=1, blocks=[block]), 0) == "another host"
    assert why_not(_export(blocks=[block]), 0).startswith("same process")
    assert why_not(_export(pid=os.getpid() + 1), 0) == "nothing exported"


def test_host_identity_is_stable_and_names_the_boot() -> None:
    ident = host_identity()
    assert ident and ident == host_identity()
    boot = Path("/proc/sys/kernel/random/boot_id")
    if boot.exists():
        assert ident.startswith(boot.read_text().strip())


def test_exports_pickle_and_errors_say_the_fallback() -> None:
    e = _export(pid=7, blocks=[IpcBlock(bytes(range(64)), 1 << 32, 1 << 21)])
    assert pickle.loads(pickle.dumps(e)) == e
    assert "staged/direct path is used instead" in str(IpcError("x failed"))


def test_translate_maps_each_address_into_its_block() -> None:
    remote = np.array([0x1000_0000, 0x2000_0000, 0x7000_0000], dtype=np.uint64)
    sizes = np.array([0x10_0000, 0x20_0000, 0x1000], dtype=np.uint64)
    local = np.array([0x9000_0000, 0x5000_0000, 0xA000_0000], dtype=np.uint64)
    ptrs = np.array([0x1000_0000, 0x200F_FFFC, 0x1000_0010, 0x7000_0FFF], dtype=np.uint64)
    got = _translate(remote, sizes, local, ptrs)
    assert got.dtype == np.uint64
    assert got.tolist() == [0x9000_0000, 0x500F_FFFC, 0x9000_0010, 0xA000_0FFF]
    assert _translate(remote, sizes, local, ptrs.reshape(2, 2)).shape == (2, 2)
    assert _translate(remote, sizes, local, []).shape == (0,)
    for outside in (0x0FFF_FFFF, 0x1010_0000, 0x7000_1000, 0xFFFF_FFFF_FFFF_FFF0):
        with pytest.raises(IpcError, match=f"{outside:#x}"):
            _translate(remote, sizes, local, [0x1000_0000, outside])


def test_mapping_sorts_blocks_translates_and_closes_once() -> None:
    """Blocks come in export order, not address order. Closing without a GPU only logs
    (cudaIpcCloseMemHandle cannot run), and the count of open blocks still drops."""
    blocks = [IpcBlock(bytes(64), 0x3000_0000, 0x1000), IpcBlock(bytes(64), 0x1000_0000, 0x100)]
    m = IpcMapping(_export(pid=1, blocks=blocks), 0, opened=[0xC000_0000, 0xD000_0000])
    assert open_mappings() == 2
    try:
        got = m.translate([0x1000_0004, 0x3000_0FF0, 0x3000_0000])
        assert got.tolist() == [0xD000_0004, 0xC000_0FF0, 0xC000_0000]
        with pytest.raises(IpcError, match="outside"):
            m.translate([0x1000_0100])
    finally:
        if not _cuda_available():
            m.close()
            m.close()
        else:  # on a GPU these addresses are not ours to unmap: forget them instead
            m._opened, m._closed = [], True
            cuda_ipc._count_open(-2)
    assert m.closed and open_mappings() == 0
    with pytest.raises(IpcError, match="closed"):
        m.translate([0x1000_0004])


class FakeCuda:
    """The few runtime and driver calls cuda_ipc makes, over a table of allocations: the
    call sequence (device switches, handle bytes, rollback) is tested without a GPU."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, allocations: dict[int, int]) -> None:
        self.allocations, self.device = allocations, 1
        self.set_calls: list[int] = []
        self.opened: dict[int, int] = {}  # our address -> their base
        self.closed: list[int] = []

    class cudaIpcMemHandle_t:  # noqa: N801  (the binding's name)
        def __init__(self) -> None:
            self.buf = ctypes.create_string_buffer(64)

        def getPtr(self) -> int:  # noqa: N802
            return ctypes.addressof(self.buf)

    def cudaGetDevice(self):  # noqa: N802
        return 0, self.device

    def cudaSetDevice(self, d):  # noqa: N802
        self.set_calls.append(d)
        self.device = d
        return (0,)

    def cuMemGetAddressRange(self, ptr):  # noqa: N802
        for base, size in self.allocations.items():
            if base <= ptr < base + size:
                return 0, base, size
        return 1, None, None

    def cudaIpcGetMemHandle(self, base):  # noqa: N802
        h = self.cudaIpcMemHandle_t()
        h.buf.raw = base.to_bytes(8, "little") + b"\x01" * 56
        return 0, h

    def cudaIpcOpenMemHandle(self, h, flags):  # noqa: N802
        assert flags == 1 and self.device == 0
        base = int.from_bytes(h.buf.raw[:8], "little")
        if base not in self.allocations:
            return 201, None  # an invalid handle
        ours = 0xF000_0000 + len(self.opened) * 0x1000_0000
        self.opened[ours] = base
        return 0, ours

    def cudaIpcCloseMemHandle(self, ptr):  # noqa: N802
        self.closed.append(ptr)
        return (0,)

    def cudaDeviceCanAccessPeer(self, a, b):  # noqa: N802
        return 0, 1


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda({0x1000_0000: 0x10_0000, 0x4000_0000: 0x20_0000})
    monkeypatch.setattr(cuda_ipc, "_cudart", lambda: fake)
    monkeypatch.setattr(cuda_ipc, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_ipc, "_device_uuid", lambda d: f"GPU-{d}")
    monkeypatch.setattr(cuda_ipc, "_device_index", lambda uuid: int(uuid[4:]))
    monkeypatch.setattr(cuda_ipc, "available", lambda: True)
    return fake


def test_export_and_open_call_sequence_on_fake_cuda(fake_cuda) -> None:
    f = fake_cuda
    ranges = [(0x4000_0100, 0x1000), (0x1000_0000, 0x10_0000), (0x4010_0000, 64), (0x1000_8000, 8)]
    e = cuda_ipc.export_ranges(ranges, 0)
    assert [(b.base, b.size) for b in e.blocks] == [
        (0x4000_0000, 0x20_0000),
        (0x1000_0000, 0x10_0000),
    ]
    assert e.blocks[0].handle[:8] == (0x4000_0000).to_bytes(8, "little")
    assert (e.device_uuid, e.pid, e.host) == ("GPU-0", os.getpid(), host_identity())
    assert f.device == 1 and f.set_calls == [0, 1]  # the caller's device restored
    with pytest.raises(IpcError, match="runs past the end"):
        cuda_ipc.export_ranges([(0x1000_0000, 16), (0x1008_0000, 0x8_0001)], 0)
    with pytest.raises(IpcError, match="cuMemGetAddressRange"):
        cuda_ipc.export_ranges([(0x9000_0000, 16)], 0)

    theirs = IpcExport(e.host, e.device_uuid, os.getpid() + 1, e.blocks)
    assert why_not(theirs, 0) is None
    with cuda_ipc.open_export(theirs, 0) as m:
        assert open_mappings() == 2 and f.device == 1
        got = m.translate([0x1000_0010, 0x4000_0100]).tolist()
        assert got == [0x1_0000_0010, 0xF000_0100]  # each in its own block's mapping
    assert sorted(f.closed) == sorted(f.opened) and open_mappings() == 0

    f.closed.clear()
    bogus = IpcBlock(bytes(64), 0x8000_0000, 64)
    broken = IpcExport(e.host, e.device_uuid, os.getpid() + 1, (*e.blocks, bogus))
    with pytest.raises(IpcError, match="cudaIpcOpenMemHandle of the block at 0x80000000"):
        cuda_ipc.open_export(broken, 0)
    assert len(f.closed) == 2 and open_mappings() == 0 and f.device == 1  # rolled back
    with pytest.raises(IpcError, match="has 1 bytes, not 64"):
        cuda_ipc.open_export(IpcExport(e.host, "GPU-0", 1, (IpcBlock(b"x", 0, 1),)), 0)
    assert open_mappings() == 0


def _identity_child(conn: Any) -> None:
    conn.send((host_identity(), os.getpid()))
    conn.close()


def test_a_spawned_process_is_the_same_host_and_another_pid() -> None:
    """What a peer on this machine sends: ``why_not`` passes host and pid (and then stops
    at the GPU checks)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_identity_child, args=(child,), daemon=True)
    proc.start()
    child.close()
    try:
        assert parent.poll(TIMEOUT_S), "the child did not answer"
        host, pid = parent.recv()
    finally:
        _stop(proc)
    assert host == host_identity() and pid != os.getpid()
    reason = why_not(_export(host=host, pid=pid, blocks=[IpcBlock(bytes(64), 1 << 32, 64)]), 0)
    assert reason not in ("another host",) and not (reason or "").startswith("same process")


def _stop(proc: Any) -> None:
    """Stop a child we started, by its pid: ask, then kill."""
    proc.join(timeout=10)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)


# -- GPU -----------------------------------------------------------------------------------------

gpu = pytest.mark.gpu

# unit_len, src stride, src offset, dst stride, dst offset (bytes; bf16 KV of 64-wide heads)
GEOMETRIES = {
    "page1": (512, 512, 0, 512, 0),  # 1 token x 4 heads per page
    "page16": (16 * 512, 16 * 512, 0, 16 * 512, 0),
    # per token: the sender's heads 2..3 of 4 -> the receiver's heads 1..2 of 3
    "head-slice": (256, 512, 256, 384, 128),
}
LAYERS, DST_UNITS, SRC_UNITS = 6, 300, 200


def _background(layer: int, nbytes: int) -> np.ndarray:
    """The exporter's pool bytes before the copy (both processes compute them)."""
    rng = np.random.default_rng(1000 + layer)
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def _exporter(conn: Any, device: int) -> None:
    """The decode side: allocate a pool per request of the parent, export it, check it."""
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # expandable segments cannot export
    import torch

    torch.cuda.set_device(device)
    pools: list[Any] = []
    try:
        while conn.poll(TIMEOUT_S):
            msg = conn.recv()
            if msg[0] == "alloc":
                nbytes = msg[1]
                # separate tensors per layer, like a KV pool's per-layer buffers
                pools = [torch.from_numpy(_background(r, nbytes)).to(device) for r in range(LAYERS)]
                torch.cuda.synchronize()
                ranges = [(t.data_ptr(), nbytes) for t in pools]
                conn.send(("export", cuda_ipc.export_ranges(ranges, device), ranges))
            elif msg[0] == "check":
                torch.cuda.synchronize()
                bad = [
                    r for r, t in enumerate(pools) if not np.array_equal(t.cpu().numpy(), msg[1][r])
                ]
                conn.send(("checked", bad))
            elif msg[0] == "free":
                pools = []
                conn.send(("freed",))
            else:
                return
    except Exception as exc:  # the parent reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


@pytest.fixture(scope="module")
def gpu_env():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    if importlib.util.find_spec("cuda") is None or not cuda_ipc.available():
        pytest.skip("needs cuda.bindings (cuda-python)")
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from sgl_nixl_plugin.engine.copy_kernels import make_copier

    return torch, make_copier("VRAM", 0, prefer="triton")


class Exporter:
    """The spawned exporter and its pipe; every wait bounded."""

    def __init__(self, device: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_exporter, args=(child, device), daemon=True)
        self.proc.start()
        child.close()

    def ask(self, *msg: Any) -> Any:
        self.conn.send(msg)
        if not self.conn.poll(TIMEOUT_S):
            raise TimeoutError(f"the exporter did not answer {msg[0]!r}")
        reply = self.conn.recv()
        if reply[0] == "error":
            raise RuntimeError(f"the exporter failed: {reply[1]}")
        return reply

    def close(self) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        _stop(self.proc)


@gpu
@pytest.mark.parametrize("their_device", [0, 1], ids=["same-gpu", "peer-gpu"])
def test_gpu_pair_copy_into_a_peer_pool_through_ipc(gpu_env, their_device: int) -> None:
    torch, copier = gpu_env
    if their_device and not (
        torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, their_device)
    ):
        pytest.skip("needs a second GPU that GPU 0 can map (NVLink/PCIe peer)")
    peer = Exporter(their_device)
    try:
        for name, (unit_len, s_stride, s_off, d_stride, d_off) in GEOMETRIES.items():
            nbytes = d_off + DST_UNITS * d_stride
            _, export, ranges = peer.ask("alloc", nbytes)
            assert why_not(export, 0) is None, name
            assert len(export.blocks) <= LAYERS
            mapping = cuda_ipc.open_export(export, 0)
            assert open_mappings() == len(export.blocks)

            src_bytes = s_off + SRC_UNITS * s_stride
            g = torch.Generator(device="cpu").manual_seed(len(name))
            src = [
                torch.randn(src_bytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8)
                for _ in range(LAYERS)
            ]
            src_dev = [t.cuda() for t in src]
            rng = np.random.default_rng(unit_len)
            n = 37 if name != "page16" else 11
            su = rng.choice(SRC_UNITS, n, replace=False).astype(np.int64)
            du = rng.choice(DST_UNITS, n, replace=False).astype(np.int64)
            dst_bases = mapping.translate([p for p, _ in ranges])
            stream = torch.cuda.Stream()
            args = (
                copier.prepare_bases(np.array([t.data_ptr() for t in src_dev], np.uint64), stream),
                copier.prepare_bases(dst_bases, stream),
                copier.prepare_units(su, stream),
                copier.prepare_units(du, stream),
            )
            torch.cuda.synchronize()  # the source bytes were uploaded on another stream
            copier.pair_copy(
                *args,
                unit_len,
                s_stride,
                s_off,
                d_stride,
                d_off,
                stream=stream,
            )
            stream.synchronize()

            cols = np.arange(unit_len)
            want = []
            for r in range(LAYERS):
                w = _background(r, nbytes)
                w[d_off + du[:, None] * d_stride + cols] = src[r].numpy()[
                    s_off + su[:, None] * s_stride + cols
                ]
                want.append(w)
            assert peer.ask("check", want)[1] == [], name
            mapping.close()
            mapping.close()
            assert mapping.closed and open_mappings() == 0
            peer.ask("free")
    finally:
        peer.close()
    assert open_mappings() == 0


@gpu
def test_gpu_a_failed_open_leaves_nothing_open(gpu_env) -> None:
    peer = Exporter(0)
    try:
        _, export, _ = peer.ask("alloc", 1 << 20)
        last = export.blocks[-1]
        bogus = IpcBlock(bytes(64), last.base + last.size + (1 << 30), 4096)
        broken = IpcExport(export.host, export.device_uuid, export.pid, (*export.blocks, bogus))
        with pytest.raises(IpcError, match="cudaIpcOpenMemHandle"):
            cuda_ipc.open_export(broken, 0)
        assert open_mappings() == 0
        with cuda_ipc.open_export(export, 0) as m:  # the good blocks still open afterwards
            assert open_mappings() == len(export.blocks)
        assert m.closed and open_mappings() == 0
    finally:
        peer.close()


@gpu
def test_gpu_export_refuses_a_range_past_its_allocation(gpu_env) -> None:
    torch, _ = gpu_env
    t = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    try:
        e = cuda_ipc.export_ranges([(t.data_ptr(), t.numel())], 0)
    except IpcError as exc:  # e.g. expandable segments in this process
        pytest.skip(f"this process's memory cannot be exported: {exc}")
    (block,) = e.blocks
    assert block.base <= t.data_ptr() and t.data_ptr() + t.numel() <= block.base + block.size
    assert why_not(e, 0).startswith("same process")
    with pytest.raises(IpcError, match="runs past the end"):
        cuda_ipc.export_ranges([(block.base + block.size - 4, 8)], 0)
    with pytest.raises(IpcError, match="runs past the end"):
        cuda_ipc.export_ranges([(t.data_ptr(), 16), (block.base + 64, block.size)], 0)
