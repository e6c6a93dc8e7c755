"""UCX's protocol selection paid at start-up (``engine.ucx_prewarm``), against real NIXL.

The throwaway WRITEs must land byte for byte, leave nothing behind on our agent, never
raise, and leave an engine that moves a peer's pages exactly as one without it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest
from helpers.engine_peer import UCX_ENV, GroupSpec, PeerSpec, allocate, peers

from sgl_nixl_plugin.engine import ucx_prewarm
from sgl_nixl_plugin.engine.engine import TransferEngine
from sgl_nixl_plugin.registry.spec import AgentConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def loopback_only() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        for key, value in UCX_ENV.items():
            mp.setenv(key, value)
        yield


def _agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {})
    return agent


def test_both_writes_land_and_nothing_is_left_on_our_agent() -> None:
    ours = _agent("prewarm-ours")
    done = ucx_prewarm.prewarm(ours, "UCX")
    assert done.ok, done.error
    assert done.error == "" and done.ms > 0
    assert len(done.peers) == 2 and all(p.startswith("prewarm-ours-ucx-") for p in done.peers)
    for name in done.peers:
        assert not ours.check_remote_metadata(name), f"{name} is still a peer of ours"
    # our agent is as before: a second run sets up and tears down again
    again = ucx_prewarm.prewarm(ours, "UCX")
    assert again.ok, again.error
    assert set(again.peers).isdisjoint(done.peers)


def test_a_failure_is_reported_not_raised_and_the_agent_still_works() -> None:
    ours = _agent("prewarm-fails")
    done = ucx_prewarm.prewarm(ours, "NO_SUCH_BACKEND")
    assert not done.ok
    assert "no NO_SUCH_BACKEND backend" in done.error
    vram = ucx_prewarm.prewarm(ours, "UCX", mem_kind="VRAM")
    assert not vram.ok and "DRAM only" in vram.error
    buf = np.zeros(4096, dtype=np.uint8)
    descs = ours.register_memory([(buf.ctypes.data, buf.nbytes, 0, "")], "DRAM")
    ours.deregister_memory(descs)


def test_an_engine_started_with_it_moves_a_peers_pages_byte_exact() -> None:
    spec = PeerSpec(GroupSpec(regions=2, items=8, item_bytes=256))
    bufs, memory = allocate(spec)
    for b in bufs.values():
        b.raw[:] = np.random.default_rng(7).integers(0, 256, b.raw.size, np.uint8)
    engine = TransferEngine(AgentConfig(), memory, prewarm=True)
    plain = TransferEngine(AgentConfig(), memory)
    try:
        assert plain.agent.prewarmed is None  # off unless asked
    finally:
        plain.close()
    try:
        with peers(spec) as (peer,):
            link = engine.link(peer.metadata, peer.memory)
            src, dst = np.array([1, 5, 6]), np.array([7, 2, 3])
            xfer = engine.write(link, "kv", src, dst)
            assert xfer is not None
            deadline = time.monotonic() + 10
            while engine.poll(xfer) == "PROC":
                assert time.monotonic() < deadline, "WRITE still in flight after 10 s"
                time.sleep(0.0005)  # the peer process progresses its own agent
            assert xfer.state == "DONE", xfer.error
            assert engine.release(xfer)
            got = peer.read("kv", dst)
            want = bufs["kv"].pages[:, src]
            assert np.array_equal(got, want)
            done = engine.agent.prewarmed
            assert done is not None and done.ok, done
            nixl = engine.agent._nixl
            assert not any(nixl.check_remote_metadata(p) for p in done.peers)
            assert nixl.check_remote_metadata(link.name)
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("setting", "mem_kind", "want"),
    [
        ("auto", "DRAM", True),
        ("auto", "VRAM", False),
        ("1", "VRAM", True),
        ("1", "DRAM", True),
        ("0", "DRAM", False),
    ],
)
def test_auto_selects_at_start_up_for_a_dram_pool_only(setting, mem_kind, want) -> None:
    assert ucx_prewarm.wanted(setting, mem_kind) is want
