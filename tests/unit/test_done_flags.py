"""The decode's completion-flag board, without a GPU: words and values handed out, a store
made by another process seen, the file removed, and what a prefill refuses to open before
it touches CUDA (the store on a copy stream: tests/e2e/test_one_pass.py, on a GPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import msgspec
import numpy as np
import pytest

from sgl_nixl_plugin.engine import done_flags
from sgl_nixl_plugin.engine.done_flags import FlagBoard, FlagError, FlagWriter, check_path
from sgl_nixl_plugin.engine.one_pass import OnePassLink
from sgl_nixl_plugin.wire import messages as m

STORE = """
import mmap, os, sys
import numpy as np
fd = os.open(sys.argv[1], os.O_RDWR)
mm = mmap.mmap(fd, int(sys.argv[2]) * 4)
np.frombuffer(mm, dtype=np.int32)[int(sys.argv[3])] = int(sys.argv[4])
"""


@pytest.fixture
def board():
    b = FlagBoard(slots=8)
    yield b
    b.close()


def test_words_and_values_are_handed_out_once_and_reused_last(board: FlagBoard) -> None:
    taken = [board.take() for _ in range(8)]
    assert sorted(w for w, _ in taken) == list(range(8))
    assert len({v for _, v in taken}) == 8 and all(v > 0 for _, v in taken)
    assert board.take() is None and board.in_use == 8  # full: the status message serves
    board.free(3)
    board.free(5)
    word, value = board.take()
    assert word == 3 and value not in {v for _, v in taken}
    assert board.in_use == 7


def test_a_value_stored_by_another_process_is_seen_for_its_word_only(board: FlagBoard) -> None:
    word, value = board.take()
    other, other_value = board.take()
    assert not board.seen(word, value)
    subprocess.run(
        [sys.executable, "-c", STORE, board.path, "8", str(word), str(value)],
        check=True,
        timeout=30,
    )
    assert board.seen(word, value)
    assert not board.seen(other, other_value)
    assert not board.seen(word, value + 1)  # a late store of another room's value


def test_closing_removes_the_file_and_sees_nothing_more(board: FlagBoard) -> None:
    word, value = board.take()
    board.words[word] = value
    path = board.path
    assert os.path.exists(path) and os.stat(path).st_mode & 0o777 == 0o600
    board.close()
    board.close()
    assert not os.path.exists(path)
    assert not board.seen(word, value) and board.take() is None


def test_a_board_left_by_a_killed_decode_is_removed_by_the_next_one() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from sgl_nixl_plugin.engine.done_flags import FlagBoard; "
            "b = FlagBoard(slots=8); print(b.path, flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        left = proc.stdout.readline().strip()
        assert os.path.exists(left)
        mine = FlagBoard(slots=8)  # the other decode lives: its board stays
        assert os.path.exists(left) and os.path.exists(mine.path)
        mine.close()
        proc.kill()
        proc.wait(timeout=30)
        assert os.path.exists(left)  # killed: nothing removed it
        mine = FlagBoard(slots=8)
        assert not os.path.exists(left) and os.path.exists(mine.path)
        mine.close()
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_board_paths_match_what_the_wire_accepts(board: FlagBoard) -> None:
    assert re.match(done_flags.PATH_PATTERN, board.path)
    assert re.match(m.FLAG_PATH, board.path) and re.match(m.FLAG_PATH, "")
    assert done_flags.MAX_SLOTS == m.FLAG_MAX_SLOTS
    ipc = m.CudaIpc("h", "u", 1, [], flag_board=board.path, flag_slots=board.slots)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ipc), type=m.CudaIpc) == ipc


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "/dev/shm/sgl-nixl-flags-1-../x", "/dev/shm/sgl-nixl-flags-ab", "/tmp/a"],
)
def test_the_wire_refuses_a_board_anywhere_else(path: str) -> None:
    raw = msgspec.msgpack.encode(m.CudaIpc("h", "u", 1, [], flag_board=path, flag_slots=8))
    with pytest.raises(msgspec.ValidationError, match="flag_board"):
        msgspec.msgpack.decode(raw, type=m.CudaIpc)


def test_the_wire_bounds_a_requests_flag_word() -> None:
    ok = m.TransferRequest(1, "d", "127.0.0.1", 1, -1, 1, done_flag=7, done_value=3)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(ok), type=m.TransferRequest) == ok
    for bad in ({"done_flag": m.FLAG_MAX_SLOTS}, {"done_flag": -2}, {"done_value": -1}):
        raw = msgspec.msgpack.encode(m.TransferRequest(1, "d", "127.0.0.1", 1, -1, 1, **bad))
        with pytest.raises(msgspec.ValidationError, match="done_"):
            msgspec.msgpack.decode(raw, type=m.TransferRequest)


def test_a_prefill_opens_only_a_board_file_of_its_user_and_size(board: FlagBoard, tmp_path) -> None:
    assert check_path(board.path, 8) is None
    assert "not a flag board path" in check_path("/etc/passwd", 8)
    assert "out of range" in check_path(board.path, 0)
    with pytest.raises(FlagError, match="not a flag board path"):
        FlagWriter("/etc/passwd", 8, 0)
    with pytest.raises(FlagError, match="holds 32 bytes, not 64"):
        FlagWriter(board.path, 16, 0)
    link = f"/dev/shm/sgl-nixl-flags-{os.getpid()}-{'0' * 15}1"
    os.symlink(board.path, link)
    try:
        with pytest.raises(FlagError, match="cannot open"):
            FlagWriter(link, 8, 0)  # a link planted under the pattern is not followed
    finally:
        os.unlink(link)


def test_a_link_without_a_board_refuses_to_signal() -> None:
    from sgl_nixl_plugin.engine.agent import TransferError
    from sgl_nixl_plugin.engine.layout import Geometry, RegionSet

    class _Mapping:
        def close(self) -> None:
            pass

    local = RegionSet.of([4096], [4096], [1024], "VRAM")
    op = OnePassLink(
        _Mapping(), "decode-3", local, np.array([1 << 20], np.uint64), Geometry.whole_items(), True
    )
    with pytest.raises(TransferError, match="decode decode-3: its flag board was released"):
        op.signal(0, 1, None)
