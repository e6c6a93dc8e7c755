"""What a new peer costs NIXL/UCX itself, with and without the start-up protocol selection.

Not a test: it prints figures. In one process (CPU, DRAM, UCX on loopback), for each
variant in turn, a fresh agent ("ours", with or without ``engine.ucx_prewarm``) links a
fresh same-host peer (with or without it too) and WRITEs 16 x 4 KiB into it three times:

* ``add_remote_agent`` -- wall and CPU time (``time.process_time``) of NIXL's load of the
  peer's metadata, where UCX creates our endpoints and selects their protocols;
* ``first WRITE`` / ``steady WRITE`` -- post to DONE, the peer progressed in the same loop
  (its side of the wire-up and, the first time, its own protocol selection run there).

    python benchmarks/ucx_setup_cost.py [--rounds 5] [--threads 0 8]

``--threads``: our agent's UCX backend threads (the prefill's default is 8). The peer is
another agent of this process, as a same-host decode would be.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("UCX_NET_DEVICES", "lo")  # before NIXL loads UCX

from sgl_nixl_plugin.engine import ucx_prewarm  # noqa: E402

ITEMS, ITEM_BYTES = 16, 4096


def _agent(name: str, threads: int):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"num_threads": str(threads)} if threads else {})
    bufs = [np.zeros(ITEM_BYTES, dtype=np.uint8) for _ in range(ITEMS)]
    agent.register_memory([(b.ctypes.data, b.nbytes, 0, "") for b in bufs], "DRAM")
    return agent, bufs


def _write_ms(src, sbufs, dst, dbufs) -> float:
    started = time.perf_counter()
    s = src.get_xfer_descs([(b.ctypes.data, ITEM_BYTES, 0) for b in sbufs], "DRAM")
    d = dst.get_xfer_descs([(b.ctypes.data, ITEM_BYTES, 0) for b in dbufs], "DRAM")
    handle = src.initialize_xfer("WRITE", s, d, dst.name)
    state = src.transfer(handle)
    deadline = time.monotonic() + 10
    while state == "PROC" and time.monotonic() < deadline:
        dst.get_new_notifs()
        state = src.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"WRITE ended {state}")
    src.release_xfer_handle(handle)
    return (time.perf_counter() - started) * 1e3


def one(prewarm: bool, threads: int) -> dict[str, float]:
    tag = uuid.uuid4().hex[:6]
    ours, obufs = _agent(f"ours-{tag}", threads)
    peer, pbufs = _agent(f"peer-{tag}", 0)
    warm_ms = 0.0
    if prewarm:  # both sides, as both of the plugin's managers do
        for agent in (ours, peer):
            done = ucx_prewarm.prewarm(agent, "UCX")
            if not done.ok:
                raise RuntimeError(done.error)
            warm_ms = max(warm_ms, done.ms)
    cpu, wall = time.process_time(), time.perf_counter()
    ours.add_remote_agent(peer.get_agent_metadata())
    add_ms, add_cpu = (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3
    writes = [_write_ms(ours, obufs, peer, pbufs) for _ in range(3)]
    return {
        "prewarm_ms": warm_ms,
        "add_ms": add_ms,
        "add_cpu_ms": add_cpu,
        "first_ms": writes[0],
        "steady_ms": statistics.median(writes[1:]),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, nargs="+", default=[0, 8])
    args = p.parse_args()
    keys = ("prewarm_ms", "add_ms", "add_cpu_ms", "first_ms", "steady_ms")
    print(f"{'variant':24} " + " ".join(f"{k:>11}" for k in keys) + "   (medians, ms)")
    for threads in args.threads:
        for prewarm in (False, True):
            rows = [one(prewarm, threads) for _ in range(args.rounds)]
            med = {k: statistics.median(r[k] for r in rows) for k in keys}
            name = f"threads {threads}, prewarm {'on' if prewarm else 'off'}"
            print(f"{name:24} " + " ".join(f"{med[k]:11.2f}" for k in keys))


if __name__ == "__main__":
    main()
