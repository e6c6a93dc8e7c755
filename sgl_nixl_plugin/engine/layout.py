"""Memory layouts and the geometry that maps a source page onto a destination page.

A ``RegionSet`` is a list of same-kind buffers (e.g. every layer's K and V) addressed in
fixed-size items (pages). A ``Geometry`` says how one item of a source region lands in a
destination region: whole pages when both sides hold the same heads, or per-token head
slices when tensor-parallel sizes differ. Both become NIXL *strided* descriptor lists
(one Nx5 row per region), so preparing them costs O(regions), not O(pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MEM_KINDS = ("DRAM", "VRAM")


@dataclass(frozen=True)
class RegionSet:
    """Buffers of one memory kind: ``ptrs[i]`` holds ``lens[i]`` bytes in ``item_lens[i]`` items."""

    ptrs: tuple[int, ...]
    lens: tuple[int, ...]
    item_lens: tuple[int, ...]
    devices: tuple[int, ...]
    mem_kind: str

    def __post_init__(self) -> None:
        n = len(self.ptrs)
        if not (len(self.lens) == len(self.item_lens) == len(self.devices) == n):
            raise ValueError("region fields must have equal lengths")
        if self.mem_kind not in MEM_KINDS:
            raise ValueError(f"unknown memory kind {self.mem_kind!r}; expected DRAM or VRAM")
        if any(i <= 0 for i in self.item_lens):
            raise ValueError("item lengths must be positive")

    @classmethod
    def of(
        cls,
        ptrs: list[int],
        lens: list[int],
        item_lens: list[int],
        mem_kind: str,
        device: int | list[int] = 0,
    ) -> RegionSet:
        devices = [device] * len(ptrs) if isinstance(device, int) else list(device)
        return cls(tuple(ptrs), tuple(lens), tuple(item_lens), tuple(devices), mem_kind)

    def __len__(self) -> int:
        return len(self.ptrs)

    @property
    def num_items(self) -> np.ndarray:
        return np.asarray(self.lens, dtype=np.int64) // np.asarray(self.item_lens, dtype=np.int64)

    def per_token(self, tokens_per_item: int) -> RegionSet:
        """The same buffers addressed by token row: a peer of another page size is paired
        token by token, so each item splits into ``tokens_per_item`` rows."""
        if tokens_per_item == 1:
            return self
        if tokens_per_item <= 0 or any(n % tokens_per_item for n in self.item_lens):
            raise ValueError(
                f"items of {self.item_lens[:1]} bytes do not split into {tokens_per_item} tokens"
            )
        rows = tuple(n // tokens_per_item for n in self.item_lens)
        return RegionSet(self.ptrs, self.lens, rows, self.devices, self.mem_kind)

    def pick(self, indices: tuple[int, ...]) -> RegionSet:
        """The regions at ``indices``, in that order (a pipeline stage's layers of a peer
        that holds every layer)."""
        return RegionSet(
            tuple(self.ptrs[i] for i in indices),
            tuple(self.lens[i] for i in indices),
            tuple(self.item_lens[i] for i in indices),
            tuple(self.devices[i] for i in indices),
            self.mem_kind,
        )

    def reg_array(self) -> np.ndarray:
        """Nx3 (address, length, device) rows for ``register_memory``."""
        return np.ascontiguousarray(
            np.array([self.ptrs, self.lens, self.devices], dtype=np.uint64).T
        )


@dataclass(frozen=True)
class Geometry:
    """How a source item maps onto a destination item, as ``units_per_item`` equal units.

    Unit ``u`` of source item ``p`` in region ``r`` starts at
    ``src.ptrs[r] + src_offset + (p * units_per_item + u) * src_stride`` and is written to
    ``dst.ptrs[r] + dst_offset + (q * units_per_item + u) * dst_stride`` for destination
    item ``q``; every unit is ``unit_len`` bytes.
    """

    unit_len: int
    units_per_item: int
    src_stride: int
    dst_stride: int
    src_offset: int = 0
    dst_offset: int = 0

    @classmethod
    def whole_items(cls) -> Geometry:
        """Item to item; ``unit_len`` 0 means "each region's own item length"."""
        return cls(0, 1, 0, 0)

    @property
    def is_whole_items(self) -> bool:
        return self.unit_len == 0

    @classmethod
    def head_slice(
        cls,
        *,
        tokens_per_item: int,
        head_bytes: int,
        src_heads: int,
        dst_heads: int,
        src_tp_rank: int,
        dst_tp_rank: int,
    ) -> Geometry:
        """Per-token head slices between ranks of different tensor-parallel sizes.

        With more source heads than destination heads (decode TP > prefill TP) the source
        sends the destination rank's share of its heads; with fewer (prefill TP > decode
        TP) it writes all of its heads into its share of the destination row.
        """
        if src_heads == dst_heads:
            return cls.whole_items()
        src_row, dst_row = src_heads * head_bytes, dst_heads * head_bytes
        if src_heads > dst_heads:
            if src_heads % dst_heads:
                raise ValueError(f"{src_heads} source heads do not split into {dst_heads}")
            slot = dst_tp_rank % (src_heads // dst_heads)
            return cls(dst_row, tokens_per_item, src_row, dst_row, src_offset=slot * dst_row)
        if dst_heads % src_heads:
            raise ValueError(f"{dst_heads} destination heads do not split into {src_heads}")
        slot = src_tp_rank % (dst_heads // src_heads)
        return cls(src_row, tokens_per_item, src_row, dst_row, dst_offset=slot * src_row)

    def strided(self, regions: RegionSet, side: str) -> np.ndarray:
        """Nx5 (address, unit_len, device, stride, count) rows: one per region."""
        rows = np.empty((len(regions), 5), dtype=np.uint64)
        rows[:, 0] = np.asarray(regions.ptrs, dtype=np.uint64)
        rows[:, 2] = np.asarray(regions.devices, dtype=np.uint64)
        if self.is_whole_items:
            rows[:, 1] = rows[:, 3] = np.asarray(regions.item_lens, dtype=np.uint64)
            rows[:, 4] = regions.num_items.astype(np.uint64)
            return rows
        stride = self.src_stride if side == "src" else self.dst_stride
        rows[:, 0] += np.uint64(self.src_offset if side == "src" else self.dst_offset)
        rows[:, 1] = self.unit_len
        rows[:, 3] = stride
        rows[:, 4] = (regions.num_items * self.units_per_item).astype(np.uint64)
        return rows

    def unit_counts(self, regions: RegionSet) -> np.ndarray:
        """Descriptors per region in the strided list built by ``strided``."""
        return regions.num_items * self.units_per_item

    @property
    def merges_across_items(self) -> bool:
        """Whether consecutive units are adjacent on both sides, so runs of items coalesce."""
        return self.is_whole_items or (
            self.src_stride == self.unit_len and self.dst_stride == self.unit_len
        )
