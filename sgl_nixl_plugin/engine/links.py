"""What a prefill holds for one peer: the prepared descriptor lists of each buffer group
(``GroupLink``) under one ``PeerLink``, and the bounds a peer's indices are checked against.

Several groups may share one prepared list per side (``joint_rows``): on a host whose KV
pages and aux rows are in one memory kind, a room's last KV chunk and its aux row then go
in one NIXL request (one post, one note) instead of two.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.descriptors import paired_tokens, region_offsets
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.engine.one_pass import OnePassLink


@dataclass
class _Side:
    """A prepared list and where each region's units start in it."""

    dlist: Any
    offsets: np.ndarray


class _Bounds:
    """The bounds a peer's indices are checked against, for ``GroupLink`` and
    ``GroupBounds``: items of its smallest region, and (local, remote) tokens a page."""

    remote_items: int
    page_tokens: tuple[int, int]

    @property
    def by_token(self) -> bool:
        return self.page_tokens != (0, 0)

    @property
    def remote_pages(self) -> int:
        """The bound for the peer's page indices (its requests name pages, not tokens)."""
        return self.remote_items // self.page_tokens[1] if self.by_token else self.remote_items


@dataclass
class GroupLink(_Bounds):
    """One buffer group (kv, aux, stateN) between us and a peer."""

    geometry: Geometry
    local: _Side
    remote: _Side
    unit_bytes: int  # bytes moved per item across all regions
    num_regions: int
    remote_items: int  # smallest destination region, in items: the bound for indices
    local_items: int
    # (local, remote) tokens a page when the sides' pages differ: items are token rows
    # and chunks are paired token by token (``items_of``); (0, 0): items are pages
    page_tokens: tuple[int, int] = (0, 0)
    local_regions: RegionSet | None = None  # the local buffers as this link addresses them

    def items_of(
        self, pages: np.ndarray, dst_pages: np.ndarray, index_slice: slice, tokens: int | None
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Source items, destination items and the first destination item's position in
        the request, for a chunk of source ``pages`` at ``index_slice`` of the request's
        destination ``dst_pages`` (pages, or token rows when the page sizes differ).
        A ``TransferError`` says what the peer got wrong ("gave ...")."""
        if not self.by_token:
            dst = dst_pages[index_slice]
            if len(dst) != len(pages):
                raise TransferError(
                    f"gave {len(dst_pages)} pages, prefill sends {index_slice.stop} (chunk "
                    f"{index_slice.start}:{index_slice.stop}): page counts disagree"
                )
            return pages, dst, int(index_slice.start)
        first = int(index_slice.start) * self.page_tokens[0]
        try:
            src, dst = paired_tokens(pages, dst_pages, first, tokens, self.page_tokens)
        except ValueError as exc:
            raise TransferError(
                f"gave pages of {self.page_tokens[1]} tokens for pages of "
                f"{self.page_tokens[0]}: {exc}"
            ) from exc
        return src, dst, first


@dataclass(frozen=True)
class GroupBounds(_Bounds):
    """What a peer's transfer request is checked against before its link exists: the
    bounds of one of its groups as the link will address it (``TransferEngine.bounds``)."""

    remote_items: int
    page_tokens: tuple[int, int] = (0, 0)


@dataclass
class PeerLink:
    """Everything prepared for WRITEs to one remote agent."""

    name: str
    groups: dict[str, GroupLink] = field(default_factory=dict)
    # the peer's KV pool mapped through CUDA IPC, when our GPU can reach it (``one_pass``)
    one_pass: OnePassLink | None = None
    # set by ``unlink``: WRITEs are posted under ``lock`` and refused once it is set, so a
    # WRITE never uses a released list, and one the worker posts after the peer was
    # dropped fails instead of posting nothing (a room could then end Success, unwritten)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def shares(self, a: str, b: str) -> bool:
        """Whether groups ``a`` and ``b`` are in the same prepared lists on both sides, so
        their items can go in one WRITE."""
        ga, gb = self.groups.get(a), self.groups.get(b)
        return (
            ga is not None
            and gb is not None
            and ga.local.dlist is gb.local.dlist
            and ga.remote.dlist is gb.remote.dlist
        )


#: The groups a link prepares in one list per side when each side holds them in one memory
#: kind: a room's last KV chunk and its aux row then go in one NIXL request.
JOINT = ("kv", "aux")


def joint_rows(
    parts: Sequence[tuple[Geometry, RegionSet]], side: str
) -> tuple[np.ndarray, list[np.ndarray]]:
    """One strided list of several groups' regions, and where each group's regions start
    in it (each group indexes it as its own list, from its offsets)."""
    rows = np.vstack([geo.strided(regions, side) for geo, regions in parts])
    offsets = region_offsets(np.concatenate([geo.unit_counts(r) for geo, r in parts]))
    ends = np.cumsum([len(regions) for _, regions in parts])
    return rows, np.split(offsets, ends[:-1])
