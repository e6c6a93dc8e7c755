"""Host-side cost of each step of a staged piece, on a GPU (one call each, median of many).

The staged path's speed on a GPU is bounded by what the host spends per piece (launching the
gather, noticing it finished, posting the WRITE, noticing that, telling the receiver), so this
probe times each primitive alone:

    python benchmarks/gpu_host_costs.py [--gpu 0] [--peer-gpu 0] [--n 200]

A child process owns the WRITE target (VRAM on ``--peer-gpu``); it only answers. Prints one
line per primitive: median and p90 host microseconds per call.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20


def _config() -> Any:
    from sgl_nixl_plugin.registry.spec import AgentConfig

    return AgentConfig(backend="UCX", backend_params={}, num_threads=0, capture_telemetry=False)


def target_main(gpu: int, nbytes: int, conn: Any) -> None:
    import torch

    from sgl_nixl_plugin.engine.engine import Memory, TransferEngine
    from sgl_nixl_plugin.engine.layout import RegionSet

    torch.cuda.set_device(gpu)
    buf = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
    kv = RegionSet((buf.data_ptr(),), (nbytes,), (MIB,), (gpu,), "VRAM")
    eng = TransferEngine(_config(), Memory(kv=kv, aux=RegionSet.of([], [], [], "VRAM")))
    conn.send((eng.metadata, buf.data_ptr()))
    end = time.monotonic() + 300
    while time.monotonic() < end:  # progress, like the decode listener does
        if conn.poll(0.0005) and conn.recv() == "stop":
            break
        eng.agent.progress()
    eng.close()


class Rows(list):
    """Prints each row as it is added (a hang still leaves the rows before it)."""

    def append(self, row: tuple[str, float, float]) -> None:
        if not self:
            print(f"{'primitive':52s} {'p50 us':>9s} {'p90 us':>9s}", flush=True)
        super().append(row)
        print(f"{row[0]:52s} {row[1]:9.1f} {row[2]:9.1f}", flush=True)


def timed(
    fn: Callable[[], Any], n: int, after: Callable[[Any], None] | None = None
) -> tuple[float, float]:
    out = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        if after is not None:
            after(r)
        if i >= 10:
            out.append(dt)
    a = np.asarray(out) * 1e6
    return float(np.median(a)), float(np.percentile(a, 90))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--peer-gpu", type=int, default=0)
    ap.add_argument("--n", type=int, default=200)
    args = ap.parse_args()

    import torch

    from sgl_nixl_plugin.engine import copy_kernels as ck
    from sgl_nixl_plugin.engine.engine import Memory, TransferEngine
    from sgl_nixl_plugin.engine.layout import RegionSet

    print(f"gpu_host_costs: gpu {args.gpu} -> peer gpu {args.peer_gpu}, n={args.n}", flush=True)
    torch.cuda.set_device(args.gpu)
    dev = f"cuda:{args.gpu}"
    size = 512 * MIB
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target_main, args=(args.peer_gpu, size, child), daemon=True)
    proc.start()
    rows = Rows()
    try:
        src = torch.zeros(size, dtype=torch.uint8, device=dev)
        kv = RegionSet((src.data_ptr(),), (size,), (MIB,), (args.gpu,), "VRAM")
        eng = TransferEngine(_config(), Memory(kv=kv, aux=RegionSet.of([], [], [], "VRAM")))
        if not parent.poll(120):
            raise TimeoutError("target did not start")
        meta, dst_ptr = parent.recv()
        print("target ready", flush=True)
        rkv = RegionSet((dst_ptr,), (size,), (MIB,), (args.peer_gpu,), "VRAM")
        link = eng.link(meta, Memory(kv=rkv, aux=RegionSet.of([], [], [], "VRAM")))
        agent = eng.agent
        stream = torch.cuda.Stream()
        copier = ck.make_copier("VRAM", args.gpu)
        print("linked; copier ready", flush=True)

        # pool of 64 regions x 4096 units x 2 KiB: a small piece (16 units) and a big one
        pool = torch.zeros(64 * 4096 * 2048, dtype=torch.uint8, device=dev)
        bases = np.array([pool.data_ptr() + r * 4096 * 2048 for r in range(64)], dtype=np.uint64)
        units_np = np.random.default_rng(0).permutation(4096)[:16].astype(np.int64)
        units_dev = torch.from_numpy(units_np).to(dev)
        stage = src.data_ptr()

        def gather_np() -> None:
            copier.gather(bases, units_np, 2048, 2048, 0, stage, stream)

        def gather_dev() -> None:
            copier.gather(bases, units_dev, 2048, 2048, 0, stage, stream)

        rows.append(("copier.gather, numpy units (cached)", *timed(gather_np, args.n)))
        rows.append(("copier.gather, device units", *timed(gather_dev, args.n)))
        stream.synchronize()
        # the staging threads' path: stream bound once, bases and units prepared once
        copier.bind(stream)
        pb = copier.prepare_bases(bases, stream)
        pu = copier.prepare_units(units_np, stream)

        def gather_fast() -> None:
            copier.gather(pb[0:64], pu[0:16], 2048, 2048, 0, stage, stream)

        rows.append(("copier.gather, prepared + bound (per piece)", *timed(gather_fast, args.n)))

        def gather_fast_event() -> None:
            gather_fast()
            torch.cuda.Event().record(stream)

        rows.append(("  same + event record", *timed(gather_fast_event, args.n)))
        side = torch.cuda.Stream()
        big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        big2 = torch.empty_like(big)
        with torch.cuda.stream(side):
            for _ in range(40):  # ~20 ms of copies keep the GPU busy meanwhile
                big2.copy_(big)
        torch.cuda.set_stream(stream)
        rows.append(("  same, GPU busy with other copies", *timed(gather_fast_event, args.n // 2)))
        torch.cuda.synchronize()
        del big, big2
        stream.synchronize()
        bases_t = torch.from_numpy(bases.view(np.int64)).to(dev)
        with torch.cuda.stream(stream):
            rows.append(
                (
                    "raw Triton launch (tensors ready)",
                    *timed(
                        lambda: ck.launch_unit_copy(
                            True, bases_t, units_dev, 16, 2048, 2048, 0, stage, 16
                        ),
                        args.n,
                    ),
                )
            )
        stream.synchronize()

        def scope() -> None:
            with ck._StreamScope(torch, torch.device(dev), stream):
                pass

        rows.append(("_StreamScope enter+exit", *timed(scope, args.n)))
        rows.append(
            (
                "torch.cuda.Event() + record",
                *timed(lambda: torch.cuda.Event().record(stream), args.n),
            )
        )
        ev = torch.cuda.Event()
        ev.record(stream)
        stream.synchronize()
        rows.append(("event.query (done)", *timed(ev.query, args.n)))
        units_big = np.random.default_rng(1).permutation(4096).astype(np.int64)
        rows.append(
            (
                "units upload 4096 (pinned, async)",
                *timed(
                    lambda: torch.from_numpy(units_big).pin_memory().to(dev, non_blocking=True),
                    args.n,
                ),
            )
        )
        stream.synchronize()
        # a request's page indices: a new array of a new length each time, GPU idle and the
        # host thread asleep for 1 ms before each (as at the head of a request)
        lens = np.random.default_rng(2).integers(4096, 8193, size=64)
        arrays = [np.random.default_rng(int(k)).permutation(int(k)).astype(np.int64) for k in lens]
        nxt = iter(range(10**9))
        arr = lambda: arrays[next(nxt) % 64]  # noqa: E731
        idle = lambda _: (stream.synchronize(), time.sleep(0.001))  # noqa: E731
        dbuf = torch.empty(8192, dtype=torch.int64, device=dev)
        pbuf = torch.empty(8192, dtype=torch.int64).pin_memory()
        pnp = pbuf.numpy()

        def via_pinned_buf() -> Any:
            a = arr()
            pnp[: len(a)] = a
            dbuf[: len(a)].copy_(pbuf[: len(a)], non_blocking=True)
            return dbuf

        for name, fn in (
            (
                "upload: pin_memory() + to(non_blocking)",
                lambda: torch.from_numpy(arr()).pin_memory().to(dev, non_blocking=True),
            ),
            (
                "upload: pageable to(non_blocking)",
                lambda: torch.from_numpy(arr()).to(dev, non_blocking=True),
            ),
            ("upload: torch.as_tensor(device=)", lambda: torch.as_tensor(arr(), device=dev)),
            ("upload: kept pinned + device buffers", via_pinned_buf),
            (
                "upload: torch.empty on the device only",
                lambda: torch.empty(len(arr()), dtype=torch.int64, device=dev),
            ),
            ("copier.prepare_units (bound stream)", lambda: copier.prepare_units(arr(), stream)),
        ):
            rows.append((name + ", idle before", *timed(fn, min(args.n, 100), after=idle)))
            rows.append((name + ", back to back", *timed(fn, args.n)))
        stream.synchronize()
        pu_fresh = [copier.prepare_units(a, stream) for a in arrays[:8]]
        stream.synchronize()
        k8 = iter(range(10**9))
        rows.append(
            (
                "gather of a piece, fresh units, idle before",
                *timed(
                    lambda: copier.gather(
                        pb[0:8], pu_fresh[next(k8) % 8][0:4096], 2048, 2048, 0, stage, stream
                    ),
                    min(args.n, 100),
                    after=idle,
                ),
            )
        )
        rows.append(
            (
                "gather of a piece, same units, idle before",
                *timed(
                    lambda: copier.gather(pb[0:8], pu[0:16], 2048, 2048, 0, stage, stream),
                    min(args.n, 100),
                    after=idle,
                ),
            )
        )
        stream.synchronize()

        def wait(x: Any) -> None:
            end = time.monotonic() + 10
            while agent.poll(x) == "PROC":
                if time.monotonic() > end:
                    raise TimeoutError("WRITE not done within 10 s")
            agent.release(x)

        for nb in (2 * MIB, 64 * MIB, 256 * MIB):

            def contig(nb: int = nb) -> Any:
                return agent.write_contiguous(
                    src.data_ptr(),
                    dst_ptr,
                    nb,
                    peer=link.name,
                    mem_kind="VRAM",
                    remote_mem_kind="VRAM",
                    local_device=args.gpu,
                    remote_device=args.peer_gpu,
                )

            def prepped(nb: int = nb) -> Any:
                k = nb // MIB
                return eng.write(link, "kv", np.arange(k), np.arange(k))

            rows.append(
                (f"write_contiguous post, {nb // MIB} MiB", *timed(contig, args.n // 4, wait))
            )
            rows.append(
                (f"prepped write post, {nb // MIB} MiB", *timed(prepped, args.n // 4, wait))
            )
            tot = []
            for _ in range(args.n // 4):
                t0 = time.perf_counter()
                wait(contig())
                tot.append(time.perf_counter() - t0)
            a = np.asarray(tot[5:]) * 1e6
            rows.append(
                (
                    f"write_contiguous post..done, {nb // MIB} MiB",
                    float(np.median(a)),
                    float(np.percentile(a, 90)),
                )
            )
        x = agent.write_contiguous(
            src.data_ptr(),
            dst_ptr,
            256 * MIB,
            peer=link.name,
            mem_kind="VRAM",
            remote_mem_kind="VRAM",
            local_device=args.gpu,
            remote_device=args.peer_gpu,
        )
        polls = []
        for _ in range(1_000_000):
            t0 = time.perf_counter()
            s = agent.poll(x)
            polls.append(time.perf_counter() - t0)
            if s != "PROC":
                break
        agent.release(x)
        rows.append(
            (
                f"check_xfer_state while PROC ({len(polls)} polls)",
                float(np.median(polls) * 1e6),
                float(np.percentile(polls, 90) * 1e6),
            )
        )
        eng.close()
    finally:
        try:
            parent.send("stop")
        except Exception:
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
