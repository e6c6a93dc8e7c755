"""The KV manager SGLang creates once per scheduler process (prefill or decode).

It keeps SGLang's ``CommonKVManager`` for everything the scheduler reads directly (status
table, failure records, rank mapping, abort/ACK bookkeeping, bootstrap registration) and
replaces the transport: our msgspec wire on ZMQ for control, our NIXL engine for data.
SGLang uses one manager class for both roles, so the role is chosen once, here: the
manager composes a ``PrefillSide`` or a ``DecodeSide`` and forwards SGLang's calls to it.
"""

from __future__ import annotations

import logging
import threading
from functools import partial
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.adapter.hooks import announce
from sgl_nixl_plugin.adapter.sglang_rooms import (
    AbortTarget,
    SGLangRooms,
    receiver_socket,
    sglang_table_sizes,
    tcp,
)
from sgl_nixl_plugin.adapter.topology_answer import AnsweredQuery
from sgl_nixl_plugin.engine import ucx_prewarm
from sgl_nixl_plugin.engine.engine import TransferEngine
from sgl_nixl_plugin.engine.staging import gpu_uuid
from sgl_nixl_plugin.engine.staging_memory import LazyStaging
from sgl_nixl_plugin.protocol.decode_rooms import DecodeRooms
from sgl_nixl_plugin.protocol.prefill_rooms import Chunk, EarlyAborts
from sgl_nixl_plugin.registry import manager as registry
from sgl_nixl_plugin.settings import Settings, prefill_addrs, staging_sizes
from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.sides.context import DecodeContext, Identity, PrefillContext
from sgl_nixl_plugin.sides.decode_side import DecodeSide
from sgl_nixl_plugin.sides.decode_staging import DecodeStaging, SlotMessenger
from sgl_nixl_plugin.sides.decode_warmup import DecodeWarmup
from sgl_nixl_plugin.sides.memory import (
    compat_of,
    kv_mem_kind,
    memory_from_kv_args,
    page_bound_states,
    prefill_head_layout,
    to_regions,
)
from sgl_nixl_plugin.sides.one_pass import offer as offer_one_pass
from sgl_nixl_plugin.sides.one_pass import warm_kernel as warm_one_pass
from sgl_nixl_plugin.sides.pipeline_stages import PrefillStage
from sgl_nixl_plugin.sides.prefill_side import PrefillSide
from sgl_nixl_plugin.sides.process_knobs import apply_process_knobs
from sgl_nixl_plugin.sides.staging_offers import StagingOffers
from sgl_nixl_plugin.transport import bootstrap_client
from sgl_nixl_plugin.transport.transport import Transport
from sgl_nixl_plugin.wire.codec import Codec, index_specs
from sgl_nixl_plugin.wire.compat import compat_hash
from sgl_nixl_plugin.wire.messages import (
    AbortAck,
    PeerRegistration,
    TransferRequest,
    TransferStatus,
)

logger = logging.getLogger(__name__)


