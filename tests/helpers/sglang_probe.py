"""Run inside a fresh subprocess: SGLang's real ``load_plugins()``, then report what
``get_kv_class`` returns for every backend and class type, as JSON on the last stdout line.

Usage: python sglang_probe.py [--break-signature] [--parse NAME ...] [--extra-backend NAME ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

RESULT_MARKER = "@@PROBE@@"


def _describe(obj: Any) -> Any:
    if obj is None:
        return None
    return f"{obj.__module__}.{obj.__qualname__}"


def _break_signature() -> None:
    """Give CommonKVSender.send an older (0.5.20-style) parameter list before plugins load."""
    from sglang.srt.disaggregation.common import conn

    def send(self, kv_indices, state_indices=None, token_position_offset=None):
        raise AssertionError("never called")

    conn.CommonKVSender.send = send


def _parse(name: str) -> str:
    """Build SGLang's real CLI parser and see whether it accepts the backend name."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    try:
        ns = parser.parse_args(["--model-path", "dummy", "--disaggregation-transfer-backend", name])
    except SystemExit:
        return "rejected"
    return f"accepted:{ns.disaggregation_transfer_backend}"


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--break-signature", action="store_true")
    cli.add_argument("--parse", action="append", default=[])
    cli.add_argument("--extra-backend", action="append", default=[])
    args = cli.parse_args()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("sglang").setLevel(logging.WARNING)

    if args.break_signature:
        _break_signature()

    from sglang.srt.plugins import load_plugins

    load_plugins()
    load_plugins()  # SGLang guards this; our register() must be idempotent on its own too

    from sglang.srt.disaggregation import utils
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sgl_nixl_plugin.bridge import entry

    state = entry._state  # None: SGLang never called our register()
    idempotent = None
    if state is not None:  # call it again: nothing new may be queued
        hooks_before = sum(len(v) for v in HookRegistry._hooks.values())
        entry.register()
        idempotent = sum(len(v) for v in HookRegistry._hooks.values()) == hooks_before

    out: dict[str, Any] = {
        "plugin_state": state,
        "register_idempotent": idempotent,
        "transfer_backend_values": sorted(m.value for m in utils.TransferBackend),
        "hooks": {
            target: [hook_type.value for hook_type, _hook, _src in hooks]
            for target, hooks in HookRegistry._hooks.items()
        },
        "kv": {},
        "parse": {name: _parse(name) for name in args.parse},
    }
    for value in out["transfer_backend_values"] + args.extra_backend:
        row: dict[str, Any] = {}
        for class_type in utils.KVClassType:
            try:
                row[class_type.value] = _describe(
                    utils.get_kv_class(utils.TransferBackend(value), class_type)
                )
            except Exception as exc:
                row[class_type.value] = {"error": type(exc).__name__}
        out["kv"][value] = row
    print(RESULT_MARKER + json.dumps(out, sort_keys=True))


if __name__ == "__main__":
    main()
