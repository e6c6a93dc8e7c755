"""SGLang 0.5.21: the backend template of 0.5.22 (``adapter.template``), plus what 0.5.21
lacks or spells differently.

- Abort ACKs carry no generation: a drained abort is ACKed to ``(ip, port)``, a decode
  counts ACKs per prefill rank, and our wire's generation is a constant 0.
- The manager has no ``_staging_outstanding`` (each backend kept its own) and no
  ``defer_decode_allocation`` (SGLang's deferred allocation came in 0.5.22).
- A receiver's cleanup is ``clear()`` itself (no ``_clear``), and it has no ``poll``.
- The scheduler passes ``dest_tp_ranks`` and ``pp_rank`` to the sender; SGLang ignores them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll

from sgl_nixl_plugin.adapter import manager, receiver, sender
from sgl_nixl_plugin.adapter.bootstrap import NixlPluginKVBootstrapServer
from sgl_nixl_plugin.adapter.sglang_rooms import SGLangRooms
from sgl_nixl_plugin.adapter.template import ManagerTemplate, ReceiverTemplate, SenderTemplate
from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.wire.messages import AbortAck

RELEASE = "0.5.21"
#: The generation our wire carries where SGLang has none (any value means "ACK this").
GENERATION = 0


class SGLangRooms0521(SGLangRooms):
    """SGLang 0.5.21's abort-ACK tables, which know no generations."""

    def arm_abort(self, room: int) -> int:
        self._m.register_deferred_abort_room(room)
        return GENERATION

    def note_abort_ack(self, room: int, prefill_rank: int, generation: int | None) -> None:
        if self._m.enable_deferred_decode_kv_release and generation is not None:
            self._m.note_abort_ack(room, prefill_rank)

    def ack_abort_when_drained(self, room: int, ip: str, port: int, generation: int) -> None:
        self._m.register_deferred_ack_target(room, ip, port)
        self._m._maybe_ack_drained_abort(room)


class NixlPluginKVManager(manager.NixlPluginKVManager, ManagerTemplate):
    facade = SGLangRooms0521
    defer_decode_allocation = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # WRITEs in flight per room, read by SGLang's drained-abort ACK and our sender's poll
        self._staging_outstanding: defaultdict[int, int] = defaultdict(int)
        super().__init__(*args, **kwargs)

    def _send_abort_ack(self, decode_ip: str, decode_port: int, room: int) -> None:  # type: ignore[override]
        ack = AbortAck(room, self.prefill_rank_id, GENERATION, self.local_ip, int(self.rank_port))
        self.transport.send((decode_ip, int(decode_port)), ack)


class NixlPluginKVSender(sender.NixlPluginKVSender, SenderTemplate):
    def __init__(
        self,
        mgr: Any,
        bootstrap_addr: str,
        bootstrap_room: int,
        dest_tp_ranks: list[int] | None = None,
        pp_rank: int | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """0.5.21's scheduler passes ``dest_tp_ranks`` and ``pp_rank`` (SGLang ignores
        both); a caller written for later releases may leave them out."""
        super().__init__(
            mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks or [], pp_rank or 0, *args, **kwargs
        )


class NixlPluginKVReceiver(receiver.NixlPluginKVReceiver, ReceiverTemplate):
    _abort_generation: int | None = None

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.check_status(self.bootstrap_room)
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
        elif status == KVPoll.WaitingForInput:
            timed_out = self._check_waiting_timeout()  # KVPoll.Failed is 0: no ``or``
            status = status if timed_out is None else timed_out
        if status == KVPoll.Failed:  # the room's machine: no prefill status applies now
            decode_status.failed_here(self.kv_mgr.decode.ctx, self.bootstrap_room)
        return status

    def clear(self) -> None:
        ok = self._succeeded()
        self._conclude_at_clear()
        super().clear()
        self.kv_mgr.decode.close_room(self.bootstrap_room, ok)


__all__ = [
    "RELEASE",
    "NixlPluginKVBootstrapServer",
    "NixlPluginKVManager",
    "NixlPluginKVReceiver",
    "NixlPluginKVSender",
]