class NixlPluginKVManager(CommonKVManager):
    supports_deferred_decode_kv_release = True
    reports_transfer_latency = True
    #: How our threads reach SGLang's tables (a release with other table APIs swaps it).
    facade: type[SGLangRooms] = SGLangRooms
    _ipc_offer: Any = None  # the decode's KV pool for one-pass transfers (``one_pass.offer``)

    prefill: PrefillSide
    decode: DecodeSide

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self._advertise = False  # SGLang's __init__ registers at the bootstrap: hold that
        self._stopping = False
        self.settings = Settings.from_env()
        apply_process_knobs(self.settings)
        self.codec = Codec(secret=self.settings.secret)
        self.codec.rejections.listeners.append(metrics.rejected)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.defer_decode_allocation:
            raise ValueError(
                "sgl-nixl-plugin does not support "
                "--disaggregation-decode-allocation-policy prefill_complete yet; use 'early'"
            )
        is_prefill = disaggregation_mode == DisaggregationMode.PREFILL
        device_kind = getattr(server_args, "device", "cuda") or "cuda"
        self.kv_mem_kind = kv_mem_kind(args, device_kind, self.settings.kv_mem_kind)
        memory = memory_from_kv_args(args, self.kv_mem_kind)
        gpu = int(getattr(args, "gpu_id", 0) or 0) if self.kv_mem_kind == "VRAM" else 0
        if self.kv_mem_kind == "VRAM":
            import torch

            torch.cuda.set_device(gpu)
        config = registry.resolve_agent_config()
        if config.num_threads == 0 and is_prefill:
            config.num_threads = self.settings.nixl_threads  # the initiator drives the WRITEs
        self.engine = TransferEngine(
            config,
            memory,
            progress_thread=self.settings.progress_thread,
            prewarm=ucx_prewarm.wanted(self.settings.ucx_prewarm, self.kv_mem_kind),
            scratch=not is_prefill and len(memory.aux) > 0 and memory.aux.mem_kind == "DRAM",
        )
        self.compat = compat_of(args, bool(is_mla_backend))
        self.compat_hash = compat_hash(self.compat)
        self.transport = Transport(
            self._zmq_ctx, self.codec, tcp, via=None if is_prefill else receiver_socket
        )
        # SGLang's names for the same cache (its own helpers and tests reach them)
        self._socket_cache = self.transport.sockets
        self._monitor_cache = self.transport.monitors
        self._socket_send_locks = self.transport.send_locks
        self._socket_lock = self.transport.lock
        self.staging_bytes, self.slot_bytes = staging_sizes(self.settings, self.kv_mem_kind)
        me = Identity(
            self.engine.name,
            self.local_ip,
            int(self.rank_port),
            self._prefill_unique_rank() if is_prefill else 0,
        )
        base: dict[str, Any] = dict(
            me=me,
            settings=self.settings,
            codec=self.codec,
            transport=self.transport,
            engine=self.engine,
            sglang=self.facade(self),
            zmq_ctx=self._zmq_ctx,
            server_socket=self.server_socket,
            mem_kind=self.kv_mem_kind,
        )
        self.side: PrefillSide | DecodeSide
        if is_prefill:
            self.prefill = self.side = PrefillSide(self._prefill_context(base, args, gpu))
        else:
            self.decode = self.side = DecodeSide(self._decode_context(base, gpu))
            # once: a registration sent again must be identical (the prefill keeps its link),
            # also after the staging buffer's registration changed our NIXL metadata (a
            # prefill that asks for it gets the new metadata with it: ``StagingOffer``)
            self._ipc_offer, self.decode.ctx.flags = offer_one_pass(self.settings, memory, gpu)
            self._registration_metadata = self.engine.metadata
            if self.decode.ctx.flags is not None:  # a room's words return at its way out
                self.decode.ctx.rooms.free_flag = self.decode.ctx.flags.free
            self._start_heartbeat_checker_thread()
        self.side.start()
        if is_prefill:
            # Only now can this rank answer decodes: advertise it at the bootstrap server.
            self._advertise = True
            self.register_to_bootstrap()
        else:  # the prefills an operator named: registered as each comes up
            ahead = partial(self.try_ensure_parallel_info, request_waits=False)
            self.decode.register_at_start(prefill_addrs(self.settings.prefills), ahead)
        announce()
        metrics.prepare()
        staging = self.side.ctx.staging_memory  # allocated when a peer first stages
        logger.info(
            "sgl-nixl: %s manager ready (agent %s, %s KV, %d regions%s, control %s:%s); "
            "the plugin holds %s",
            disaggregation_mode.value,
            self.engine.name,
            self.kv_mem_kind,
            len(memory.kv),
            "" if memory.host_kv is None else f", with a host pool of {len(memory.host_kv)}",
            self.local_ip,
            self.rank_port,
            staging.describe() if staging is not None else "no memory for staging (it is off)",
        )

    # -- composition ----------------------------------------------------------------------
    def _prefill_context(self, base: dict[str, Any], args: Any, gpu: int) -> PrefillContext:
        ctx = PrefillContext(
            **base,
            compat=self.compat,
            compat_hash=self.compat_hash,
            is_mla=bool(self.is_mla_backend),
            head_layout=prefill_head_layout(args, bool(self.is_mla_backend)),
            attn_tp_rank=int(self.attn_tp_rank),
            kv_item_len=int(args.kv_item_lens[0]) if len(args.kv_item_lens) else 0,
            page_bound_states=page_bound_states(args),
            stage=PrefillStage(
                pp_rank=int(self.pp_rank),
                pp_size=int(self.pp_size),
                first_layer=int(getattr(args, "prefill_start_layer", 0) or 0),
                kv_entries=len(args.kv_data_ptrs),
                draft_entries=int(getattr(args, "num_draft_entries", 0) or 0),
                is_mla=bool(self.is_mla_backend),
                has_state=bool(getattr(args, "state_data_ptrs", None)),
            ),
            early=EarlyAborts(max(60.0, float(self.bootstrap_timeout))),
            gpu=gpu,
        )
        if self.staging_bytes > 0:
            try:
                from sgl_nixl_plugin.engine.copy_kernels import make_copier

                ctx.copier = make_copier(self.kv_mem_kind, gpu)
                if hasattr(ctx.copier, "map_units"):  # the sender's indices: read in place
                    ctx.copier.map_units = self.settings.map_indices
                ctx.warm_copier(ctx.kv_item_len)  # whole pages: the equal-TP shape
                warm_one_pass(self.settings, ctx.copier, ctx.kv_item_len)
                ctx.staging_memory = self._staging_memory(gpu)
                if self.kv_mem_kind == "VRAM":
                    import torch

                    ctx.copy_stream = torch.cuda.Stream(device=gpu)
                    ctx.device_uuid = gpu_uuid(gpu)
            except Exception as exc:
                ctx.staging_memory = ctx.copier = None
                logger.warning(
                    "sgl-nixl: staging path disabled (%s); scattered pages go direct", exc
                )
        return ctx

    def _staging_memory(self, gpu: int) -> LazyStaging:
        """The staging buffer this rank allocates when a peer first needs the staged path."""
        args = (self.engine.agent, self.staging_bytes, self.slot_bytes, self.kv_mem_kind, gpu)
        return LazyStaging(*args)

    def _decode_context(self, base: dict[str, Any], gpu: int) -> DecodeContext:
        memory = self._staging_memory(gpu) if self.staging_bytes > 0 else None
        rooms = DecodeRooms(quarantine_s=self.settings.abort_drain_timeout_s)  # slots: later
        ctx = DecodeContext(**base, rooms=rooms, staging_memory=memory)
        sg, me = ctx.sglang, ctx.me
        ctx.warmup = DecodeWarmup(
            self.transport.send_raw, self.build_receiver_registration_message,
            sg.prefill_info, self.settings.secret, sg.resolve_prefill_info,
        )  # fmt: skip
        query = super().try_ensure_parallel_info  # answered from the warm-up's route table
        ctx.first_look = AnsweredQuery(query, sg.prefill_info, ctx.warmup.topology)
        if memory is not None:
            offers = StagingOffers(
                memory, rooms, ctx.send, (me.name, me.ip, me.port), lambda: self.engine.metadata
            )
            ctx.staging = DecodeStaging(
                agent=self.engine.agent,
                kv=self.engine.memory.kv,
                rooms=rooms,
                host_kv=self.engine.memory.host_kv,
                offers=offers,
                device=gpu,
                messenger=SlotMessenger(self.engine.name, ctx.send),
                apply_status=lambda m: decode_status.status_in(ctx, m),
                note_abort_ack=sg.note_abort_ack,
                reject=ctx.reject,
                fail_room=lambda room, why: decode_status.fail(ctx, room, why),
                page_size=self.compat.page_size,
            )
        return ctx

    # -- SGLang's calls, both sides -------------------------------------------------------
    def register_to_bootstrap(self) -> None:
        """Advertise this prefill rank, but only once its engine and threads are up."""
        if self._advertise:
            super().register_to_bootstrap()

    def _register_topology_row(self, url: str, payload: dict) -> None:
        bootstrap_client.put_route(url, payload, self.settings.secret)

    def _connect(self, endpoint: str, is_ipv6: bool = False) -> Any:
        return self.transport.connect(endpoint, is_ipv6)

    def _send_multipart_locked(self, endpoint: str, parts: list, is_ipv6: bool = False) -> None:
        self.transport.send_frames(endpoint, parts, is_ipv6)

    @property
    def prefill_rank_id(self) -> int:
        return self._prefill_unique_rank()

    def _encode_kv_status_message(
        self, *, bootstrap_room: int, status: KVPoll, failure_reason: str | None
    ) -> list:
        return self.codec.encode(
            TransferStatus(
                bootstrap_room,
                int(status),
                self.prefill_rank_id,
                failure_reason or "",
                self.local_ip,
                int(self.rank_port),
            )
        )

    def parse_kv_status_message(self, msg: list) -> tuple[int, int, int, str | None] | None:
        decoded = self.codec.decode(msg)
        if decoded is None or not isinstance(decoded.msg, TransferStatus):
            return None
        m = decoded.msg
        return m.room, m.status, m.prefill_rank, m.reason or None

    def _send_abort_ack(self, room: int, target: AbortTarget) -> None:
        self.transport.send(
            (target.ip, target.port),
            AbortAck(
                room, self.prefill_rank_id, target.generation, self.local_ip, int(self.rank_port)
            ),
        )

    # -- decode: host-pool destinations ---------------------------------------------------
    @property  # type: ignore[override]  # SGLang declares a class attribute
    def supports_host_destination(self) -> bool:
        """A decode whose KVArgs describe a host pool: it is registered with NIXL and
        advertised to every prefill, which then WRITEs a HOST request's pages there."""
        return (
            self.disaggregation_mode == DisaggregationMode.DECODE
            and self.engine.memory.host_kv is not None
        )

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """SGLang's count of abort ACKs, except for a host destination: its pages are held
        until every prefill rank it was sent to acked or was lost (``release_safe``)."""
        if self.disaggregation_mode == DisaggregationMode.DECODE and self.decode.rooms.is_host(
            bootstrap_room
        ):
            return self.decode.rooms.release_safe(bootstrap_room)
        return super().is_abort_release_safe(bootstrap_room, required_acks)

    def update_status(self, bootstrap_room: int, status: KVPoll) -> None:
        """SGLang's, and on a decode a Failed it sets by itself (its timeouts, a failed
        bootstrap) reaches the room's machine at once, not at the receiver's next poll: a
        prefill's Failed that comes in between then overwrites neither SGLang's reason
        nor its count."""
        super().update_status(bootstrap_room, status)
        if status == KVPoll.Failed and (decode := getattr(self, "decode", None)) is not None:
            decode_status.failed_here(decode.ctx, bootstrap_room)

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        """SGLang's, and on a decode each failed room's first reason is counted in
        ``sgl_nixl_failures_total`` (lost prefills, refusals, aborts; a prefill counts its
        rooms when their transfers end)."""
        first = bootstrap_room not in self.failure_records
        super().record_failure(bootstrap_room, failure_reason)
        if first and self.disaggregation_mode == DisaggregationMode.DECODE:
            metrics.failure(failure_reason)

    # -- decode: messages to prefill ------------------------------------------------------
    def try_ensure_parallel_info(self, bootstrap_addr: str, request_waits: bool = True) -> bool:
        """SGLang's first look at a prefill (``request_waits`` False: one named at start-up),
        beside which this decode registers with the prefill's ranks (``DecodeWarmup``)."""
        if not self.settings.warmup or self.disaggregation_mode != DisaggregationMode.DECODE:
            return super().try_ensure_parallel_info(bootstrap_addr)
        return self.decode.ensure_prefill(bootstrap_addr, request_waits)

    def prefill_ready(self, bootstrap_addr: str) -> bool:
        """Every rank of that prefill linked this decode (always True, the warm-up off)."""
        return not self.settings.warmup or self.decode.ctx.warmup.ready(bootstrap_addr)

    def build_receiver_registration_message(self, request_waits: bool = True) -> list:
        args, mem = self.kv_args, self.engine.memory
        reg = PeerRegistration(
            compat=self.compat,
            compat_hash=self.compat_hash,
            agent_name=self.engine.name,
            agent_metadata=self._registration_metadata,
            ip=self.local_ip,
            port=int(self.rank_port),
            tp_rank=int(args.engine_rank) % self.attn_tp_size,
            tp_size=self.attn_tp_size,
            kv=to_regions(mem.kv),
            aux=to_regions(mem.aux),
            state=[to_regions(s) for s in mem.state],
            staging_slot_bytes=self.slot_bytes if self.decode.staging is not None else 0,
            ipc=self._ipc_offer,
            scratch=None if self.engine.scratch is None else to_regions(self.engine.scratch)[0],
            host_kv=to_regions(mem.host_kv) if mem.host_kv is not None else [],
            host_state=[to_regions(s) for s in mem.host_state],
            pp_rank=int(self.pp_rank),
            pp_size=int(self.pp_size),
            draft_entries=int(getattr(args, "num_draft_entries", 0) or 0),
            request_waits=request_waits,
        )
        return self.codec.encode(reg)

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: np.ndarray,
        aux_index: int | None,
        state_indices: list | None,
        decode_prefix_len: int | None,
        is_dummy: bool,
        device_kv_indices: np.ndarray | None = None,
    ) -> list:
        kv = np.empty(0, np.int32) if is_dummy else np.asarray(kv_indices)
        state = (
            []
            if is_dummy
            else [
                np.empty(0, np.int32) if s is None else np.asarray(s).ravel()
                for s in (state_indices or [])
            ]
        )
        host = self.decode.rooms.is_host(bootstrap_room)
        staging = self.decode.staging
        staged = (
            staging is not None
            and not is_dummy
            and len(kv) > 0
            and (not host or staging.host_capable)
        )
        slots, staged, flag, notes = self.decode.request(
            bootstrap_room, kv, staged, bool(is_dummy), host
        )
        req = TransferRequest(
            room=bootstrap_room,
            agent_name=self.engine.name,
            ip=self.local_ip,
            port=int(self.rank_port),
            aux_index=-1 if aux_index is None else int(aux_index),
            required_dst_info_num=int(required_dst_info_num),
            decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=bool(is_dummy),
            indices=index_specs(kv, state),
            staged=staged,
            staging_slots=slots,
            host=host,
            done_flag=flag[0] if flag is not None else -1,
            done_value=flag[1] if flag is not None else 0,
            notes=notes,
        )
        return self.codec.encode(req, [kv, *state])

    # -- prefill: the scheduler's send() lands here ---------------------------------------
    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: np.ndarray,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        *,
        wait_event: Any = None,
        indices_event: Any = None,
        trace_ctx: Any = None,
    ) -> None:
        self.prefill.enqueue(
            Chunk(
                room=bootstrap_room,
                pages=np.array(kv_indices, dtype=np.int64, copy=True),
                index_slice=index_slice,
                is_last=is_last_chunk,
                aux_index=aux_index,
                state=state_indices,
                tokens=None if num_kv_tokens is None else int(num_kv_tokens),
                events=tuple(e for e in (wait_event, indices_event) if hasattr(e, "synchronize")),
            )
        )

    # -- drain checks and teardown --------------------------------------------------------
    def room_tables(self) -> dict[str, int]:
        """Sizes of every per-room table, SGLang's and ours (all return to zero once every
        room ended; ``count.*`` entries are counters)."""
        out = sglang_table_sizes(self)
        out.update(self.side.sizes())
        out.update({f"nixl.{k}": v for k, v in self.engine.agent.live.items()})
        return out

    def close(self) -> None:
        """Stop our threads and release every NIXL resource (tests and role switch)."""
        if self._stopping:
            return
        self._stopping = True
        self.side.stop()
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._heartbeat_shutdown.set()
        threads: list[threading.Thread] = self.side.threads()
        for t in threads:
            t.join(timeout=5)
        if isinstance(self.side, PrefillSide):
            self.side.close_mappings()
        else:
            self.side.close_flags()
        self.engine.close()
        if any(t.is_alive() for t in threads):
            logger.warning("sgl-nixl: a control thread did not stop; its sockets stay open")
            return
        # A context left to the garbage collector with a socket that still holds messages
        # blocks forever in its finalizer (seen at interpreter exit): end it here.
        self.transport.close()
        self._zmq_ctx.destroy(linger=0)
