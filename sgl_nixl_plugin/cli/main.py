"""``sgl-nixl-plugin`` entry point: ``version``, ``doctor [--json]``, ``bench ...``.

``bench`` is dispatched before argparse sees it, so every option after ``bench`` belongs to
the benchmark's own parser (``sgl_nixl_plugin.cli.bench:main(argv) -> int``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Sequence

from sgl_nixl_plugin import __version__
from sgl_nixl_plugin.adapter import release_gate

BENCH_MODULE = "sgl_nixl_plugin.cli.bench"


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_version() -> int:
    """Print the plugin version, then SGLang's (with the supported range) and NIXL's."""
    sglang = release_gate.installed_sglang_version()
    if sglang is None:
        sglang_line = f"SGLang not installed (supported: {release_gate.SUPPORTED_SGLANG})"
    else:
        contract = release_gate.contract_for(sglang)
        where = "within" if contract else "OUTSIDE"
        sglang_line = (
            f"SGLang {sglang} ({where} the supported range {release_gate.SUPPORTED_SGLANG}"
        )
        sglang_line += f"; contract {contract})" if contract else ")"
    print(f"sgl-nixl-plugin {__version__}")
    print(sglang_line)
    print(f"NIXL {_dist_version('nixl')}")
    return 0


def cmd_bench(argv: list[str]) -> int:
    """Hand ``argv`` to the benchmark's own CLI, imported only now (it pulls in SGLang)."""
    try:
        import importlib

        bench = importlib.import_module(BENCH_MODULE)
    except ImportError as exc:
        if exc.name == BENCH_MODULE:
            print(
                "sgl-nixl-plugin: the bench command is not available in this build "
                f"({BENCH_MODULE} is missing).",
                file=sys.stderr,
            )
        else:
            print(
                f"sgl-nixl-plugin: the bench command cannot start: {type(exc).__name__}: {exc}. "
                "Install the benchmark dependencies (SGLang): pip install 'sgl-nixl-plugin[sglang]'",
                file=sys.stderr,
            )
        return 2
    return int(bench.main(list(argv)) or 0)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser (``bench`` appears for ``--help`` but is dispatched earlier)."""
    parser = argparse.ArgumentParser(
        prog="sgl-nixl-plugin",
        description="NIXL KV-transfer backend for SGLang PD disaggregation: tools.",
    )
    parser.add_argument("--version", action="version", version=f"sgl-nixl-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{version,doctor,bench}")
    sub.add_parser("version", help="print plugin, SGLang and NIXL versions")
    doctor = sub.add_parser(
        "doctor", help="check whether a PD KV transfer can work on this machine"
    )
    doctor.add_argument("--json", action="store_true", help="print a JSON report")
    sub.add_parser(
        "bench", help="run the transfer benchmark (options: sgl-nixl-plugin bench --help)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "bench":
        return cmd_bench(args[1:])
    parser = build_parser()
    try:
        ns = parser.parse_args(args)
    except SystemExit as exc:  # --help / usage errors: keep main() returning an int
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if ns.command == "version":
        return cmd_version()
    if ns.command == "doctor":
        from sgl_nixl_plugin.cli import doctor as doctor_mod

        return doctor_mod.main(as_json=ns.json)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
