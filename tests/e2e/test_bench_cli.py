"""``sgl-nixl-plugin bench``: the embedded default's shape of output, and the two-host roles."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(240)

SMALL = ["--preset", "tiny", "--requests", "8", "--min-tokens", "32", "--max-tokens", "128"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_NIXL_PLUGIN_")}
    env.update(SGLANG_HOST_IP="127.0.0.1", UCX_NET_DEVICES="lo", PYTHONWARNINGS="ignore")
    return env


def _bench(*args: str) -> list[str]:
    return [sys.executable, "-m", "sgl_nixl_plugin", "bench", *args]


def test_bench_json_reports_every_request_verified():
    out = subprocess.run(
        _bench(*SMALL, "--json", "--quiet", "--timeout", "120"),
        capture_output=True,
        text=True,
        timeout=200,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout[out.stdout.index("{") :])
    (ours,) = report["results"]
    assert ours["backend"] == "plugin"
    assert ours["ok"] == 8 and ours["failed"] == 0 and ours["corrupt_pages"] == 0
    assert ours["bytes"] > 0 and ours["gbps"] > 0
    assert ours["latency_p99_ms"] >= ours["latency_p50_ms"] > 0
    assert ours["descriptors_per_request"] > 0


def test_roles_run_prefill_decode_and_bootstrap_as_separate_processes():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = [*SMALL, "--timeout", "60", "--bootstrap", f"127.0.0.1:{port}"]
    procs = [
        subprocess.Popen(
            _bench("--role", role, *common),
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=_env(),
        )
        for role in ("bootstrap", "prefill")
    ]
    try:
        decode = subprocess.run(
            _bench("--role", "decode", *common),
            capture_output=True,
            text=True,
            timeout=150,
            env=_env(),
        )
        assert decode.returncode == 0, decode.stderr[-2000:]
        result = json.loads(decode.stdout.strip().splitlines()[-1])
        assert result == {
            "role": "decode",
            "ok": 8,
            "failed": 0,
            "timed_out": 0,
            "corrupt_pages": 0,
        }
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


@pytest.mark.parametrize(
    "flags",
    [
        ("--prefill-tp", "2", "--prefill-dp", "3"),
        ("--decode-tp", "2", "--decode-dp", "0"),
        ("--prefill-tp", "2", "--prefill-dp", "2", "--prefill-pp", "2"),
    ],
    ids=["dp-not-dividing-tp", "dp-zero", "dp-with-pp"],
)
def test_dp_flags_that_sglang_would_not_run_are_refused(flags: tuple[str, ...]) -> None:
    out = subprocess.run(
        _bench(*SMALL, *flags, "--quiet"), capture_output=True, text=True, timeout=120, env=_env()
    )
    assert out.returncode == 2, (out.stdout[-1000:], out.stderr[-2000:])
    assert "-dp" in out.stderr and "must divide" in out.stderr, out.stderr[-2000:]
