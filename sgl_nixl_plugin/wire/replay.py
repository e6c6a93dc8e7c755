"""Replay guard for signed control messages.

The MAC proves a message came from a holder of the shared secret, and the send time bounds
how old it may be (``Codec.max_skew_s``), but within that window a captured message could be
sent again: a second ``TransferStatus`` for a room, a ``SlotGrant``, an ``Abort``. Every
signed message carries a send time with microsecond resolution, so no two genuine messages
share a MAC; the guard remembers the MACs it accepted until their send time leaves the
window, and refuses a second copy.

Memory is bounded (``max_entries``, oldest forgotten first; ~100 bytes each): a peer that
sends more than that many messages within the window pushes old MACs out, which only
reopens replays of those, never refuses a genuine message.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class ReplayGuard:
    def __init__(self, window_s: float, max_entries: int = 200_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # mac -> forget after (local)
        self._lock = threading.Lock()

    def first_time(self, mac: bytes, now: float) -> bool:
        """True for a MAC not seen within the window (and remember it); False for a copy."""
        with self._lock:
            while self._seen:
                oldest, until = next(iter(self._seen.items()))
                if until > now and len(self._seen) < self.max_entries:
                    break
                del self._seen[oldest]
            if mac in self._seen:
                return False
            # accepted while |now - sent_at| <= window, so a copy is acceptable at most 2
            # windows after this arrival (sender clock ahead by the window, then behind)
            self._seen[mac] = now + 2 * self.window_s
            return True

    def __len__(self) -> int:
        return len(self._seen)
