"""The completion note a direct WRITE carries to the decode (its NIXL notification).

NIXL hands the target a WRITE's notification only once that WRITE's bytes are in place, so
a decode that counts a room's notes knows the room landed without the prefill's status
message (which still follows). Each note names the room, the prefill rank, its number among
that rank's WRITEs of the room, and, on the rank's last WRITE only, how many there are.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

_NOTE = struct.Struct("<4sQIII")
MAGIC = b"sgn1"


class Note(NamedTuple):
    room: int
    prefill_rank: int
    seq: int  # 1, 2, ... among this rank's WRITEs of the room
    total: int  # this rank's WRITEs of the room, on its last one; 0 on the others


def encode_note(room: int, prefill_rank: int, seq: int, total: int) -> bytes:
    return _NOTE.pack(MAGIC, room, prefill_rank, seq, total)


def decode_note(raw: bytes) -> Note | None:
    """The note in ``raw``, or None when it is not one of ours (or malformed)."""
    if len(raw) != _NOTE.size or not raw.startswith(MAGIC):
        return None
    _, room, rank, seq, total = _NOTE.unpack(raw)
    if seq == 0 or (total and seq != total) or room >= 1 << 63:
        return None
    return Note(room, rank, seq, total)


def count_note(seen: dict[int, list[int]], rank: int, total: int) -> bool:
    """One of ``rank``'s notes landed (``total``: the count it carried, 0 until its last
    WRITE); ``seen`` maps rank -> [notes seen, notes owed]. Whether that rank's WRITEs have
    now all landed."""
    got = seen.setdefault(rank, [0, 0])
    got[0] += 1
    got[1] = total or got[1]
    return got[0] == got[1]
