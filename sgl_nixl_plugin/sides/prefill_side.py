"""A prefill rank's side of the manager: its control thread and transfer workers."""

from __future__ import annotations

import logging
import threading

from sgl_nixl_plugin.protocol.prefill_rooms import Chunk
from sgl_nixl_plugin.sides.context import PrefillContext
from sgl_nixl_plugin.sides.prefill_control import PrefillControl
from sgl_nixl_plugin.sides.transfer_worker import TransferWorker

logger = logging.getLogger(__name__)


class PrefillSide:
    def __init__(self, ctx: PrefillContext) -> None:
        self.ctx = ctx
        self.workers = [TransferWorker(ctx, i) for i in range(ctx.settings.workers)]
        self.control = PrefillControl(ctx, self.wake, self.recall)

    def start(self) -> None:
        self.control.start()
        for w in self.workers:
            w.start()

    def enqueue(self, chunk: Chunk) -> None:
        """O(1) on the scheduler thread: the room's worker does the rest."""
        self.workers[chunk.room % len(self.workers)].queue.put(chunk)

    def wake(self, room: int) -> None:
        self.workers[room % len(self.workers)].wake()

    def recall(self, room: int) -> None:
        self.workers[room % len(self.workers)].recall(room)

    def claim_early_abort(self, room: int) -> str | None:
        return self.ctx.early.claim(room)

    def release(self, room: int) -> None:
        """SGLang cleared the room's sender."""
        self.ctx.rooms.release(room)

    def threads(self) -> list[threading.Thread]:
        return [
            self.control.thread,
            self.control.registrations.setup.thread,
            *(w.thread for w in self.workers),
        ]

    def stop(self) -> None:
        self.control.stop()
        for w in self.workers:
            w.stop()

    def close_mappings(self) -> None:
        """Unmap every decode's KV pool (after the workers stopped: no launch can follow)."""
        with self.ctx.peers.lock:
            links = [p.link.one_pass for p in self.ctx.peers.accepted.values()]
        for op in links:
            if op is not None:
                op.close()

    def sizes(self) -> dict[str, int]:
        """Our per-room tables (they return to zero once every room ended) and counters."""
        out = {f"prefill.{k}": v for k, v in self.ctx.rooms.sizes().items()}
        out["count.one_pass.peers"] = sum(
            1 for p in self.ctx.peers.accepted.values() if p.link.one_pass is not None
        )
        out["count.staging.fell_back"] = self.ctx.fallbacks
        out["count.staging.needs"] = self.control.registrations.staging.needs
        if self.ctx.staging_memory is not None:
            out.update(self.ctx.staging_memory.counts())
        out["count.staging.peers"] = sum(
            1 for p in self.ctx.peers.accepted.values() if p.staging is not None
        )
        out["count.warmups"] = self.ctx.warmups
        out["count.host_warmups"] = self.ctx.host_warmups
        out["count.light_warmups"] = self.ctx.light_warmups
        out["count.late_warmups"] = self.ctx.late_warmups
        out.update({f"worker{i}.rooms": len(w.active) for i, w in enumerate(self.workers)})
        return out
