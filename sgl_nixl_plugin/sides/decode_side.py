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
from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.sides.context import DecodeContext
from sgl_nixl_plugin.sides.decode_listener import DecodeListener
from sgl_nixl_plugin.sides.decode_policy import DecodePolicy
from sgl_nixl_plugin.sides.decode_staging import DecodeStaging
from sgl_nixl_plugin.sides.decode_warmup import StartupRegistration
from sgl_nixl_plugin.transport import bootstrap_client, requests_prewarm
from sgl_nixl_plugin.wire.notes import count_note, decode_note

Endpoint = tuple[str, int]

#: The largest room whose requests ask for notes. A room's notes end it one status hop
#: (~0.3-0.5 ms on a loaded 2-core host) sooner, but only for a scheduler that polls while
#: it waits: below this size that hop is most of the room's time; above it the WRITE's
#: time dwarfs it, and polling through a long WRITE takes CPU a CPU-driven transport
#: needs (256-token rooms, 8 MiB, were 1.22-1.34x slower with notes over UCX/TCP).
NOTES_MAX_BYTES = 4 << 20

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
        if self.ctx.settings.warmup:  # the first request's bootstrap query, paid now
            ms = requests_prewarm.pay_first_call()
            if ms is not None:
                logger.debug("sgl-nixl: SGLang's HTTP client warmed in %.1f ms", ms)

    def ensure_prefill(self, addr: str, request_waits: bool) -> bool:
        """SGLang's first look at a prefill (``ctx.first_look``), its warm-up started beside
        it (``DecodeWarmup.ensure``); the listener progresses the warm-up's WRITE."""
        expect, look = self.listener.expect_data, self.ctx.first_look
        return self.ctx.warmup.ensure(addr, request_waits, look, lambda: expect(warmup=True))

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
    ) -> tuple[list[int], bool, tuple[int, int] | None, bool]:
        """One transfer request of ``room`` is being built, to the prefill rank next in
        SGLang's ``bootstrap_infos`` order: (the slots granted in it, whether it asks for
        staged pieces, its completion flag, whether it asks for notes). A rank that writes
        our device pages in one pass gets no slots, and a flag word if it mapped our board;
        one that declined our staging area none either (``StagingOffers``); one that writes
        them directly puts a note on its WRITEs (``check_notes``)."""
        target = self.ctx.rooms.next_target(room)
        if dummy:
            return [], False, None, False
        self.listener.expect_data()
        flag = None
        if not host and target in self.ctx.one_pass:
            staged = False
            flag = decode_status.take_flag(self.ctx, room, target)
        notes = self._asks_notes(room, target, flag, len(pages))
        staging = self.ctx.staging
        if not staged or staging is None or not staging.offers.stages_to(target):
            return [], False, flag, notes
        grant = staging.grant
        return grant(room, pages, target, self.ctx.sglang.senders_of(room)), True, flag, notes

    def _asks_notes(self, room: int, target: Endpoint | None, flag: Any, pages: int) -> bool:
        """Whether a request asks for notes: the setting allows it, the rank does not write
        in one pass and the room is small (``NOTES_MAX_BYTES``). A staged request may too:
        its prefill sends the count only when none of the room's chunks went staged (no
        piece then waits for a scatter here)."""
        rec = self.ctx.rooms.get(room)
        if not self.ctx.settings.write_notes or flag is not None or rec is None:
            return False
        if pages * sum(self.ctx.engine.memory.kv.item_lens) > NOTES_MAX_BYTES:
            return False
        if target in self.ctx.one_pass:
            return False
        rec.noting = True
        return True

    def check_flags(self, room: int) -> None:
        """Apply what ``room``'s stored completion flags say (``decode_status``)."""
        decode_status.check_flags(self.ctx, room)

    def check_notes(self, room: int) -> None:
        """Count the notes on the direct WRITEs that landed (``wire.notes``), and apply the
        Success of every prefill rank whose WRITEs all did: the scheduler calls this through
        the receiver's ``poll()``, so a direct room ends as its last WRITE lands, not after
        the worker's completion poll, the status message and the listener (those still
        come, and the status is then a no-op). Notes of rooms that ended are dropped."""
        rec = self.ctx.rooms.get(room)
        if rec is None or not rec.noting:
            return
        sg, rooms = self.ctx.sglang, self.ctx.rooms
        for msgs in self.ctx.engine.agent.notifications().values():
            for raw in msgs:
                note = decode_note(raw)
                other = rooms.get(note.room) if note is not None else None
                if note is None or other is None or not other.noting:
                    continue
                if count_note(other.notes, note.prefill_rank, note.total):
                    self.ctx.note_hits += 1
                    decode_status.success_in(self.ctx, note.room, note.prefill_rank)
                    other.noting = sg.is_open(note.room)  # other ranks' Success due
        if not sg.is_open(room):
            rec.noting = False

    def flags_pending(self) -> bool:
        """Whether a room waits for a completion flag or its WRITEs' notes (a poller may
        then poll sooner: nothing rings when they land)."""
        return any(r.flags_due or r.noting for r in self.ctx.rooms.records())

    def close_room(self, room: int, ok: bool) -> None:
        """SGLang cleared the receiver: the room's record goes (its flag words with it), its
        slots return."""
        rec = self.ctx.rooms.get(room)
        if rec is not None:
            self._report(rec, ok)
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
        if self.ctx.first_look is not None:
            out["count.topology_from_route_table"] = self.ctx.first_look.answered
        if self.ctx.flags is not None:
            out["decode.flag_words"] = self.ctx.flags.in_use
            out["count.flag_hits"] = self.ctx.flag_hits
            out["count.flags_given"] = self.ctx.flags_given
        out["count.note_hits"] = self.ctx.note_hits
        return out
