"""Per-request descriptor arithmetic: numpy only, no Python loop per page.

Descriptor lists are prepared once per peer as strided lists (see ``layout``), so a
request only needs the *indices* of its units in those lists. NIXL merges descriptors
that are adjacent on both sides, so a run of pages that is contiguous on both sides goes
out as one descriptor per region; ``count_runs`` predicts that count for planning and
metrics.
"""

from __future__ import annotations

import numpy as np

from sgl_nixl_plugin.engine.layout import Geometry

#: The largest descriptor index (NIXL takes int32 indices); ``np.iinfo`` costs ~1 µs a call.
INT32_MAX = int(np.iinfo(np.int32).max)


def region_offsets(unit_counts: np.ndarray) -> np.ndarray:
    """Index of each region's first unit in the flattened strided list."""
    offsets = np.zeros(len(unit_counts), dtype=np.int64)
    np.cumsum(unit_counts[:-1], out=offsets[1:])
    return offsets


def unit_indices(
    items: np.ndarray, offsets: np.ndarray, units_per_item: int, regions: np.ndarray | None = None
) -> np.ndarray:
    """int32 indices of every unit of ``items`` in every region (region-major order)."""
    items = np.asarray(items, dtype=np.int64)
    if units_per_item > 1:
        units = (items[:, None] * units_per_item + np.arange(units_per_item)).ravel()
    else:
        units = items
    base = offsets if regions is None else offsets[regions]
    # The largest index is max(base) + max(units): items and regions need not be sorted.
    if len(base) and len(units) and int(base.max()) + int(units.max()) > INT32_MAX:
        raise OverflowError("descriptor index beyond int32: region set too large for one list")
    idx = base[:, None] + units[None, :]
    return idx.astype(np.int32, copy=False).ravel()


def count_runs(src: np.ndarray, dst: np.ndarray) -> int:
    """Number of maximal runs in which both page sequences advance by exactly one."""
    n = len(src)
    if n <= 1:  # a one-page chunk (the commonest small request): no arithmetic
        return n
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    # slices, not np.diff: its Python wrapper costs more than the work on short arrays
    breaks = (src[1:] - src[:-1] != 1) | (dst[1:] - dst[:-1] != 1)
    return 1 + int(np.count_nonzero(breaks))


def expected_descriptors(
    src: np.ndarray, dst: np.ndarray, num_regions: int, geometry: Geometry
) -> int:
    """Descriptors NIXL will post for these pages once adjacent ones are merged."""
    if geometry.merges_across_items:
        return num_regions * count_runs(src, dst)
    return num_regions * len(src) * geometry.units_per_item


def naive_descriptors(n_items: int, num_regions: int, geometry: Geometry) -> int:
    """One descriptor per page (or per token slice) per region: the unmerged count."""
    return num_regions * n_items * geometry.units_per_item


def token_slots(pages: np.ndarray, page_size: int) -> np.ndarray:
    """int64 token slots of ``pages`` (``page_size`` tokens each), in page order."""
    pages = np.asarray(pages, dtype=np.int64)
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()


def paired_tokens(
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    first: int,
    tokens: int | None,
    page_sizes: tuple[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """Source and destination token slots of one chunk when the two sides' pages differ.

    ``src_pages`` hold the chunk (``page_sizes[0]`` tokens each, its first token at the
    start of the first page); ``dst_pages`` are the whole request's destination pages
    (``page_sizes[1]`` tokens each), and the chunk starts at its token ``first``.
    ``tokens`` is the chunk's token count (None: every token of its pages, as far as the
    destination reaches). ValueError when the destination cannot hold the chunk.
    """
    ps, pd = page_sizes
    have = len(src_pages) * ps
    n = have if tokens is None else int(tokens)
    if not 0 <= n <= have:
        raise ValueError(f"{n} tokens do not fit {len(src_pages)} source pages of {ps}")
    if n == 0:  # a chunk without KV (e.g. a last one that carries only aux and state)
        empty = np.empty(0, dtype=np.int64)
        return empty, empty
    room = len(dst_pages) * pd - first
    if n > room:
        if tokens is not None or room <= max(0, have - ps):
            raise ValueError(
                f"the destination's {len(dst_pages)} pages of {pd} tokens hold "
                f"{max(room, 0)} tokens from token {first}; the chunk has {n}"
            )
        n = room  # the last source page's tail beyond the request
    lo, hi = first // pd, -(-(first + n) // pd)
    dst = token_slots(np.asarray(dst_pages)[lo:hi], pd)[first - lo * pd :][:n]
    return token_slots(src_pages, ps)[:n], dst


def validate_items(items: np.ndarray, limit: int, what: str) -> str | None:
    """An error message if any index is outside ``[0, limit)``, else None."""
    if len(items) == 0:
        return None
    lo, hi = int(items.min()), int(items.max())
    if lo < 0 or hi >= limit:
        return f"{what} index out of range: [{lo}, {hi}] not within [0, {limit})"
    return None
