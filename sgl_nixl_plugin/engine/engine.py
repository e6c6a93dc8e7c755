"""The transfer engine: local memory, one prepared link per peer, and page WRITEs.

SGLang-independent. A prefill process creates one engine over its KV, aux and state
buffers; each decode rank it serves becomes a ``PeerLink`` at first contact, when the
strided descriptor lists on both sides are prepared. Per request the engine does only
index arithmetic (``descriptors``) and one ``make_prepped_xfer`` per buffer group.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from sgl_nixl_plugin.engine.agent import Agent, AgentSettings, TransferError, Xfer
from sgl_nixl_plugin.engine.descriptors import (
    expected_descriptors,
    region_offsets,
    unit_indices,
)
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.engine.links import (
    JOINT,
    GroupBounds,
    GroupLink,
    PeerLink,
    _Side,
    joint_rows,
)
from sgl_nixl_plugin.engine.one_pass import KernelXfer
from sgl_nixl_plugin.engine.staging import RemoteStaging, StagingBuffer

logger = logging.getLogger(__name__)

#: Descriptors of the warm-up WRITE. A one-page WRITE leaves most of the transport's first
#: request cold (measured: a threaded UCX backend still paid 1.1-1.4x the steady time per
#: byte on it); one of 1,024 descriptors or more did not (0.99-1.21x).
WARM_DESCRIPTORS = 1024
#: ... within this many bytes (large pages: fewer items): a first request sent meanwhile
#: waits for it (66 ms for 32 MiB over DRAM on a loaded 2-core host, most of the decode's
#: 138 ms from the prefill's parallel info to ``prefill_ready``).
WARM_MAX_BYTES = 32 << 20
#: Bytes of the host buffer a decode registers for warm-up WRITEs only (``warm_host``).
SCRATCH_BYTES = 4096


@dataclass(frozen=True)
class Memory:
    """The buffers one side exposes: KV pages, aux (metadata) rows, state components."""

    kv: RegionSet
    aux: RegionSet
    state: tuple[RegionSet, ...] = ()
    # a decode's host pool: the same items as ``kv`` / ``state``, in host memory
    host_kv: RegionSet | None = None
    host_state: tuple[RegionSet, ...] = ()

    def groups(self) -> dict[str, RegionSet]:
        out = {"kv": self.kv, "aux": self.aux}
        out.update({f"state{i}": s for i, s in enumerate(self.state)})
        if self.host_kv is not None:
            out[f"{HOST}kv"] = self.host_kv
        out.update({f"{HOST}state{i}": s for i, s in enumerate(self.host_state)})
        return {k: v for k, v in out.items() if len(v)}


#: Prefix of a peer's host-pool groups; each is written from the local group it names.
HOST = "host_"


def local_group(group: str) -> str:
    """The local group that a peer's ``group`` is written from (``host_kv`` from ``kv``)."""
    return group.removeprefix(HOST)


