"""A decode rank's side of the manager: its listener, and the staging path's threads."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from sgl_nixl_plugin.adapter.context import DecodeContext
from sgl_nixl_plugin.adapter.decode import DecodeListener
from sgl_nixl_plugin.adapter.decode_policy import DecodePolicy
from sgl_nixl_plugin.adapter.decode_staging import DecodeStaging
from sgl_nixl_plugin.wire.messages import StagingArea

Endpoint = tuple[str, int]

logger = logging.getLogger(__name__)


class DecodeSide:
    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self.policy = DecodePolicy(ctx)
        self.listener = DecodeListener(self.policy)

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

    def staging_area(self) -> StagingArea | None:
        return self.ctx.staging.area() if self.ctx.staging is not None else None

    def request(
        self, room: int, pages: np.ndarray, staged: bool, dummy: bool = False, host: bool = False
    ) -> tuple[list[int], bool]:
        """One transfer request of ``room`` is being built, to the prefill rank next in
        SGLang's ``bootstrap_infos`` order: (the slots granted in it, whether it asks for
        staged pieces). A rank that writes our device pages in one pass gets no slots."""
        target = self.ctx.rooms.next_target(room)
        if dummy:
            return [], False
        self.listener.expect_data()
        if not host and target in self.ctx.one_pass:
            staged = False
        if not staged or self.ctx.staging is None:
            return [], False
        grant = self.ctx.staging.grant
        return grant(room, pages, target, self.ctx.sglang.senders_of(room)), True

    def close_room(self, room: int, ok: bool) -> None:
        """SGLang cleared the receiver: the room's record goes, its slots return."""
        rec = self.ctx.rooms.get(room)
        if rec is not None and logger.isEnabledFor(logging.DEBUG):
            t = rec.timeline(time.perf_counter())
            logger.debug(
                "sgl-nixl decode room %s: %s staged=%s senders=%d %s",
                room,
                "ok" if ok else "failed",
                rec.staged,
                rec.senders,
                " ".join(f"{k}={v:g}" for k, v in t.items()),
            )
        grants = self.ctx.rooms.close(room, ok)
        if self.ctx.staging is not None:
            self.ctx.staging.messenger(grants)

    def threads(self) -> list[threading.Thread]:
        out = [self.listener.thread]
        if self.ctx.staging is not None:
            out += [self.ctx.staging.thread, self.ctx.staging.completer]
        return out

    def stop(self) -> None:
        self.listener.stop()
        if self.ctx.staging is not None:
            self.ctx.staging.stop()

    def sizes(self) -> dict[str, int]:
        out = {f"decode.{k}": v for k, v in self.ctx.rooms.sizes().items()}
        out.update({f"count.staging.{k}": v for k, v in asdict(self.ctx.rooms.counters).items()})
        if self.ctx.warmup is not None:
            out["count.warmed_prefills"] = self.ctx.warmup.warmed()
        return out
