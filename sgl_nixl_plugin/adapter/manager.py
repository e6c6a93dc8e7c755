"""The KV manager SGLang creates once per scheduler process (prefill or decode).

It keeps SGLang's ``CommonKVManager`` for everything the scheduler reads directly (status
table, failure records, rank mapping, abort/ACK bookkeeping, bootstrap registration) and
replaces the transport: our msgspec wire on ZMQ for control, our NIXL engine for data.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict, deque
from typing import Any

import numpy as np
import requests
import zmq
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import AckTarget, CommonKVManager, CommonKVReceiver
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.utils.network import NetworkAddress

from sgl_nixl_plugin import metrics
from sgl_nixl_plugin.adapter.decode import DecodeListener
from sgl_nixl_plugin.adapter.decode_staging import DecodeStaging
from sgl_nixl_plugin.adapter.memory import (
    compat_of,
    kv_mem_kind,
    memory_from_kv_args,
    prefill_head_layout,
    to_regions,
)
from sgl_nixl_plugin.adapter.prefill_control import PrefillControl
from sgl_nixl_plugin.adapter.prefill_state import Chunk, RoomProgress
from sgl_nixl_plugin.adapter.transfer_worker import TransferWorker
from sgl_nixl_plugin.bridge.entry import announce
from sgl_nixl_plugin.engine.engine import PeerLink, TransferEngine
from sgl_nixl_plugin.engine.staging import StagingBuffer
from sgl_nixl_plugin.registry import manager as registry
from sgl_nixl_plugin.registry.spec import TransferEvent
from sgl_nixl_plugin.settings import Settings, staging_sizes
from sgl_nixl_plugin.wire.codec import Codec, index_specs
from sgl_nixl_plugin.wire.compat import compat_hash
from sgl_nixl_plugin.wire.http_auth import sign
from sgl_nixl_plugin.wire.messages import (
    Abort,
    AbortAck,
    Message,
    PeerRegistration,
    TransferRequest,
    TransferStatus,
)

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


class NixlPluginKVManager(CommonKVManager):
    supports_deferred_decode_kv_release = True
    reports_transfer_latency = True

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        self._advertise = False  # SGLang's __init__ registers at the bootstrap: hold that
        self.settings = Settings.from_env()
        self.codec = Codec(secret=self.settings.secret)
        self.codec.rejections.listeners.append(metrics.rejected)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.defer_decode_allocation:
            raise ValueError(
                "sgl-nixl-plugin does not support "
                "--disaggregation-decode-allocation-policy prefill_complete yet; use 'early'"
            )
        device = getattr(server_args, "device", "cuda") or "cuda"
        self.kv_mem_kind = kv_mem_kind(args, device, self.settings.kv_mem_kind)
        memory = memory_from_kv_args(args, self.kv_mem_kind)
        if self.kv_mem_kind == "VRAM":
            import torch

            torch.cuda.set_device(int(getattr(args, "gpu_id", 0) or 0))
        config = registry.resolve_agent_config()
        if config.num_threads == 0 and disaggregation_mode == DisaggregationMode.PREFILL:
            config.num_threads = self.settings.nixl_threads  # the initiator drives the WRITEs
        self.engine = TransferEngine(config, memory, progress_thread=self.settings.progress_thread)
        self._engine_lock = threading.Lock()
        self.compat = compat_of(args, bool(is_mla_backend))
        self.compat_hash = compat_hash(self.compat)
        self._stopping = False
        self.staging: Any = None
        self.copier: Any = None
        self.copy_stream: Any = None
        device = int(getattr(args, "gpu_id", 0) or 0) if self.kv_mem_kind == "VRAM" else 0
        self.staging_bytes, self.slot_bytes = staging_sizes(self.settings, self.kv_mem_kind)
        staging_on = self.staging_bytes > 0
        if disaggregation_mode == DisaggregationMode.PREFILL:
            self.head_layout = prefill_head_layout(args, bool(is_mla_backend))
            self.room_seen: dict[int, float] = {}
            # rooms a decode gave up before this side's sender existed: room -> (reason, when)
            self.early_aborts: dict[int, tuple[str, float]] = {}
            self.early_abort_lock = threading.Lock()
            self.remote_free: dict[int, dict[str, Any]] = {}
            self.staged_fallbacks = 0  # staged chunks sent direct: no receiver slot in time
            if staging_on:
                self._start_prefill_staging(device)
            self.control = PrefillControl(self)
            self.workers = [TransferWorker(self, i) for i in range(self.settings.workers)]
            self.control.start()
            for w in self.workers:
                w.start()
        else:
            self.room_endpoints: dict[int, set[Endpoint]] = defaultdict(set)
            # while a receiver sends its metadata: the prefill ranks it goes to, in order
            self.metadata_targets: dict[int, deque[Endpoint]] = {}
            self.refused_endpoints: dict[Endpoint, tuple[str, float]] = {}
            if staging_on:
                self._start_decode_staging(device)
            self.listener = DecodeListener(self)
            self.listener.start()
            self._start_heartbeat_checker_thread()
        if disaggregation_mode == DisaggregationMode.PREFILL:
            # Only now can this rank answer decodes: advertise it at the bootstrap server.
            self._advertise = True
            self.register_to_bootstrap()
        announce()
        logger.info(
            "sgl-nixl: %s manager ready (agent %s, %s KV, %d regions, control %s:%s)",
            disaggregation_mode.value, self.engine.name, self.kv_mem_kind,
            len(memory.kv), self.local_ip, self.rank_port,
        )

    def _start_prefill_staging(self, device: int) -> None:
        try:
            from sgl_nixl_plugin.engine.copy_kernels import make_copier

            self.copier = make_copier(self.kv_mem_kind, device)
            if hasattr(self.copier, "map_units"):  # the sender's indices: read in place
                self.copier.map_units = self.settings.map_indices
            self.staging = StagingBuffer(
                self.engine.agent, self.staging_bytes, self.slot_bytes, self.kv_mem_kind, device
            )
            if self.kv_mem_kind == "VRAM":
                import torch

                self.copy_stream = torch.cuda.Stream(device=device)
        except Exception as exc:
            self.staging = None
            logger.warning("sgl-nixl: staging path disabled (%s); scattered pages go direct", exc)

    def _start_decode_staging(self, device: int) -> None:
        try:
            staging = DecodeStaging(self, device)
            staging.start()
            self.staging = staging
        except Exception as exc:
            logger.warning("sgl-nixl: staging path disabled (%s); scattered pages go direct", exc)

    def apply_status(self, msg: TransferStatus) -> None:
        self.apply_prefill_status(
            bootstrap_room=msg.room,
            status=msg.status,
            prefill_rank=msg.prefill_rank,
            failure_reason=msg.reason or None,
        )

    def register_to_bootstrap(self) -> None:
        """Advertise this prefill rank, but only once its engine and threads are up."""
        if self._advertise:
            super().register_to_bootstrap()

    def _register_topology_row(self, url: str, payload: dict) -> None:
        """PUT /route like SGLang does, signed when a shared secret is configured."""
        body = json.dumps(payload).encode()
        path = "/" + url.split("/", 3)[3]
        headers = {"Content-Type": "application/json", **sign(self.settings.secret, "PUT", path, body)}
        delay = 0.5
        for attempt in range(1, 6):
            try:
                r = requests.put(url, data=body, headers=headers, timeout=5)
                if r.status_code == 200:
                    return
                problem = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code in (400, 401, 413):
                    break  # retrying a refused registration can't help
            except Exception as exc:  # never take the scheduler down: SGLang's own code doesn't
                problem = f"{type(exc).__name__}: {exc}"
            logger.warning("sgl-nixl: bootstrap registration attempt %d/5 failed: %s", attempt, problem)
            if attempt < 5:
                time.sleep(delay)
                delay = min(delay * 2, 8.0)
        logger.error(
            "sgl-nixl: this prefill rank could not register with the bootstrap server at %s: %s",
            url, problem,
        )

    # -- sending control messages -------------------------------------------------------
    def _connect(self, endpoint: str, is_ipv6: bool = False) -> Any:
        """A cached PUSH socket per peer, replaced when its monitor saw it disconnect.

        SGLang's own turns reconnection off (``RECONNECT_IVL`` -1): a message sent while a
        decode was briefly gone leaves a socket that never connects, is never replaced (the
        monitor reports disconnects only) and swallows every later message. Ours retries.
        """
        with self._socket_lock:
            sock = self._socket_cache.get(endpoint)
            if sock is not None and not _saw_disconnect(self._monitor_cache.get(endpoint)):
                return sock
            if sock is not None:
                _close_monitored(sock, self._monitor_cache.pop(endpoint, None))
            sock = self._zmq_ctx.socket(zmq.PUSH)
            if is_ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socket_cache[endpoint] = sock
            self._monitor_cache[endpoint] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._socket_send_locks.setdefault(endpoint, threading.Lock())
            return sock

    def _send_multipart_locked(self, endpoint: str, parts: list, is_ipv6: bool = False) -> None:
        """Never block on a slow or dead peer: a full queue raises instead of waiting 30 s."""
        sock = self._connect(endpoint, is_ipv6=is_ipv6)
        with self._socket_send_locks[endpoint]:
            sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)

    def send_to(self, endpoint: Endpoint, msg: Message, arrays: tuple = ()) -> bool:
        """Send one message without blocking; False (logged) if the peer can't take it.

        A decode sends through SGLang's per-endpoint receiver sockets, the ones that carry
        its registrations and transfer requests, so an abort never overtakes the request
        it cancels.
        """
        na = NetworkAddress(endpoint[0], int(endpoint[1]))
        frames = self.codec.encode(msg, arrays)
        try:
            if self.disaggregation_mode == DisaggregationMode.DECODE:
                sock, lock = CommonKVReceiver._connect(na.to_tcp(), is_ipv6=na.is_ipv6)
                with lock:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            else:
                self._send_multipart_locked(na.to_tcp(), frames, na.is_ipv6)
            return True
        except Exception as exc:
            logger.warning(
                "sgl-nixl: could not send %s to %s:%s: %s", type(msg).__name__, *endpoint, exc
            )
            return False

    @property
    def prefill_rank_id(self) -> int:
        return self._prefill_unique_rank()

    def _encode_kv_status_message(
        self, *, bootstrap_room: int, status: KVPoll, failure_reason: str | None
    ) -> list:
        return self.codec.encode(
            TransferStatus(bootstrap_room, int(status), self.prefill_rank_id, failure_reason or "",
                           self.local_ip, self.rank_port)
        )

    def parse_kv_status_message(self, msg: list) -> tuple[int, int, int, str | None] | None:
        decoded = self.codec.decode(msg)
        if decoded is None or not isinstance(decoded.msg, TransferStatus):
            return None
        m = decoded.msg
        return m.room, m.status, m.prefill_rank, m.reason or None

    def _send_abort_ack(self, room: int, target: AckTarget) -> None:
        self.send_to(
            (target.ip, target.port), AbortAck(room, self.prefill_rank_id, target.generation)
        )

    # -- decode: messages to prefill ----------------------------------------------------
    def build_receiver_registration_message(self) -> list:
        args = self.kv_args
        mem = self.engine.memory
        reg = PeerRegistration(
            compat=self.compat,
            compat_hash=self.compat_hash,
            agent_name=self.engine.name,
            agent_metadata=self.engine.metadata,
            ip=self.local_ip,
            port=self.rank_port,
            tp_rank=int(args.engine_rank) % self.attn_tp_size,
            tp_size=self.attn_tp_size,
            kv=to_regions(mem.kv),
            aux=to_regions(mem.aux),
            state=[to_regions(s) for s in mem.state],
            staging=self.staging.area() if self.staging is not None else None,
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
        state = [] if is_dummy else [
            np.empty(0, np.int32) if s is None else np.asarray(s).ravel()
            for s in (state_indices or [])
        ]
        if not is_dummy:
            self.listener.expect_data()
        targets = self.metadata_targets.get(bootstrap_room)
        target = targets.popleft() if targets else None  # the prefill rank this goes to
        slots: list[int] = []
        staged = self.staging is not None and not is_dummy and len(kv) > 0
        if staged:
            slots = self.staging.grant(bootstrap_room, kv, target)
        req = TransferRequest(
            room=bootstrap_room,
            agent_name=self.engine.name,
            ip=self.local_ip,
            port=self.rank_port,
            aux_index=-1 if aux_index is None else int(aux_index),
            required_dst_info_num=int(required_dst_info_num),
            decode_prefix_len=int(decode_prefix_len or 0),
            is_dummy=bool(is_dummy),
            indices=index_specs(kv, state),
            staging_slots=slots,
            staging_wait=staged and not slots,
        )
        return self.codec.encode(req, [kv, *state])

    # -- prefill: the scheduler's send() lands here -------------------------------------
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
        chunk = Chunk(
            room=bootstrap_room,
            pages=np.array(kv_indices, dtype=np.int64, copy=True),
            index_slice=index_slice,
            is_last=is_last_chunk,
            aux_index=aux_index,
            state=state_indices,
            events=tuple(e for e in (wait_event, indices_event) if hasattr(e, "synchronize")),
        )
        self.workers[bootstrap_room % len(self.workers)].queue.put(chunk)

    def wake_worker(self, room: int) -> None:
        """Tell the worker that owns ``room`` that one of its staged jobs may go on."""
        self.workers[room % len(self.workers)].wake()

    def transfer_settled(self, room: int) -> None:
        """One WRITE of ``room`` finished (either way); ACK a drained abort."""
        left = self._staging_outstanding.get(room, 0) - 1
        if left > 0:
            self._staging_outstanding[room] = left
            return
        self._staging_outstanding.pop(room, None)
        self._maybe_ack_drained_abort(room)

    def ack_abort_when_drained(self, room: int, ip: str, port: int, generation: int) -> None:
        self.register_deferred_ack_target(room, AckTarget(ip, port, generation))
        self._maybe_ack_drained_abort(room)

    def engine_unlink(self, link: PeerLink) -> None:
        with self._engine_lock:
            self.engine.unlink(link)

    def record_failure(self, bootstrap_room: int, failure_reason: str) -> None:
        """SGLang's, and on a decode each failed room's first reason is counted in
        ``sgl_nixl_failures_total`` (lost prefills, refusals, aborts; a prefill counts its
        rooms when their transfers end)."""
        first = bootstrap_room not in self.failure_records
        super().record_failure(bootstrap_room, failure_reason)
        if first and self.disaggregation_mode == DisaggregationMode.DECODE:
            metrics.failure(failure_reason)

    def fail_rooms_of_peer(self, agent: str, reason: str) -> None:
        for room, infos in list(self.transfer_infos.items()):
            info = infos.get(agent)
            if info is None or info.is_dummy:
                continue
            if self.request_status.get(room) not in (None, KVPoll.Success, KVPoll.Failed):
                self.conclude_failure(bootstrap_room=room, failure_reason=reason)

    def observe(self, room: int, prog: RoomProgress, ok: bool, reason: str | None = None) -> None:
        """Report a finished room to metrics and to deployers' observer hooks."""
        seconds = time.perf_counter() - prog.started
        metrics.transfer_done(ok, prog.path, prog.nbytes, seconds, prog.descriptors, reason)
        if self.staging is not None and hasattr(self.staging, "free"):
            metrics.staging_in_use("prefill", self.staging.num_slots - self.staging.free)
        registry.notify_transfer(
            TransferEvent(
                room=room,
                peer=",".join(sorted(prog.peers)),
                ok=ok,
                bytes=prog.nbytes,
                duration_s=seconds,
                descriptors=prog.descriptors,
                path=prog.path,
                reason=reason,
            )
        )

    # -- decode: bookkeeping for liveness and refusals -----------------------------------
    def pending_endpoints(self) -> set[Endpoint]:
        out: set[Endpoint] = set()
        for room, eps in list(self.room_endpoints.items()):
            if self.request_status.get(room) in (KVPoll.WaitingForInput, KVPoll.Transferring):
                out |= eps
        return out

    def known_endpoints(self) -> set[Endpoint]:
        """Every prefill rank this decode has a cached route to (watched for loss)."""
        with self.connection_lock:
            pools = list(self.connection_pool.values())
        return {(i["rank_ip"], int(i["rank_port"])) for infos in pools for i in infos}

    def fail_endpoint(self, endpoint: Endpoint, reason: str) -> list[int]:
        """Fail every unfinished room served by ``endpoint``, forget its cached route, and
        return the rooms failed."""
        failed = []
        for room, eps in list(self.room_endpoints.items()):
            if endpoint in eps and self.request_status.get(room) not in (
                None, KVPoll.Success, KVPoll.Failed,
            ):
                self.record_failure(room, reason)
                self.update_status(room, KVPoll.Failed)
                failed.append(room)
        self.forget_endpoint(endpoint)
        log = logger.error if failed else logger.info
        log("sgl-nixl: %s (%d requests failed: rooms %s)", reason, len(failed), _rooms(failed))
        return failed

    def forget_endpoint(self, endpoint: Endpoint) -> None:
        """Drop cached routes to ``endpoint`` so the next request asks the bootstrap again."""
        with self.connection_lock:
            for key, infos in list(self.connection_pool.items()):
                if any((i.get("rank_ip"), int(i.get("rank_port", -1))) == endpoint for i in infos):
                    del self.connection_pool[key]
        CommonKVReceiver.disconnect_endpoint(NetworkAddress(*endpoint).to_tcp())
        returners = getattr(getattr(self, "staging", None), "returners", None)
        if returners is not None:  # it says again at its next registration whether it returns
            returners.discard(endpoint)

    def on_refused(self, endpoint: Endpoint, reason: str) -> None:
        self.refused_endpoints[endpoint] = (reason, time.monotonic())
        why = f"prefill {endpoint[0]}:{endpoint[1]} refused this decode: {reason}"
        for room in self.fail_endpoint(endpoint, why):
            self.tell_prefills(room, self.room_endpoints.get(room, {endpoint}), why)

    def tell_prefills(self, room: int, endpoints: set[Endpoint], reason: str) -> None:
        """This decode gave ``room`` up on its own: tell its prefill ranks why, so their
        senders fail now (SGLang's decode sends no abort for a failed handshake)."""
        msg = Abort(room, self.local_ip, self.rank_port, None, reason)
        for ep in endpoints:
            self.send_to(ep, msg)

    # -- prefill: rooms a decode gave up before their sender existed ---------------------
    def note_early_abort(self, room: int, reason: str) -> bool:
        """Fail ``room`` now, or at its sender's creation if it has none yet (False)."""
        with self.early_abort_lock:
            if room not in self.request_status:
                now = time.monotonic()
                horizon = now - max(60.0, float(self.bootstrap_timeout))
                for old in [r for r, (_, t) in self.early_aborts.items() if t < horizon]:
                    del self.early_aborts[old]
                if len(self.early_aborts) < 100_000:
                    self.early_aborts[room] = (reason, now)
                return False
        if self.request_status[room] != KVPoll.Success:
            self.record_failure(room, reason)
            self.update_status(room, KVPoll.Failed)
        return True

    def claim_early_abort(self, room: int) -> str | None:
        """The reason a decode gave up ``room`` before its sender was created, if it did."""
        with self.early_abort_lock:
            hit = self.early_aborts.pop(room, None)
        return hit[0] if hit else None

    # -- teardown -----------------------------------------------------------------------
    def close(self) -> None:
        """Stop our threads and release every NIXL resource (tests and role switch)."""
        if self._stopping:
            return
        self._stopping = True
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self.control.stop()
            for w in self.workers:
                w.stop()
            threads = [self.control.thread, *(w.thread for w in self.workers)]
        else:
            self.listener.stop()
            self._heartbeat_shutdown.set()
            threads = [self.listener.thread]
            if self.staging is not None:
                self.staging.stop()
                threads += [self.staging.thread, self.staging.completer]
        for t in threads:
            t.join(timeout=5)
        self.engine.close()
        if any(t.is_alive() for t in threads):
            logger.warning("sgl-nixl: a control thread did not stop; its sockets stay open")
            return
        # A context left to the garbage collector with a socket that still holds messages
        # blocks forever in its finalizer (seen at interpreter exit): end it here.
        with self._socket_lock:
            for endpoint, sock in list(self._socket_cache.items()):
                _close_monitored(sock, self._monitor_cache.pop(endpoint, None))
            self._socket_cache.clear()
        self._zmq_ctx.destroy(linger=0)


def _close_monitored(sock: Any, monitor: Any) -> None:
    """Close a socket and its monitor in the order libzmq needs to let the context end."""
    if monitor is not None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        monitor.close(linger=0)
    sock.close(linger=0)


def _saw_disconnect(monitor: Any) -> bool:
    """Whether a socket's disconnect monitor reported since it was made (or is broken)."""
    if monitor is None:
        return False
    try:
        monitor.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError:
        pass
    return True


def _rooms(rooms: list[int], limit: int = 8) -> str:
    """Room ids for a log line, the first ``limit`` of them."""
    shown = ", ".join(str(r) for r in rooms[:limit])
    return shown + (f" and {len(rooms) - limit} more" if len(rooms) > limit else "") or "none"
