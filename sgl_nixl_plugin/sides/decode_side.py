"""A decode rank's side of the manager: its listener, and the staging path's threads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from sgl_nixl_plugin.protocol.decode_rooms import DecodeRoom
from sgl_nixl_plugin.registry import manager as registry
from sgl_nixl_plugin.registry.spec import ReceiveEvent
from sgl_nixl_plugin.sides.context import DecodeContext
from sgl_nixl_plugin.sides.decode_listener import DecodeListener
from sgl_nixl_plugin.sides.decode_policy import DecodePolicy
from sgl_nixl_plugin.sides.decode_staging import SUCCESS, DecodeStaging
from sgl_nixl_plugin.sides.decode_warmup import StartupRegistration
from sgl_nixl_plugin.transport import bootstrap_client

Endpoint = tuple[str, int]

logger = logging.getLogger(__name__)


class DecodeSide:
    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self.policy = DecodePolicy(ctx)
        self.listener = DecodeListener(self.policy)
        self.startup: StartupRegistration | None = None

    @property
    def rooms(self) -> Any:
        return self.ctx.rooms

    @property
    def staging(self) -> DecodeStaging | None:
        return self.ctx.staging

    def start(self) -> None:
        if self.ctx.staging is not None:
            self.ctx.staging.start()
        self.listener.start()

    def register_at_start(self, addrs: tuple[str, ...], ensure: Callable[[str], bool]) -> None:
        """Register with the prefills an operator named (``SGLANG_NIXL_PLUGIN_PREFILLS``),
        each once it is up, in a thread of its own; ``ensure`` is SGLang's first look at a
        prefill (``try_ensure_parallel_info``), which starts its warm-up."""
        if not addrs:
            return
        settings = self.ctx.settings
        if not settings.warmup:
            logger.warning(
                "sgl-nixl: SGLANG_NIXL_PLUGIN_PREFILLS is set but the warm-up is off "
                "(SGLANG_NIXL_PLUGIN_WARMUP=0): this decode registers with prefills at their "
                "first request only"
            )
            return
        secret = settings.secret
        self.startup = StartupRegistration(
            addrs, lambda addr: bootstrap_client.prefill_up(addr, secret), ensure
        )
        self.startup.start()

    def request(
        self, room: int, pages: np.ndarray, staged: bool, dummy: bool = False, host: bool = False
    ) -> tuple[list[int], bool, tuple[int, int] | None]:
        """One transfer request of ``room`` is being built, to the prefill rank next in
        SGLang's ``bootstrap_infos`` order: (the slots granted in it, whether it asks for
        staged pieces, its completion flag). A rank that writes our device pages in one
        pass gets no slots, and a flag word if it mapped our board; one that declined our
        staging area none either (``StagingOffers``)."""
        target = self.ctx.rooms.next_target(room)
        if dummy:
            return [], False, None
        self.listener.expect_data()
        flag = None
        if not host and target in self.ctx.one_pass:
            staged = False
            flag = self._take_flag(room, target)
        staging = self.ctx.staging
        if not staged or staging is None or not staging.offers.stages_to(target):
            return [], False, flag
        grant = staging.grant
        return grant(room, pages, target, self.ctx.sglang.senders_of(room)), True, flag

    def _take_flag(self, room: int, target: Endpoint | None) -> tuple[int, int] | None:
        """A board word and value for ``target``'s one-pass writes of ``room``, or None
        (no board, the rank did not map it, or every word is taken)."""
        board = self.ctx.flags
        rank = self.ctx.flag_ranks.get(target) if target is not None else None
        rec = self.ctx.rooms.get(room)
        if board is None or rank is None or rec is None:
            return None
        got = board.take()
        if got is not None:
            self.ctx.flags_given += 1
            rec.flag_words.append(got[0])
            rec.flags_due.append((got[0], got[1], rank))
        return got

    def check_flags(self, room: int) -> None:
        """Apply the Success of every one-pass sender of ``room`` whose flag is stored: the
        scheduler calls this through the receiver's ``poll()``, so a room ends as its last
        copy ends, not after the status message's hop (which still comes, and is a no-op)."""
        rec = self.ctx.rooms.get(room)
        if rec is None or not rec.flags_due:
            return
        board = self.ctx.flags
        due = rec.flags_due
        seen = [f for f in due if board.seen(f[0], f[1])]
        if not seen:
            return
        rec.flags_due = [f for f in due if f not in seen]
        sg, rooms = self.ctx.sglang, self.ctx.rooms
        rooms.mark(room, "status", first=True)
        for _, _, rank in seen:
            self.ctx.flag_hits += 1
            if sg.is_pending(room):  # not over an abort or a failure already applied
                sg.apply_status(room, SUCCESS, rank, "")
        rooms.mark(room, "applied", first=True)

    def flags_pending(self) -> bool:
        """Whether a room waits for a completion flag (a poller may then poll sooner)."""
        return any(r.flags_due for r in self.ctx.rooms.records())

    def close_room(self, room: int, ok: bool) -> None:
        """SGLang cleared the receiver: the room's record goes, its slots return."""
        rec = self.ctx.rooms.get(room)
        if rec is not None:
            self._report(rec, ok)
        if rec is not None and rec.flag_words and self.ctx.flags is not None:
            for word in rec.flag_words:  # reused only after every other word
                self.ctx.flags.free(word)
            rec.flag_words, rec.flags_due = [], []
        grants = self.ctx.rooms.close(room, ok)
        if self.ctx.staging is not None:
            self.ctx.staging.messenger(grants)

    def _report(self, rec: DecodeRoom, ok: bool) -> None:
        """The room's DEBUG line and its ``ReceiveEvent`` for observers."""
        ended = time.perf_counter()
        t = rec.timeline(ended)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "sgl-nixl decode room %s: %s staged=%s senders=%d %s",
                rec.room,
                "ok" if ok else "failed",
                rec.staged,
                rec.senders,
                " ".join(f"{k}={v:g}" for k, v in t.items()),
            )
        t.update(rec.stamps(ended))
        registry.notify_receive(ReceiveEvent(rec.room, ok, rec.staged, rec.senders, t))

    def threads(self) -> list[threading.Thread]:
        out = [self.listener.thread]
        if self.startup is not None:
            out.append(self.startup.thread)
        if self.ctx.staging is not None:
            out += [self.ctx.staging.thread, self.ctx.staging.completer]
        return out

    def stop(self) -> None:
        if self.startup is not None:
            self.startup.stop()
        self.listener.stop()
        if self.ctx.staging is not None:
            self.ctx.staging.stop()

    def close_flags(self) -> None:
        """Remove our flag board (after the prefills' links went: at shutdown)."""
        if self.ctx.flags is not None:
            self.ctx.flags.close()

    def sizes(self) -> dict[str, int]:
        out = {f"decode.{k}": v for k, v in self.ctx.rooms.sizes().items()}
        out.update({f"count.staging.{k}": v for k, v in asdict(self.ctx.rooms.counters).items()})
        if self.ctx.staging is not None:
            out.update(self.ctx.staging.memory.counts())
            out["count.staging.offers"] = self.ctx.staging.offers.sent
        if self.ctx.warmup is not None:
            out["count.warmed_prefills"] = self.ctx.warmup.warmed()
            out["count.warmup_routes_reused"] = self.ctx.warmup.routes_reused
        if self.ctx.flags is not None:
            out["decode.flag_words"] = self.ctx.flags.in_use
            out["count.flag_hits"] = self.ctx.flag_hits
            out["count.flags_given"] = self.ctx.flags_given
        return out
