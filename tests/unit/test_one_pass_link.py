"""The one-pass link's fences and the settings that allow it, without a GPU (the copies
themselves: tests/e2e/test_one_pass.py and tests/component/test_cuda_ipc.py, on a GPU)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from sgl_nixl_plugin.engine.agent import TransferError
from sgl_nixl_plugin.engine.layout import Geometry, RegionSet
from sgl_nixl_plugin.engine.one_pass import OnePassLink
from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.sides.one_pass import allowed, warm_kernel


class _Mapping:
    """Counts unmaps (the real one calls cudaIpcCloseMemHandle per block)."""

    def __init__(self) -> None:
        self.closes = 0

    def close(self) -> None:
        self.closes += 1


def _link(mapping: _Mapping, item_lens=(1024, 1024)) -> OnePassLink:
    local = RegionSet.of([4096, 8192], [4096, 4096], list(item_lens), "VRAM")
    return OnePassLink(
        mapping,
        "decode-7",
        local,
        np.array([1 << 20, 2 << 20], dtype=np.uint64),
        Geometry.whole_items(),
        same_device=True,
    )


def test_a_closed_link_launches_nothing_and_unmaps_once() -> None:
    mapping = _Mapping()
    op = _link(mapping)
    op.close()
    op.close()
    assert mapping.closes == 1 and op.closed
    with pytest.raises(TransferError, match="decode decode-7: its mapped KV pool was released"):
        op.write(None, np.array([1]), np.array([2]), None)


def test_regions_of_different_item_sizes_are_refused_for_one_pass() -> None:
    with pytest.raises(ValueError, match="differ in item size"):
        _link(_Mapping(), item_lens=(1024, 2048))


def test_mismatched_counts_are_refused_before_any_launch() -> None:
    op = _link(_Mapping())
    with pytest.raises(TransferError, match="2 source items for 1 destinations"):
        op.write(None, np.array([1, 2]), np.array([3]), None)


@pytest.mark.parametrize(
    ("path", "ipc", "on"),
    [
        ("auto", True, True),
        ("ipc", True, True),
        ("direct", True, False),
        ("staging", True, False),
        ("auto", False, False),
    ],
)
def test_direct_staging_or_cuda_ipc_off_forbid_the_one_pass_path(path, ipc, on) -> None:
    assert allowed(Settings(transfer_path=path, cuda_ipc=ipc)) is on


class _PairWarmer:
    def __init__(self, fails: bool = False) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self.fails = fails

    def warmup_pair(self, *shape: int) -> None:
        self.shapes.append(shape)
        if self.fails:
            raise RuntimeError("wrong bytes")


def test_prefill_start_up_compiles_the_equal_layout_one_pass_copy(caplog) -> None:
    """Whole pages of the prefill's own item size, no offsets: the shape an equal-layout
    decode's link uses, so its setup finds the copy compiled; nothing when the settings
    rule one pass out or the copier has no pair copy; a failure is a warning, not a crash."""
    c = _PairWarmer()
    warm_kernel(Settings(), c, 4096)
    assert c.shapes == [(4096, 4096, 0, 4096, 0)]
    for settings in (Settings(transfer_path="direct"), Settings(cuda_ipc=False)):
        warm_kernel(settings, c, 4096)
    warm_kernel(Settings(), c, 0)
    warm_kernel(Settings(), object(), 4096)
    assert len(c.shapes) == 1
    bad = _PairWarmer(fails=True)
    with caplog.at_level(logging.WARNING):
        warm_kernel(Settings(), bad, 512)
    assert bad.shapes == [(512, 512, 0, 512, 0)]
    assert "one-pass copy not compiled at start-up: wrong bytes" in caplog.text
