"""The SGLang interfaces this plugin relies on, and how to check them.

SGLang's disaggregation classes change between releases, so the bridge checks at start-up
that every signature we call into or override looks the way it does in the release the
installed version maps to (:data:`SIGNATURES`), and refuses to register otherwise rather
than fail on the first request. Our classes for each release are ``adapter/releases``'. The supported releases are
``adapter.release_gate``'s.
"""

from __future__ import annotations

import enum
import importlib
import inspect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ReliedSignature:
    """One SGLang callable whose parameters we call with or override.

    ``target`` is ``"module:qualname"``; ``expected`` is the signature rendered by
    :func:`render_signature` (names, kinds and simple defaults; annotations ignored).
    """

    target: str
    expected: str


_COMMON = "sglang.srt.disaggregation.common.conn"


def relied(qualname: str, expected: str) -> ReliedSignature:
    """A signature of SGLang's common disaggregation module (``common/conn.py``)."""
    return ReliedSignature(f"{_COMMON}:{qualname}", expected)


#: Signatures every supported release shares. Each release adds its own (:data:`SIGNATURES`)
#: and the sum is checked: a mismatch means SGLang changed an interface under us, and the
#: bridge then refuses to register rather than fail on the first request.
SHARED: tuple[ReliedSignature, ...] = (
    relied(
        "CommonKVManager.__init__",
        "(self, args, disaggregation_mode, server_args, is_mla_backend=False)",
    ),
    relied("CommonKVManager.record_failure", "(self, bootstrap_room, failure_reason)"),
    relied("CommonKVSender.abort", "(self)"),  # wrapped: atomic with our conclusions
    relied("CommonKVManager.try_ensure_parallel_info", "(self, bootstrap_addr)"),
    relied(
        "CommonKVManager.apply_prefill_status",
        "(self, *, bootstrap_room, status, prefill_rank, failure_reason=None)",
    ),
    relied(
        "CommonKVManager.conclude_transfer",
        "(self, *, bootstrap_room, status, targets=None, failure_reason=None)",
    ),
    relied(
        "CommonKVManager.conclude_failure",
        "(self, *, bootstrap_room, failure_reason, targets=None)",
    ),
    relied("CommonKVManager.register_deferred_abort_room", "(self, bootstrap_room)"),
    relied("CommonKVManager._maybe_ack_drained_abort", "(self, room)"),
    relied("CommonKVManager.is_abort_release_safe", "(self, bootstrap_room, required_acks)"),
    relied("CommonKVReceiver.__init__", "(self, mgr, bootstrap_addr, bootstrap_room=None)"),
    relied("CommonKVReceiver.init", "(self, prefill_dp_rank)"),
    relied("CommonKVReceiver._send_abort_notification", "(self, *, force_arm=False)"),
    relied("CommonKVReceiver._connect", "(endpoint, is_ipv6=False)"),
    relied("CommonKVReceiver.disconnect_endpoint", "(endpoint)"),
    relied(
        "CommonKVReceiver._get_bootstrap_info_from_server",
        "(self, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)",
    ),
    relied("CommonKVBootstrapServer.__init__", "(self, host, port)"),
    ReliedSignature(
        "sglang.srt.disaggregation.utils:get_kv_class", "(transfer_backend, class_type)"
    ),
)

#: The abort-ACK API with generations (0.5.22 and later).
GENERATION_ACKS: tuple[ReliedSignature, ...] = (
    relied("CommonKVManager.register_deferred_ack_target", "(self, room, target)"),
    relied("CommonKVManager.note_abort_ack", "(self, bootstrap_room, prefill_rank, generation)"),
    relied("CommonKVManager._send_abort_ack", "(self, room, target)"),
)

#: What ``adapter.template`` calls into (0.5.21 and 0.5.22, whose backends write ``send``,
#: ``poll``, registration and ``send_metadata`` themselves).
TEMPLATE: tuple[ReliedSignature, ...] = (
    relied("CommonKVSender.send", "(self, kv_indices, state_indices=None, num_kv_tokens=None)"),
    relied("CommonKVSender._prepare_send_indices", "(self, kv_indices, state_indices=None)"),
    relied("CommonKVSender._record_transfer_indices", "(self, kv_indices, state_indices)"),
    relied("CommonKVSender._check_bootstrap_timeout", "(self)"),
    relied(
        "CommonKVReceiver.send_metadata",
        "(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, "
        "destination=KVTransferDestination.DEVICE)",
    ),
    relied("CommonKVReceiver._connect_to_bootstrap_server", "(bootstrap_info)"),
    relied("CommonKVReceiver.invalidate_cached_bootstrap_infos", "(self)"),
    relied("CommonKVReceiver._check_waiting_timeout", "(self)"),
)