class TransferEngine:
    """Owns the agent and the local memory; builds links and posts WRITEs."""

    def __init__(
        self,
        config: AgentSettings,
        memory: Memory,
        name: str | None = None,
        progress_thread: bool = False,
        scratch: bool = False,
        prewarm: bool = False,
    ) -> None:
        """``scratch``: also register a small host buffer that peers' warm-ups WRITE into
        (a decode whose aux rows are in host memory: see ``warm_host``); ``prewarm``: see
        ``Agent``."""
        self.agent = Agent(config, name, progress_thread, prewarm)
        self.memory = memory
        # prepared local lists, shared by every link: one side per group (several where a
        # list is ``joint``)
        self._local_lists: dict[tuple, tuple[_Side, ...]] = {}
        self._lock = threading.Lock()
        for regions in memory.groups().values():
            self.agent.register(regions)
        self._scratch = np.zeros(SCRATCH_BYTES if scratch else 0, dtype=np.uint8)
        self.scratch: RegionSet | None = None
        if scratch:
            ptr = int(self._scratch.ctypes.data)
            self.scratch = RegionSet.of([ptr], [SCRATCH_BYTES], [SCRATCH_BYTES], "DRAM")
            self.agent.register(self.scratch)

    @property
    def name(self) -> str:
        return self.agent.name

    @property
    def metadata(self) -> bytes:
        return self.agent.metadata

    def _local_side(self, group: str, geometry: Geometry, regions: RegionSet) -> _Side:
        key = (group, geometry, regions.item_lens)
        with self._lock:
            side = self._local_lists.get(key)
            if side is None:
                dlist = self.agent.prep(None, geometry.strided(regions, "src"), regions.mem_kind)
                side = (_Side(dlist, region_offsets(geometry.unit_counts(regions))),)
                self._local_lists[key] = side
            return side[0]

    def link(
        self,
        metadata: bytes,
        remote: Memory,
        geometries: dict[str, Geometry] | None = None,
        page_tokens: tuple[int, int] | None = None,
    ) -> PeerLink:
        """Add the peer and prepare every group both sides have (a peer's host groups
        against the local group they are written from); whole items by default.

        ``page_tokens`` = (local, remote) tokens a page: when they differ, the KV groups are
        prepared per token row (``RegionSet.per_token``) and ``geometries['kv']`` speaks of
        token rows; chunks are then paired token by token (``GroupLink.items_of``).
        The ``JOINT`` groups share one list per side where they can (``_joint_sides``)."""
        name = self.agent.add_peer(metadata)
        link = PeerLink(name)
        local_groups = self.memory.groups()
        joint: dict[str, tuple[_Side, _Side]] = {}
        try:
            plans = [
                (*p, (geometries or {}).get(p[1], Geometry.whole_items()))
                for p in self._paired(remote, page_tokens)
            ]
            for group, _, local, theirs, _, geo in plans:
                if geo.is_whole_items and local.item_lens != theirs.item_lens:
                    raise TransferError(
                        f"{group} item sizes differ: local {local.item_lens[:4]}..., "
                        f"peer {theirs.item_lens[:4]}..."
                    )
            whole = {p[0] for p in plans if len(p[2]) == len(local_groups[p[1]])}
            joint = self._joint_sides(name, [p for p in plans if p[0] in whole])
            for group, mine, local, theirs, tokens, geo in plans:
                n = len(theirs)
                if group in joint:
                    local_side, remote_side = joint[group]
                else:
                    remote_side = _Side(
                        self.agent.prep(name, geo.strided(theirs, "dst"), theirs.mem_kind),
                        region_offsets(geo.unit_counts(theirs)),
                    )
                    local_side = (
                        self._local_side(mine, geo, local)
                        if group in whole
                        else self._prep_local_prefix(mine, local, geo)
                    )
                unit = (
                    sum(local.item_lens)
                    if geo.is_whole_items
                    else n * geo.unit_len * geo.units_per_item
                )
                link.groups[group] = GroupLink(
                    geometry=geo,
                    local=local_side,
                    remote=remote_side,
                    unit_bytes=unit,
                    num_regions=n,
                    remote_items=int(theirs.num_items.min()),
                    local_items=int(local.num_items.min()),
                    page_tokens=tokens,
                    local_regions=local,
                )
        except Exception:
            self.unlink(link)
            for _, remote_side in joint.values():
                self.agent.release_dlist(remote_side.dlist)  # a no-op once released
            raise
        return link

    def _joint_sides(self, name: str, plans: list[tuple]) -> dict[str, tuple[_Side, _Side]]:
        """(local, remote) sides of the ``JOINT`` groups in one prepared list per side, when
        ``plans`` (whole lists only) has each and each side holds them in one memory kind
        (DRAM pools; on a GPU host the KV is VRAM and the aux rows DRAM); else none."""
        by_group = {p[0]: p for p in plans}
        parts = [by_group.get(g) for g in JOINT]
        if any(p is None for p in parts):
            return {}
        if len({p[2].mem_kind for p in parts}) > 1 or len({p[3].mem_kind for p in parts}) > 1:
            return {}
        key = (JOINT, *((p[5], p[2].item_lens) for p in parts))
        with self._lock:  # ours first: it stays (shared), so a failure below leaks nothing
            local = self._local_lists.get(key)
            if local is None:
                lrows, loffs = joint_rows([(p[5], p[2]) for p in parts], "src")
                dlist = self.agent.prep(None, lrows, parts[0][2].mem_kind)
                local = tuple(_Side(dlist, o) for o in loffs)
                self._local_lists[key] = local
        rows, offsets = joint_rows([(p[5], p[3]) for p in parts], "dst")
        remote = self.agent.prep(name, rows, parts[0][3].mem_kind)
        return {
            p[0]: (local_side, _Side(remote, o))
            for p, local_side, o in zip(parts, local, offsets, strict=True)
        }

    def _paired(
        self, remote: Memory, page_tokens: tuple[int, int] | None
    ) -> Iterator[tuple[str, str, RegionSet, RegionSet, tuple[int, int]]]:
        """Each group both sides have, as a link addresses it: (group, local group, local
        regions, peer regions, page tokens); the regions cut to the shorter list, per token
        row for the KV when the page sizes differ."""
        by_token = page_tokens is not None and page_tokens[0] != page_tokens[1]
        local_groups = self.memory.groups()
        for group, theirs in remote.groups().items():
            mine = local_group(group)
            local = local_groups.get(mine)
            if local is None:
                continue
            n = min(len(local), len(theirs))
            local, theirs = _first(local, n), _first(theirs, n)
            tokens = (0, 0)
            if by_token and mine == "kv":
                assert page_tokens is not None
                tokens = page_tokens
                local, theirs = local.per_token(tokens[0]), theirs.per_token(tokens[1])
            yield group, mine, local, theirs, tokens

    def bounds(
        self, remote: Memory, page_tokens: tuple[int, int] | None = None
    ) -> dict[str, GroupBounds]:
        """The bounds ``link`` will give each group, without NIXL: a peer's requests can be
        checked (and filed) while its link is still being set up."""
        return {
            group: GroupBounds(int(theirs.num_items.min()), tokens)
            for group, _, _, theirs, tokens in self._paired(remote, page_tokens)
        }

    def _prep_local_prefix(self, group: str, regions: RegionSet, geo: Geometry) -> _Side:
        # Only when a peer has fewer regions of a group than we do (aux lists differ).
        dlist = self.agent.prep(None, geo.strided(regions, "src"), regions.mem_kind)
        return _Side(dlist, region_offsets(geo.unit_counts(regions)))

    def unlink(self, link: PeerLink) -> None:
        """Release the peer's prepared lists and forget its agent; unmap its KV pool once
        the last one-pass copy into it finished."""
        if link.one_pass is not None:
            link.one_pass.close()
        local_shared = {id(s.dlist) for sides in self._local_lists.values() for s in sides}
        with link.lock:  # after any WRITE being posted on it; none after
            link.closed = True
            for g in link.groups.values():
                self.agent.release_dlist(g.remote.dlist)
                if id(g.local.dlist) not in local_shared:
                    self.agent.release_dlist(g.local.dlist)
            link.groups.clear()
        self.agent.remove_peer(link.name)

    def write(
        self,
        link: PeerLink,
        group: str,
        src: np.ndarray,
        dst: np.ndarray,
        notif: bytes = b"",
        warmup: bool = False,
    ) -> Xfer | None:
        """Post one WRITE of items ``src`` (local) into items ``dst`` (peer); None if empty
        or the peer has no such group. Raises ``TransferError`` once the link is closed.
        ``warmup``: counted as a warm-up (``agent.WARMUP``), not a request's WRITE."""
        return self.write_parts(link, [(group, src, dst)], notif, warmup)

    def write_parts(
        self,
        link: PeerLink,
        parts: Sequence[tuple[str, np.ndarray, np.ndarray]],
        notif: bytes = b"",
        warmup: bool = False,
    ) -> Xfer | None:
        """``write`` of several groups' (group, src, dst) in one WRITE: the groups must
        share their lists (``PeerLink.shares``); parts of a group the peer lacks, or
        empty, are left out (None if nothing is left)."""
        with link.lock:
            if link.closed:
                raise TransferError(f"decode {link.name} was dropped: its link is closed")
            lidx, ridx, nbytes, descriptors, first = [], [], 0, 0, None
            for group, src, dst in parts:
                g = link.groups.get(group)
                if g is None or len(src) == 0:
                    continue
                if len(src) != len(dst):
                    raise TransferError(
                        f"{group}: {len(src)} source items for {len(dst)} destinations"
                    )
                first = first or g
                if (
                    g.local.dlist is not first.local.dlist
                    or g.remote.dlist is not first.remote.dlist
                ):
                    raise ValueError(f"{group} does not share its lists with the other parts")
                upp = g.geometry.units_per_item
                lidx.append(unit_indices(src, g.local.offsets[: g.num_regions], upp))
                ridx.append(unit_indices(dst, g.remote.offsets[: g.num_regions], upp))
                nbytes += g.unit_bytes * len(src)
                descriptors += expected_descriptors(src, dst, g.num_regions, g.geometry)
            if first is None:
                return None
            return self.agent.write(
                first.local.dlist,
                lidx[0] if len(lidx) == 1 else np.concatenate(lidx),
                first.remote.dlist,
                ridx[0] if len(ridx) == 1 else np.concatenate(ridx),
                peer=link.name,
                nbytes=nbytes,
                descriptors=descriptors,
                notif=notif,
                warmup=warmup,
            )

    def warm(self, link: PeerLink, timeout_s: float = 1.0) -> float:
        """WRITE item 0 of every KV region into the peer's item 0, as many times as a
        request has descriptors (:data:`WARM_DESCRIPTORS`), and wait for it; seconds.

        Item 0 is the padding page of SGLang's token pools on both sides (allocators hand
        out pages from 1), so no request's data is touched. The first WRITEs to a new peer
        pay the transport's wire-up (UCX endpoints of every worker thread, remote keys,
        CUDA IPC handles): paid here, at registration, they stay off the first request.
        Raises ``TransferError``.
        """
        started = time.monotonic()
        zero = np.zeros(warm_items(link), dtype=np.int64)
        try:
            xfer = self.write(link, "kv", zero, zero, warmup=True)
        except TransferError as exc:
            raise TransferError(f"warm-up WRITE to {link.name}: {exc}") from exc
        if xfer is None:
            return 0.0
        self._wait_warm(link, xfer, started + timeout_s, timeout_s)
        return time.monotonic() - started

    def warm_staging(
        self,
        link: PeerLink,
        local: StagingBuffer,
        remote: RemoteStaging,
        timeout_s: float = 1.0,
    ) -> float:
        """WRITE from our staging buffer's spare tail into the peer's and wait; seconds (0
        when either has no spare). The staged path WRITEs between staging buffers, other
        registrations than the KV pool's: their first WRITE (remote key, CUDA IPC mapping
        of the peer's buffer) is paid here. No slot is touched on either side."""
        (src, src_len), (dst, dst_len) = local.spare, remote.spare
        nbytes = min(src_len, dst_len)
        if nbytes <= 0:
            return 0.0
        started = time.monotonic()
        xfer = self.agent.write_contiguous(
            src,
            dst,
            nbytes,
            peer=link.name,
            mem_kind=local.mem_kind,
            remote_mem_kind=remote.mem_kind,
            local_device=local.device,
            remote_device=remote.device,
            warmup=True,
        )
        self._wait_warm(link, xfer, started + timeout_s, timeout_s, "staging warm-up WRITE")
        return time.monotonic() - started

    def warm_host(
        self,
        link: PeerLink,
        dst: int,
        dst_len: int,
        timeout_s: float = 1.0,
    ) -> float:
        """WRITE the start of our first aux row into the peer's scratch buffer (``dst``,
        ``dst_len`` bytes of its host memory) and wait; seconds (0 when we have no host aux
        rows). UCX chooses its protocol per operation and memory kinds on their first use:
        the KV warm-up covers device memory, this covers the host-to-host WRITE of every
        request's aux rows (0.5-0.7 ms on a GPU host's first room). Only the scratch buffer,
        which no request uses, is written; our aux row is only read."""
        aux = self.memory.aux
        if not len(aux) or aux.mem_kind != "DRAM" or "aux" not in link.groups:
            return 0.0
        nbytes = min(aux.item_lens[0], dst_len, SCRATCH_BYTES)
        if nbytes <= 0:
            return 0.0
        started = time.monotonic()
        try:
            xfer = self.agent.write_contiguous(
                aux.ptrs[0],
                dst,
                nbytes,
                peer=link.name,
                mem_kind="DRAM",
                remote_mem_kind="DRAM",
                local_device=aux.devices[0],
                warmup=True,
            )
        except TransferError as exc:
            raise TransferError(f"host warm-up WRITE to {link.name}: {exc}") from exc
        self._wait_warm(link, xfer, started + timeout_s, timeout_s, "host warm-up WRITE")
        return time.monotonic() - started

    def _wait_warm(
        self,
        link: PeerLink,
        xfer: Xfer,
        deadline: float,
        timeout_s: float,
        what: str = "warm-up WRITE",
    ) -> None:
        while xfer.state != "ERR" and self.poll(xfer) == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0002)  # a poll interval: the transport's progress runs meanwhile
        if xfer.state != "DONE":
            why = xfer.error or f"still in flight after {timeout_s:.1f}s"
            self.agent.abandon(xfer)
            raise TransferError(f"{what} to {link.name}: {why}")
        if not self.release(xfer):
            self.agent.abandon(xfer)

    def poll(self, xfer: Xfer) -> str:
        if isinstance(xfer, KernelXfer):
            return xfer.poll()
        return self.agent.poll(xfer)

    def release(self, xfer: Xfer) -> bool:
        return self.agent.release(xfer)

    def close(self) -> None:
        self._local_lists.clear()
        self.agent.close()


def warm_items(link: PeerLink) -> int:
    """How many padding-page items the warm-up WRITE repeats for ``link``'s KV group."""
    g = link.groups.get("kv")
    if g is None:
        return 1
    one = np.zeros(1, dtype=np.int64)
    per_item = max(1, expected_descriptors(one, one, g.num_regions, g.geometry))
    by_bytes = max(1, WARM_MAX_BYTES // max(1, g.unit_bytes))
    return int(max(1, min(-(-WARM_DESCRIPTORS // per_item), by_bytes)))


def _first(regions: RegionSet, n: int) -> RegionSet:
    if n == len(regions):
        return regions
    return RegionSet(
        regions.ptrs[:n],
        regions.lens[:n],
        regions.item_lens[:n],
        regions.devices[:n],
        regions.mem_kind,
    )
