"""Control messages between the decode and prefill sides (the schema is the types).

Every message is a msgspec Struct in one tagged union, so a single decoder reads any of
them and rejects anything else. Page-index arrays never live in these structs: they travel
as separate ZMQ frames (see ``codec``), described here only by their ``IndexSpec``.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

#: Bumped on any incompatible change to these structs or to the framing in ``codec``.
PROTOCOL_VERSION = 6

# Upper bounds that keep a hostile peer from making us allocate or loop without limit.
MAX_REGIONS = 16384
MAX_NAME = 256
MAX_REASON = 4096
MAX_METADATA = 64 << 20
MAX_INDEX_FRAMES = 64
# a decode's completion-flag board (``engine.done_flags``): the only files a prefill opens
FLAG_PATH = r"^(/dev/shm/sgl-nixl-flags-[0-9]{1,10}-[0-9a-f]{16})?$"
FLAG_MAX_SLOTS = 1 << 20

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Room = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON)]


class Region(msgspec.Struct, frozen=True, array_like=True):
    """One registered buffer: ``length`` bytes at ``ptr``, addressed in ``item_len`` items."""

    ptr: NonNeg
    length: NonNeg
    item_len: Annotated[int, msgspec.Meta(gt=0)]
    device: NonNeg = 0
    mem_kind: Annotated[str, msgspec.Meta(pattern="^(DRAM|VRAM)$")] = "VRAM"

    @property
    def num_items(self) -> int:
        return self.length // self.item_len


class Compat(msgspec.Struct, frozen=True):
    """What both sides must agree on (but ``compat.MAY_DIFFER``: the prefill pairs tokens
    across page sizes, and a pipeline stage's layers with a PP 1 decode's); hashed, and
    named field by field on a mismatch.

    Only what SGLang hands the manager on both sides before it is constructed: the head
    split is not here (a decode's ``KVArgs`` has no head counts), the prefill derives the
    decode's heads from its item length instead (``sides.memory.decode_heads``).
    """

    protocol_version: int
    kv_dtype: Name
    page_size: Annotated[int, msgspec.Meta(gt=0)]
    num_layers: NonNeg
    is_mla: bool


class StagingArea(msgspec.Struct, frozen=True):
    """A peer's registered staging buffer, written in slots by the staging path."""

    region: Region
    slot_bytes: Annotated[int, msgspec.Meta(gt=0)]
    # the GPU's UUID ("" for host memory): equal on both sides means one GPU shared by
    # both processes, which pipelines in fewer pieces
    device_uuid: Annotated[str, msgspec.Meta(max_length=64)] = ""


class IpcBlock(msgspec.Struct, frozen=True, array_like=True):
    """One allocation of the decode's GPU memory, exported for CUDA IPC."""

    handle: Annotated[bytes, msgspec.Meta(min_length=64, max_length=64)]
    base: NonNeg  # its address in the decode's process: regions are translated by range
    size: Annotated[int, msgspec.Meta(gt=0)]


class CudaIpc(msgspec.Struct, frozen=True):
    """The decode's KV pool as a prefill on a GPU that can map it opens it: a prefill on
    the same host (``host``: its boot id) and GPU, or an NVLink peer of it, writes the
    pages in one pass (``engine.one_pass``); any other prefill ignores it."""

    host: Name
    device_uuid: Annotated[str, msgspec.Meta(max_length=64)]
    pid: NonNeg
    blocks: Annotated[list[IpcBlock], msgspec.Meta(max_length=MAX_REGIONS)]
    # the decode's completion flags (``engine.done_flags``): a file under /dev/shm of
    # ``flag_slots`` words; "" when it has none
    flag_board: Annotated[str, msgspec.Meta(pattern=FLAG_PATH)] = ""
    flag_slots: Annotated[int, msgspec.Meta(ge=0, le=FLAG_MAX_SLOTS)] = 0


class PeerRegistration(msgspec.Struct, frozen=True, tag="reg"):
    """Decode rank -> prefill rank, once per peer pair: who we are and where our memory is."""

    compat: Compat
    compat_hash: Name
    agent_name: Name
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA)]
    ip: Name
    port: Port
    tp_rank: NonNeg
    tp_size: Annotated[int, msgspec.Meta(gt=0)]
    kv: Annotated[list[Region], msgspec.Meta(max_length=MAX_REGIONS)]
    aux: Annotated[list[Region], msgspec.Meta(max_length=MAX_REGIONS)]
    state: Annotated[list[list[Region]], msgspec.Meta(max_length=MAX_REGIONS)] = []
    staging: StagingArea | None = None
    # the decode's host pool (SGLang's host-receive destination; DRAM, same items as kv and
    # state): empty when the decode receives into device pages only
    host_kv: Annotated[list[Region], msgspec.Meta(max_length=MAX_REGIONS)] = []
    host_state: Annotated[list[list[Region]], msgspec.Meta(max_length=MAX_REGIONS)] = []
    # the decode's pipeline stage: a prefill stage writes its layers into a PP 1 decode's
    # (``sides.pipeline_stages``); draft entries end ``kv`` (speculative decoding)
    pp_rank: NonNeg = 0
    pp_size: Annotated[int, msgspec.Meta(gt=0)] = 1
    draft_entries: NonNeg = 0
    # the decode's KV pool exported for CUDA IPC (None: not offered, or host memory)
    ipc: CudaIpc | None = None
    # a few bytes of the decode's host memory that only prefills' warm-ups write: the
    # host-to-host WRITE of aux rows is warmed there (None: older release, or no host aux)
    scratch: Region | None = None
    # the decode allocates its staging area, in slots of this many bytes, when a prefill
    # rank asks for it (``RegistrationReply.wants_staging``) and sends it in a
    # ``StagingOffer``; ``staging`` is then None. 0: none on request (an older release
    # sends its area, if any, in ``staging``)
    staging_slot_bytes: NonNeg = 0
    # the decode registers because a request of its waits (not ahead of its requests): the
    # prefill skips the warm-up WRITEs, which that request would wait for and then pay
    # little less itself. Not part of the decode's identity (equal registrations keep the
    # link whatever it says); an older release sends none (False)
    request_waits: bool = False


