"""One side of ``run.py``: ``target`` registers 64 MiB and waits; ``initiator`` WRITEs 1 MiB
into it every 50 ms for the given seconds and prints each WRITE's post and end
(``time.time()``: one clock with ``run.py``) and its state."""

from __future__ import annotations

import os
import sys
import time

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

MIB = 1 << 20


def main(role: str, folder: str, seconds: float) -> None:
    cfg = nixl_agent_config(
        enable_prog_thread=role == "target",
        backends=[],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(role, cfg)
    agent.create_backend("UCX", {})
    buf = np.zeros(64 * MIB, dtype=np.uint8)
    agent.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
    if role == "target":
        with open(f"{folder}/t.addr", "w") as f:
            f.write(str(buf.ctypes.data))
        with open(f"{folder}/t.meta.tmp", "wb") as f:
            f.write(agent.get_agent_metadata())
        os.rename(f"{folder}/t.meta.tmp", f"{folder}/t.meta")
        end = time.time() + seconds + 30
        while not os.path.exists(f"{folder}/stop") and time.time() < end:
            time.sleep(0.01)
        return
    while not os.path.exists(f"{folder}/t.meta"):
        time.sleep(0.05)
    with open(f"{folder}/t.meta", "rb") as f:
        name = agent.add_remote_agent(f.read())
    with open(f"{folder}/t.addr") as f:
        remote = int(f.read())
    inflight: list[tuple[int, float, object]] = []
    t0, k = time.time(), 0
    while time.time() - t0 < seconds or inflight:
        now = time.time()
        if now - t0 < seconds and now - t0 > k * 0.05:
            off = (k % 32) * MIB
            src = np.array([[buf.ctypes.data + off, MIB, 0]], dtype=np.uint64)
            dst = np.array([[remote + off, MIB, 0]], dtype=np.uint64)
            handle = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs(src, "DRAM"),
                agent.get_xfer_descs(dst, "DRAM"),
                name,
            )
            agent.transfer(handle)
            inflight.append((k, now, handle))
            k += 1
        keep = []
        for i, posted, handle in inflight:
            state = agent.check_xfer_state(handle)
            if state == "PROC" and time.time() - posted <= 20:
                keep.append((i, posted, handle))
                continue
            ended = time.time()
            print(f"W {i} {posted:.3f} {ended:.3f} {state}", flush=True)
            if state != "PROC":
                agent.release_xfer_handle(handle)
        inflight = keep
        time.sleep(0.001)
    with open(f"{folder}/stop", "w") as f:
        f.write("1")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