#: Every supported release's signatures (keys: those of ``release_gate.CONTRACTS``). Checked at start-up
#: against the installed SGLang without importing our classes, so the gate stays cheap in
#: every SGLang process.
SIGNATURES: dict[str, tuple[ReliedSignature, ...]] = {
    "0.5.21": (
        *SHARED,
        *TEMPLATE,
        relied(
            "CommonKVSender.__init__",
            "(self, mgr, bootstrap_addr, bootstrap_room, dest_tp_ranks, pp_rank, "
            "req_has_disagg_prefill_dp_rank=False)",
        ),
        relied(
            "CommonKVManager.register_deferred_ack_target", "(self, room, decode_ip, decode_port)"
        ),
        relied("CommonKVManager.note_abort_ack", "(self, bootstrap_room, prefill_rank)"),
        relied("CommonKVManager._send_abort_ack", "(self, decode_ip, decode_port, room)"),
        relied("CommonKVReceiver.clear", "(self)"),
    ),
    "0.5.22": (
        *SHARED,
        *GENERATION_ACKS,
        *TEMPLATE,
        relied(
            "CommonKVSender.__init__",
            "(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False)",
        ),
    ),
    "0.5.23": (
        *SHARED,
        *GENERATION_ACKS,
        relied(
            "CommonKVSender.__init__",
            "(self, mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank=False)",
        ),
        relied(
            "CommonKVSender.send",
            "(self, kv_indices, state_indices=None, num_kv_tokens=None, indices_event=None)",
        ),
        relied(
            "CommonKVReceiver.send_metadata",
            "(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None, "
            "destination=KVTransferDestination.DEVICE, device_kv_indices=None)",
        ),
        relied(
            "CommonKVManager.build_receiver_metadata_message",
            "(self, *, bootstrap_room, required_dst_info_num, kv_indices, aux_index, "
            "state_indices, decode_prefix_len, is_dummy, device_kv_indices=None)",
        ),
    ),
}

#: Names the bridge uses besides the signatures above (missing = the plugin seam moved).
RELIED_NAMES: tuple[str, ...] = (
    "sglang.srt.plugins:load_plugins",
    "sglang.srt.plugins.hook_registry:HookRegistry.register",
    "sglang.srt.plugins.hook_registry:HookType.AROUND",
    "sglang.srt.plugins.hook_registry:HookType.REPLACE",
    "sglang.srt.disaggregation.utils:TransferBackend",
    "sglang.srt.disaggregation.base:KVArgs",
    "sglang.srt.disaggregation.base.conn:KVTransferDestination.HOST",
    "sglang.srt.server_args:add_disagg_transfer_backend_choices",
)

#: ``KVClassType`` values the ``get_kv_class`` hook answers for.
RELIED_KV_CLASS_TYPES = frozenset({"kvargs", "manager", "sender", "receiver", "bootstrap_server"})


def _render_default(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return "..."


def render_signature(sig: inspect.Signature) -> str:
    """Render a signature by parameter names, kinds and simple defaults only.

    Annotations are left out on purpose: SGLang uses string annotations that change with
    refactors without changing how we call the function.
    """
    parts: list[str] = []
    saw_kw_only_marker = False
    previous_kind: object = None
    for param in sig.parameters.values():
        kind = param.kind
        if (
            previous_kind is inspect.Parameter.POSITIONAL_ONLY
            and kind is not inspect.Parameter.POSITIONAL_ONLY
        ):
            parts.append("/")
        if kind is inspect.Parameter.KEYWORD_ONLY and not saw_kw_only_marker:
            parts.append("*")
            saw_kw_only_marker = True
        if kind is inspect.Parameter.VAR_POSITIONAL:
            saw_kw_only_marker = True
            text = f"*{param.name}"
        elif kind is inspect.Parameter.VAR_KEYWORD:
            text = f"**{param.name}"
        else:
            text = param.name
        if param.default is not inspect.Parameter.empty:
            text += f"={_render_default(param.default)}"
        parts.append(text)
        previous_kind = kind
    if previous_kind is inspect.Parameter.POSITIONAL_ONLY:
        parts.append("/")
    return "(" + ", ".join(parts) + ")"


def resolve(target: str) -> Any:
    """Import ``"module:qualname"`` and return the object (raises on any failure)."""
    module_name, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for attr in qualname.split("."):
        obj = getattr(obj, attr)
    return obj


def check_signatures(signatures: tuple[ReliedSignature, ...]) -> list[str]:
    """Problems with the SGLang interfaces we rely on; empty when all match ``signatures``
    (one release's entry of :data:`SIGNATURES`).

    Imports SGLang's disaggregation modules (seconds, pulls in torch): call it only once
    SGLang itself is being loaded, or from the doctor.
    """
    problems: list[str] = []
    for relied in signatures:
        try:
            found = render_signature(inspect.signature(resolve(relied.target)))
        except Exception as exc:  # any failure is a reportable problem
            problems.append(f"cannot inspect SGLang {relied.target}: {type(exc).__name__}: {exc}")
            continue
        if found != relied.expected:
            problems.append(
                f"SGLang {relied.target} changed: expected {relied.expected}, found {found}"
            )
    for name in RELIED_NAMES:
        try:
            resolve(name)
        except Exception as exc:
            problems.append(f"SGLang {name} is missing: {type(exc).__name__}: {exc}")
    try:
        kv_class_type = resolve("sglang.srt.disaggregation.utils:KVClassType")
        values = {member.value for member in kv_class_type}
        if not RELIED_KV_CLASS_TYPES <= values:
            problems.append(
                "SGLang KVClassType changed: expected values "
                f"{sorted(RELIED_KV_CLASS_TYPES)}, found {sorted(values)}"
            )
    except Exception as exc:
        problems.append(f"SGLang KVClassType is missing: {type(exc).__name__}: {exc}")
    return problems