class RegistrationReply(msgspec.Struct, frozen=True, tag="reg_reply"):
    """Prefill rank -> decode rank: accepted, or refused with a reason naming both sides.

    Frozen across protocol versions up to ``retry`` (with ``PeerRegistration``'s
    ``agent_name``, ``ip`` and ``port``; later fields are optional, and older releases'
    decoders ignore fields they do not know): a prefill answers a registration of another version with a refusal in
    that version's envelope (``Codec.encode_foreign``), so the decode fails its requests
    at once with a reason that names both versions.
    """

    agent_name: Name
    prefill_rank: NonNeg
    accepted: bool
    reason: Reason = ""
    ip: Name = ""  # the prefill rank's control address, so the decode knows who refused
    port: Port = 0
    retry: bool = False  # the prefill lost this decode's registration: register again
    # the decode's KV regions this prefill rank writes, one per region of its own (a PP
    # stage into a PP 1 decode: staged pieces number regions as the prefill does); [] when
    # they pair one to one
    kv_window: Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_REGIONS)] = []
    # this prefill rank mapped the decode's KV pool (``PeerRegistration.ipc``) and writes
    # its pages in one pass: the decode grants it no staging slots
    one_pass: bool = False
    # it also mapped the decode's flag board (``CudaIpc.flag_board``): the decode may give
    # its one-pass rooms a flag word (``TransferRequest.done_flag``)
    done_flags: bool = False
    # this prefill rank may stage into the decode: a decode that registered with
    # ``staging_slot_bytes`` sends it its staging area (``StagingOffer``)
    wants_staging: bool = False


class StagingOffer(msgspec.Struct, frozen=True, tag="staging"):
    """Decode rank -> prefill rank that asked (``RegistrationReply.wants_staging``): the
    staging area it allocated for the staged path, with its NIXL metadata again (which
    now covers that buffer); ``staging`` None: it could not allocate one (``reason``), and
    the prefill writes it direct. Sent before any request that stages to that rank."""

    agent_name: Name
    ip: Name
    port: Port
    agent_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_METADATA)] = b""
    staging: StagingArea | None = None
    reason: Reason = ""


class IndexSpec(msgspec.Struct, frozen=True, array_like=True):
    """Describes one index frame that follows the header: its role and element count."""

    role: Annotated[str, msgspec.Meta(pattern="^(kv|state)$")]
    count: NonNeg


class TransferRequest(msgspec.Struct, frozen=True, tag="xfer"):
    """Decode rank -> prefill rank, per request: where this room's pages go.

    Destination page indices come in the ``kv`` index frame; state indices (one frame per
    state component, in order) in ``state`` frames.
    """

    room: Room
    agent_name: Name
    ip: Name
    port: Port
    aux_index: Annotated[int, msgspec.Meta(ge=-1)]
    required_dst_info_num: Annotated[int, msgspec.Meta(gt=0, le=4096)]
    decode_prefix_len: NonNeg = 0
    is_dummy: bool = False
    indices: Annotated[list[IndexSpec], msgspec.Meta(max_length=MAX_INDEX_FRAMES)] = []
    # the decode stages this room: slots granted to this sender now (maybe none: it asks
    # with SlotAsk when its first chunk is ready, and gets SlotGrants)
    staged: bool = False
    staging_slots: Annotated[list[NonNeg], msgspec.Meta(max_length=64)] = []
    # the pages are in the decode's host pool (``host_kv``/``host_state`` regions)
    host: bool = False
    # a one-pass room's flag: the word of the decode's board where the prefill stores
    # ``done_value`` once every byte of the room landed (-1: none; the status still follows)
    done_flag: Annotated[int, msgspec.Meta(ge=-1, lt=FLAG_MAX_SLOTS)] = -1
    done_value: Annotated[int, msgspec.Meta(ge=0, le=0x7FFFFFFF)] = 0
    # the decode counts this room's NIXL notifications (``wire.notes``): the prefill puts a
    # note on each of its direct WRITEs of the room (an older prefill ignores the field)
    notes: bool = False


