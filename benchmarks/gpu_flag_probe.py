"""Can the prefill's copy stream tell the decode "done" through host memory? (issue 16 item 4)

A one-pass room ends today with the prefill polling the copy's event, encoding a status and
sending it over ZMQ (~0.45 ms after the copy on an H200). This probe checks the shorter
route: a file in /dev/shm that both processes map, registered with CUDA in the writer
(``cudaHostRegister``), where ``cuStreamWriteValue32`` on the copy's stream stores a value
after the copy (with the default memory barrier) and the other process spins on it.

Per rep: the writer launches a contiguous copy of ``--mib`` MiB, enqueues the flag write,
records an event and polls it; the reader (another process) spins on the mapped word.
Printed: launch -> event seen by the writer, launch -> flag seen by the reader, and
whether the reader found the copied bytes (read back through CUDA IPC) complete.

    python3 benchmarks/gpu_flag_probe.py [--mib 768] [--reps 20]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import statistics
import time

import numpy as np


def _reader(path: str, reps: int, handle: bytes, nbytes: int, q: mp.Queue) -> None:
    import torch

    torch.cuda.set_device(0)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, 4096)
    flags = np.frombuffer(mm, dtype=np.int32)
    from cuda.bindings import runtime as rt

    h = rt.cudaIpcMemHandle_t()
    import ctypes

    ctypes.memmove(h.getPtr(), handle, 64)
    err, ptr = rt.cudaIpcOpenMemHandle(h, rt.cudaIpcMemLazyEnablePeerAccess)
    assert int(err) == 0, err
    q.put(("ready", 0.0, True))
    for k in range(1, reps + 1):
        while flags[0] != k:
            pass
        seen = time.perf_counter()
        # the last 4 KiB of the destination must hold the rep's byte already
        tail = torch.empty(4096, dtype=torch.uint8, device="cuda")
        rt.cudaMemcpy(
            tail.data_ptr(),
            int(ptr) + nbytes - 4096,
            4096,
            rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
        )
        ok = bool((tail == (k % 251)).all().item())
        q.put(("seen", seen, ok))
    rt.cudaIpcCloseMemHandle(ptr)
    del flags
    mm.close()
    os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=768)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    import torch
    from cuda.bindings import driver as drv
    from cuda.bindings import runtime as rt

    torch.cuda.set_device(0)
    path = f"/dev/shm/sgl-nixl-flag-probe-{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    mm = mmap.mmap(fd, 4096)
    host = np.frombuffer(mm, dtype=np.int32)
    host_ptr = host.ctypes.data
    (err,) = rt.cudaHostRegister(
        host_ptr, 4096, rt.cudaHostRegisterMapped | rt.cudaHostRegisterPortable
    )
    assert int(err) == 0, err
    err, dptr = rt.cudaHostGetDevicePointer(host_ptr, 0)
    assert int(err) == 0, err
    nbytes = args.mib << 20
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    err, handle = rt.cudaIpcGetMemHandle(dst.data_ptr())
    assert int(err) == 0, err
    import ctypes

    hbytes = ctypes.string_at(handle.getPtr(), 64)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_reader, args=(path, args.reps, hbytes, nbytes, q))
    p.start()
    assert q.get(timeout=60)[0] == "ready"
    stream = torch.cuda.Stream()
    cu_stream = drv.CUstream(stream.cuda_stream)
    ev_ms, flag_ms, oks = [], [], []
    try:
        for k in range(1, args.reps + 1):
            src.fill_(k % 251)
            torch.cuda.synchronize()
            time.sleep(0.01)
            with torch.cuda.stream(stream):
                t0 = time.perf_counter()
                dst.copy_(src)
                (err,) = drv.cuStreamWriteValue32(cu_stream, drv.CUdeviceptr(int(dptr)), k, 0)
                assert int(err) == 0, err
                ev = torch.cuda.Event()
                ev.record(stream)
            while not ev.query():
                pass
            t_ev = time.perf_counter()
            kind, seen, ok = q.get(timeout=30)
            ev_ms.append((t_ev - t0) * 1e3)
            flag_ms.append((seen - t0) * 1e3)
            oks.append(ok)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
        rt.cudaHostUnregister(host_ptr)
        del host
        mm.close()
        os.close(fd)
        os.unlink(path)
    med = statistics.median
    print(
        f"{args.mib} MiB copy, {args.reps} reps: launch -> event seen (writer) p50 "
        f"{med(ev_ms):.3f} ms; launch -> flag seen (reader) p50 {med(flag_ms):.3f} ms "
        f"(min {min(flag_ms):.3f}, max {max(flag_ms):.3f}); data complete when the flag "
        f"was seen: {sum(oks)}/{len(oks)}"
    )
    print(
        "flag - event per rep (ms):",
        " ".join(f"{f - e:+.3f}" for f, e in zip(flag_ms, ev_ms, strict=True)),
    )


if __name__ == "__main__":
    main()
