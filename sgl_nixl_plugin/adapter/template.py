"""The backend template SGLang 0.5.23 provides in its common classes, for older releases.

SGLang 0.5.23 moved the generic halves of a backend (a sender's ``send``/``poll``/
``failure_exception``, a receiver's registration and ``send_metadata``) into
``CommonKVSender``/``CommonKVReceiver``, which then call the manager's message builders and
``add_transfer_request``. In 0.5.21 and 0.5.22 those methods are abstract, a no-op or
``NotImplementedError``, and every backend wrote its own. These mixins are that half for
the older releases, behaving as 0.5.23's do, so the plugin's own classes are the same on
every release. Each subclasses SGLang's common class so that, composed after our class,
it still comes before SGLang's in the method order.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import zmq
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)

logger = logging.getLogger(__name__)

_ENDED = (KVPoll.Success, KVPoll.Failed)
_UNKNOWN = "the room failed on another rank"


class ManagerTemplate(CommonKVManager):
    def check_peer_aux_buffer_count(self, peer: str, num_remote: int) -> None:
        """Aux buffers pair up by position: say so when a decode has another count."""
        num_local = len(self.kv_args.aux_data_ptrs)
        if num_remote != num_local:
            logger.error(
                "sgl-nixl: decode %s registered %d metadata buffers, this prefill has %d: only "
                "the first %d are moved (enable the same optional metadata buffers on both)",
                peer,
                num_remote,
                num_local,
                min(num_remote, num_local),
            )


class SenderTemplate(CommonKVSender):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._early_send_wait_event: Any = None  # the scheduler may set it before a send
        self._transfer_start_time: float | None = None
        if self.init_time is None:  # starts the bootstrap timeout
            self.init_time = time.time()

    def send(
        self, kv_indices: Any, state_indices: list | None = None, num_kv_tokens: int | None = None
    ) -> None:
        if self.conclude_state in _ENDED:
            return
        pages, where, last, skip = self._prepare_send_indices(kv_indices, state_indices)
        if skip:
            return
        if self._transfer_start_time is None and (len(pages) or state_indices is not None):
            self._transfer_start_time = time.perf_counter()
        event, self._early_send_wait_event = self._early_send_wait_event, None
        self.kv_mgr.add_transfer_request(
            self.bootstrap_room,
            pages,
            where,
            last,
            aux_index=self.aux_index if last else None,
            state_indices=state_indices if last else None,
            num_kv_tokens=num_kv_tokens,
            wait_event=event,
        )
        self._record_transfer_indices(pages, state_indices)

    def poll(self) -> KVPoll:
        return self._poll_status(self.kv_mgr.check_status)

    def poll_pp_consensus(self) -> KVPoll:
        return self._poll_status(self.kv_mgr.check_status_pp_consensus)

    def _poll_status(self, check: Any) -> KVPoll:
        """The room's status, holding Success back while WRITEs are still in flight."""
        if self.conclude_state is not None:
            return self.conclude_state
        room, mgr = self.bootstrap_room, self.kv_mgr
        status = check(room) if room in mgr.request_status else KVPoll.Failed
        if status == KVPoll.Success and mgr._staging_outstanding.get(room, 0) > 0:
            return KVPoll.Transferring
        if status == KVPoll.Bootstrapping:
            timed_out = self._check_bootstrap_timeout()
            if timed_out is not None:
                status = timed_out
        if status in _ENDED:
            self.conclude_state = status
            if status == KVPoll.Success and self._transfer_start_time is not None:
                elapsed = time.perf_counter() - self._transfer_start_time
                self._transfer_metric.transfer_latency_s = elapsed
        return status

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        self.clear()
        _raise_failure(self.kv_mgr, self.bootstrap_room)


class ReceiverTemplate(CommonKVReceiver):
    def _register_kv_args(self) -> bool:
        infos = getattr(self, "bootstrap_infos", None)
        if infos is None:
            return False
        if not infos:
            return True
        frames = self.kv_mgr.build_receiver_registration_message()
        return all(self._push(info, frames, "registration") for info in infos)

    def send_metadata(
        self,
        kv_indices: Any,
        aux_index: int | None = None,
        state_indices: list | None = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
    ) -> None:
        room, mgr = self.bootstrap_room, self.kv_mgr
        infos = getattr(self, "bootstrap_infos", None)
        if infos is None:
            mgr.record_failure(
                room, f"no parallel info from the prefill's bootstrap at {self.bootstrap_addr}"
            )
            mgr.update_status(room, KVPoll.Failed)
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("sgl-nixl: host KV destinations are not supported")
        for info in infos:
            frames = mgr.build_receiver_metadata_message(
                bootstrap_room=room,
                required_dst_info_num=self.required_dst_info_num,
                kv_indices=kv_indices,
                aux_index=aux_index,
                state_indices=state_indices,
                decode_prefix_len=decode_prefix_len,
                is_dummy=info["is_dummy"],
            )
            if not self._push(info, frames, "transfer request"):
                self.invalidate_cached_bootstrap_infos()
                return
        self.init_time = time.time()  # starts the waiting timeout

    def _push(self, info: dict, frames: list, what: str) -> bool:
        """Send ``frames`` to one prefill rank; a failed send fails the room."""
        try:
            sock, lock = self._connect_to_bootstrap_server(info)
            with lock:
                sock.send_multipart(frames)
        except zmq.ZMQError as exc:
            room = self.bootstrap_room
            where = f"{info.get('rank_ip')}:{info.get('rank_port')}"
            self.kv_mgr.record_failure(room, f"{what} to prefill {where} failed: {exc}")
            self.conclude_state = KVPoll.Failed
            self.kv_mgr.update_status(room, KVPoll.Failed)
            return False
        return True

    def _clear(self) -> None:
        self._conclude_at_clear()
        super()._clear()

    def _conclude_at_clear(self) -> None:
        """A cleared receiver keeps its result: a later poll says Success or Failed."""
        if self.conclude_state is None:
            status = self.kv_mgr.request_status.get(self.bootstrap_room)
            self.conclude_state = status if status in _ENDED else KVPoll.Failed

    def failure_exception(self) -> None:
        self.conclude_state = KVPoll.Failed
        self.clear()
        _raise_failure(self.kv_mgr, self.bootstrap_room)


def _raise_failure(mgr: Any, room: int) -> None:
    with mgr.failure_lock:
        reason = mgr.failure_records.pop(room, None)
    raise KVTransferError(room, reason or _UNKNOWN, is_from_another_rank=reason is None)