class TransferStatus(msgspec.Struct, frozen=True, tag="status"):
    """Prefill rank -> decode rank: a room's terminal (or readiness) status.

    ``ip``/``port`` name the sending rank's control endpoint: a decode frees the staging
    slots that rank holds as soon as its Success has been applied, instead of when the
    whole room ends."""

    room: Room
    status: Annotated[int, msgspec.Meta(ge=0, le=4)]
    prefill_rank: NonNeg
    reason: Reason
    ip: Name
    port: Port


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Decode rank -> prefill rank: stop writing into this room's pages."""

    room: Room
    ip: Name
    port: Port
    generation: int | None = None
    # why the decode gave the room up, when it did not ask for it (e.g. the prefill refused
    # its registration): the prefill fails its side with this reason instead of a generic one
    reason: Reason = ""


class AbortAck(msgspec.Struct, frozen=True, tag="abort_ack"):
    """Prefill rank -> decode rank: nothing more will be written for this room."""

    room: Room
    prefill_rank: NonNeg
    generation: int | None = None
    # the acking rank's control address: a decode releases a host destination only once
    # every rank it sent the room to has acked (or was lost)
    ip: Name = ""
    port: Port = 0


class PieceReady(msgspec.Struct, frozen=True, tag="piece"):
    """Prefill rank -> decode rank: a staged piece has landed in ``slot``; scatter it.

    The piece covers regions ``[r0, r1)`` and units ``[j0, j1)`` of the chunk whose
    destination items are ``items[page_start : page_start + page_count]``, the items being
    the room's pages (or, ``by_token``, its pages' token rows); units map to destination
    bytes with ``units_per_item``, ``unit_len``, ``dst_stride``, ``dst_offset``.
    """

    room: Room
    prefill_rank: NonNeg
    ip: Name
    port: Port
    slot: NonNeg
    r0: NonNeg
    r1: NonNeg
    j0: NonNeg
    j1: NonNeg
    page_start: NonNeg
    page_count: NonNeg
    unit_len: Annotated[int, msgspec.Meta(gt=0)]
    units_per_item: Annotated[int, msgspec.Meta(gt=0)]
    dst_stride: Annotated[int, msgspec.Meta(gt=0)]
    dst_offset: NonNeg
    seq: Annotated[int, msgspec.Meta(gt=0)]  # this use of the slot; PieceDone echoes it
    # items are token rows of the decode's pages (the sides' page sizes differ): the decode
    # numbers its pages' tokens with its own page size
    by_token: bool = False


class PieceDone(msgspec.Struct, frozen=True, tag="piece_done"):
    """Decode rank -> prefill rank: ``slot`` was scattered and may be written again.

    ``seq`` echoes the PieceReady's: a replayed PieceDone of an earlier use of the slot
    would otherwise let the next piece overwrite one that is not scattered yet."""

    room: Room
    agent_name: Name
    slot: NonNeg
    seq: Annotated[int, msgspec.Meta(gt=0)]


class SlotAsk(msgspec.Struct, frozen=True, tag="slot_ask"):
    """Prefill rank -> decode rank: this sender of a staged ``room`` has no slot for its
    next chunk; grants go to ``ip:port``."""

    room: Room
    agent_name: Name
    ip: Name
    port: Port


class SlotGrant(msgspec.Struct, frozen=True, tag="slot_grant"):
    """Decode rank -> prefill rank: ``slot`` now belongs to this sender of ``room``."""

    room: Room
    agent_name: Name
    slot: NonNeg


class SlotReturn(msgspec.Struct, frozen=True, tag="slot_return"):
    """Prefill rank -> decode rank: this sender of ``room`` (at ``ip:port``) is done with
    ``slots`` for now (a chunk ended, or grants sat unused): every piece it wrote there was
    scattered (its PieceDone came back). It asks again for its next chunk."""

    room: Room
    agent_name: Name
    ip: Name
    port: Port
    slots: Annotated[list[NonNeg], msgspec.Meta(max_length=64)]


class SlotRecall(msgspec.Struct, frozen=True, tag="slot_recall"):
    """Decode rank -> prefill rank: senders wait for staging slots; give back this room's
    if no chunk of it is using them (SlotReturn)."""

    room: Room
    agent_name: Name


class Ping(msgspec.Struct, frozen=True, tag="ping"):
    """Liveness probe; the peer answers with a Pong to ``ip:port``."""

    sender: Name
    ip: Name
    port: Port
    seq: NonNeg


class Pong(msgspec.Struct, frozen=True, tag="pong"):
    """Answer to a Ping, naming the answering side's own control address."""

    sender: Name
    seq: NonNeg
    ip: Name
    port: Port


Message = (
    PeerRegistration
    | RegistrationReply
    | TransferRequest
    | TransferStatus
    | StagingOffer
    | PieceReady
    | PieceDone
    | SlotAsk
    | SlotGrant
    | SlotReturn
    | SlotRecall
    | Abort
    | AbortAck
    | Ping
    | Pong
)
