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
from sgl_nixl_plugin.transport import bootstrap_client
from sgl_nixl_plugin.wire.messages import StagingArea

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

    def staging_area(self) -> StagingArea | None:
        return self.ctx.staging.area() if self.ctx.staging is not None else None

    def request(
        self, room: int, pages: np.ndarray, staged: bool, dummy: bool = False, host: bool = False
    ) -> tuple[list[int], bool, tuple[int, int] | None]:
        """One transfer request of ``room`` is being built, to the prefill rank next in
        SGLang's ``bootstrap_infos`` order: (the slots granted in it, whether it asks for
        staged pieces, its completion flag). A rank that writes our device pages in one
        pass gets no slots, and a flag word if it mapped our board."""
        target = self.ctx.rooms.next_target(room)
        if dummy:
            return [], False, None
        self.listener.expect_data()
        flag = None
        if not host and target in self.ctx.one_pass:
            staged = False
            flag = decode_status.take_flag(self.ctx, room, target)
        if not staged or self.ctx.staging is None:
            return [], False, flag
        grant = self.ctx.staging.grant
        return grant(room, pages, target, self.ctx.sglang.senders_of(room)), True, flag

    def check_flags(self, room: int) -> None:
        """Apply what ``room``'s stored completion flags say (``decode_status``)."""
        decode_status.check_flags(self.ctx, room)

    def flags_pending(self) -> bool:
        """Whether a room waits for a completion flag (a poller may then poll sooner)."""
        return any(r.flags_due for r in self.ctx.rooms.records())

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
        if self.ctx.warmup is not None:
            out["count.warmed_prefills"] = self.ctx.warmup.warmed()
            out["count.warmup_routes_reused"] = self.ctx.warmup.routes_reused
        if self.ctx.flags is not None:
            out["decode.flag_words"] = self.ctx.flags.in_use
            out["count.flag_hits"] = self.ctx.flag_hits
            out["count.flags_given"] = self.ctx.flags_given
        return out
