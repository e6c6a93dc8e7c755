"""A request's chunks as the drivers send them (bench, fault harness, soak): SGLang's sender
calls the chunk that completes the pages its last (aux row with it) and ignores sends after
the room ends, while the scheduler hands the per-request state to its own last send. The two
must be the same chunk, or the state can miss the room (the 10k soak's bad state rows)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from sgl_nixl_plugin.bench.workload import Request


def sglang_last_flags(parts: list[np.ndarray], num_pages: int) -> list[bool]:
    """Per send, whether SGLang's sender calls it the last chunk (its index reaches the
    page count given at ``init``)."""
    done, out = 0, []
    for p in parts:
        done += len(p)
        out.append(done == num_pages)
    return out


@given(
    tokens=st.integers(1, 200),
    page_size=st.sampled_from([1, 16, 64]),
    chunks=st.integers(1, 6),
)
def test_only_the_drivers_last_send_is_sglangs_last_chunk(
    tokens: int, page_size: int, chunks: int
) -> None:
    r = Request(room=1, tokens=tokens, chunks=chunks, contiguous=False, with_state=True)
    pages = np.arange(r.pages(page_size), dtype=np.int32) + 100
    parts = r.split(pages)
    assert np.array_equal(np.concatenate(parts), pages)
    assert 1 <= len(parts) <= chunks
    assert all(len(p) for p in parts)
    # the drivers attach the state to their final send: SGLang must call it last, and no
    # earlier one (which would let the room end before the state is sent)
    assert sglang_last_flags(parts, len(pages)) == [False] * (len(parts) - 1) + [True]


def test_a_one_page_request_in_two_chunks_is_sent_whole() -> None:
    r = Request(room=1, tokens=8, chunks=2, contiguous=False, with_state=True)
    parts = r.split(np.array([5], dtype=np.int32))
    assert [p.tolist() for p in parts] == [[5]]
