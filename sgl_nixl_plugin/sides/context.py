"""What each side's threads share, handed to them explicitly (no back-pointer to the
manager): the engine, the wire, the transport, SGLang's room tables and our own."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.engine.engine import PeerLink, TransferEngine
from sgl_nixl_plugin.engine.staging import StagingBuffer
from sgl_nixl_plugin.engine.staging_memory import LazyStaging
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.protocol.peers import DecodePeers
from sgl_nixl_plugin.protocol.prefill_rooms import EarlyAborts, PrefillRoom, PrefillRooms
from sgl_nixl_plugin.registry import manager as registry
from sgl_nixl_plugin.registry.spec import TransferEvent
from sgl_nixl_plugin.settings import Settings
from sgl_nixl_plugin.sides.memory import HeadLayout
from sgl_nixl_plugin.sides.pipeline_stages import PrefillStage
from sgl_nixl_plugin.sides.room_tables import RoomTables
from sgl_nixl_plugin.transport.transport import Transport
from sgl_nixl_plugin.wire.codec import Codec
from sgl_nixl_plugin.wire.messages import Compat

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


@dataclass(frozen=True)
class Identity:
    """This rank as peers address it."""

    name: str  # NIXL agent name
    ip: str
    port: int  # control socket
    rank: int = 0  # prefill: SGLang's unique prefill rank id


@dataclass(eq=False)
class SideBase:
    me: Identity
    settings: Settings
    codec: Codec
    transport: Transport
    engine: TransferEngine
    sglang: RoomTables  # the facade's SGLangRooms; SGLang-free fakes in tests
    zmq_ctx: Any
    server_socket: Any
    mem_kind: str
    engine_lock: threading.Lock = field(default_factory=threading.Lock)
    # the staging buffer as planned, allocated when a peer first needs the staged path
    # (None: staging is off); a prefill's ``staging`` is its buffer once allocated
    staging_memory: LazyStaging | None = None

    def send(self, endpoint: Endpoint, msg: Any, arrays: tuple = ()) -> bool:
        return self.transport.send(endpoint, msg, arrays)

    def reject(self, reason: str, detail: str = "", peer: str = "") -> None:
        self.codec.rejections.reject(reason, detail, peer)

    def unlink(self, link: PeerLink) -> None:
        with self.engine_lock:
            self.engine.unlink(link)


@dataclass(eq=False)
class PrefillContext(SideBase):
    compat: Compat | None = None
    compat_hash: str = ""
    is_mla: bool = False
    head_layout: HeadLayout | None = None
    attn_tp_rank: int = 0
    kv_item_len: int = 0
    page_bound_states: tuple[str, ...] = ()  # state kinds that pair only at equal page sizes
    stage: PrefillStage = field(default_factory=PrefillStage)  # pipeline place and KV list
    rooms: PrefillRooms = field(default_factory=PrefillRooms)
    peers: DecodePeers = field(default_factory=DecodePeers)
    early: EarlyAborts = field(default_factory=lambda: EarlyAborts(60.0))
    staging: StagingBuffer | None = None  # ``staging_memory``'s buffer, once allocated
    copier: Any = None
    copy_stream: Any = None
    gpu: int = 0  # this rank's CUDA device (VRAM KV)
    device_uuid: str = ""  # its UUID ("" for host memory): a peer on the same GPU shows it
    fallbacks: int = 0  # staged chunks sent direct: no receiver slot in time
    # the worker's call when the path rule would stage a chunk to a decode that may take
    # staged transfers but has no staging set up yet (``StagingAsks.need``)
    staging_need: Callable[[Any], None] | None = None
    warmups: int = 0  # decodes whose padding page took the first WRITE at registration
    light_warmups: int = 0  # of which one item only: their first request was waiting
    host_warmups: int = 0  # decodes whose scratch buffer took a host-to-host WRITE then
    late_warmups: int = 0  # light decodes warmed up after the reply (device KV)
    warmed_shapes: set[tuple[int, int, int]] = field(default_factory=set)

    def warm_copier(self, unit_len: int, stride: int = 0, offset: int = 0) -> None:
        """Compile the staging gather for one unit shape now (a GPU's first launch of a new
        shape compiles for up to a second), not inside the first staged request."""
        key = (unit_len, stride or unit_len, offset)
        warm = getattr(self.copier, "warmup", None)
        if warm is None or unit_len <= 0 or key in self.warmed_shapes:
            return
        self.warmed_shapes.add(key)
        try:
            warm(*key)
        except Exception as exc:
            logger.warning("sgl-nixl: staging copier warm-up (unit %d B) failed: %s", unit_len, exc)

    def fail_rooms_of_peer(self, agent: str, reason: str) -> None:
        """Fail (and tell) every open room with a destination on decode ``agent``."""
        for room, infos in self.sglang.rooms_with_destinations():
            info = infos.get(agent)
            if info is not None and not info.is_dummy:
                # checked and failed at once: a Success concluded meanwhile stands
                self.sglang.conclude_failure(room, reason, only_open=True)

    def note_early_abort(self, room: int, reason: str) -> bool:
        """Fail ``room`` now, or at its sender's creation if it has none yet (False).

        SGLang's scheduler makes senders meanwhile: one made between the first look and
        the note has already claimed (nothing), and would wait for its timeout. It is in
        SGLang's table before it claims, so a second look after the note finds it, and
        whichever of the two claims first fails the room."""
        if not self.sglang.exists(room):
            self.early.note(room, reason)
            if not self.sglang.exists(room):
                return False
            claimed = self.early.claim(room)
            if claimed is None:  # the sender took it at its creation
                return False
        self.sglang.fail_unless_done(room, reason)
        return True

    def observe(self, rec: PrefillRoom, ok: bool, reason: str | None = None) -> None:
        """Report a finished room to metrics and to deployers' observer hooks."""
        ended = time.perf_counter()
        seconds = ended - rec.started
        peer = ",".join(sorted(rec.peers))
        timeline: dict[str, float] = {
            **rec.timeline(ended),
            "pieces": rec.pieces,
            "post_us": rec.nixl_post_us,
            "xfer_us": rec.nixl_xfer_us,
        }
        metrics.transfer_done(ok, rec.path, rec.nbytes, seconds, rec.descriptors, reason)
        metrics.room_done(peer, seconds)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "sgl-nixl room %s: %s peer=%s path=%s bytes=%d descriptors=%d %s%s",
                rec.room,
                "ok" if ok else "failed",
                peer or "-",
                rec.path,
                rec.nbytes,
                rec.descriptors,
                " ".join(f"{k}={v:g}" for k, v in timeline.items()),
                f" reason={reason!r}" if reason else "",
            )
        timeline.update(rec.stamps(ended))  # absolute: for observers, not the log line
        if self.staging is not None:
            metrics.staging_in_use("prefill", self.staging.num_slots - self.staging.free)
        registry.notify_transfer(
            TransferEvent(
                room=rec.room,
                peer=peer,
                ok=ok,
                bytes=rec.nbytes,
                duration_s=seconds,
                descriptors=rec.descriptors,
                path=rec.path,
                reason=reason,
                timeline=timeline,
            )
        )


@dataclass(eq=False)
class DecodeContext(SideBase):
    rooms: DecodeRooms = field(default_factory=DecodeRooms)
    staging: Any = None  # DecodeStaging when the staging path is on
    refused: dict[Endpoint, tuple[str, float]] = field(default_factory=dict)
    warmup: Any = None  # DecodeWarmup
    # SGLang's first look at a prefill, answered from the warm-up's route table when it can
    # (the facade's ``AnsweredQuery``: a callable of the prefill's bootstrap address)
    first_look: Any = None
    # prefill ranks that write our KV pages in one pass (their RegistrationReply said so):
    # their requests get no staging slots
    one_pass: set[Endpoint] = field(default_factory=set)
    # our completion-flag board (``engine.done_flags.FlagBoard``; None: none), and the
    # one-pass prefill ranks that mapped it (endpoint -> the rank their statuses carry)
    flags: Any = None
    flag_ranks: dict[Endpoint, int] = field(default_factory=dict)
    flags_given: int = 0  # flag words handed out in transfer requests
    flag_hits: int = 0  # of those, seen stored (the sender's Success applied from it)
    note_hits: int = 0  # prefill ranks' Successes applied from their WRITEs' notes
