"""The shared secret (``SGLANG_NIXL_PLUGIN_SECRET``): signed HTTP routes and ZMQ messages.

With the same secret on every rank a PD session is byte-exact. With the secret on the
prefill (and its bootstrap server) only, a decode without it can't learn a rank's
address, so its requests fail, and nothing unsigned gets through: each refusal is shown
with its status and the reason counted in ``sgl_nixl_rejected_messages_total`` (read from
the rank processes through ``PROMETHEUS_MULTIPROC_DIR``).

Also ``sgl-nixl-plugin doctor``'s exposure warning: control sockets that would listen
beyond loopback without a shared secret.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import requests
from helpers import subproc
from helpers.pd import E2E_ENV, assert_clean, run_pd, workload
from test_hostile import (
    FakeDecode,
    FdCapture,
    LiveSession,
    multiproc_registry,
    rejected_counts,
    wait_for,
)

from sgl_nixl_plugin.bench.session import SessionConfig
from sgl_nixl_plugin.cli import doctor, doctor_exposure
from sgl_nixl_plugin.transport import bootstrap_client
from sgl_nixl_plugin.wire import codec as codec_mod
from sgl_nixl_plugin.wire import http_auth
from sgl_nixl_plugin.wire.codec import Codec
from sgl_nixl_plugin.wire.http_auth import HEADER, sign
from sgl_nixl_plugin.wire.messages import Ping, RegistrationReply

SECRET = "a-shared-pd-secret"
AUTH_REASONS = (
    "unauthenticated",
    "bad_mac",
    "stale",
    "unexpected_signature",
    "http_unauthenticated",
)
AGGREGATE = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
RANK0 = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


#: The secret's variables (the only spelling read, see ``sgl_nixl_plugin.settings``).
SECRET_VARS = ("SGLANG_NIXL_PLUGIN_SECRET", "SGLANG_NIXL_PLUGIN_SECRET_FILE")


@pytest.fixture
def prom(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A metrics directory the rank processes write to (they inherit this environment)."""
    path = tmp_path / "prom"
    path.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(path))
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    for name in SECRET_VARS:
        monkeypatch.delenv(name, raising=False)  # only what a test gives a rank
    yield path


# =========================================================================== sessions


@pytest.mark.timeout(180)
def test_same_secret_on_both_sides_is_byte_exact(prom: Any) -> None:
    env = {"SGLANG_NIXL_PLUGIN_SECRET": SECRET, "PROMETHEUS_MULTIPROC_DIR": str(prom)}
    res = run_pd(workload("tiny", 16, requests=6), env=env)
    assert_clean(res)
    counts = rejected_counts(multiproc_registry(prom))
    assert not {k: v for k, v in counts.items() if k in AUTH_REASONS and v}, counts


def _signed_stale(secret: bytes, method: str, path: str, body: bytes = b"") -> dict[str, str]:
    """A signature that was valid an hour ago."""
    with mock.patch.object(http_auth.time, "time", return_value=time.time() - 3600):
        return sign(secret, method, path, body)


@pytest.mark.timeout(180)
def test_decode_without_the_secret_is_refused_everywhere(prom: Any) -> None:
    secret = SECRET.encode()
    w = workload("tiny", 16, requests=3)
    live = LiveSession(
        SessionConfig(w, timeout_s=60, env={**E2E_ENV, "PROMETHEUS_MULTIPROC_DIR": str(prom)})
    )
    prefill = live.specs[("prefill", 0, 0)]
    # Only the prefill (and the bootstrap server it serves) has the secret; its rooms give
    # up on the decode after a few seconds instead of SGLang's 300.
    prefill.env = {
        **prefill.env,
        "SGLANG_NIXL_PLUGIN_SECRET": SECRET,
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "6",
    }
    url = f"http://127.0.0.1:{prefill.bootstrap_port}"
    fake = None
    refusals: list[tuple[str, int, str]] = []
    try:
        with FdCapture() as log:
            live.start(("prefill", 0, 0), ("decode", 0, 0))

            def up() -> requests.Response | None:
                try:
                    r = requests.get(url + AGGREGATE, timeout=2)
                except requests.RequestException:
                    return None
                return r if r.status_code == 200 else None

            # The aggregate topology names no address: open to anyone.
            agg = wait_for("the prefill's registration", up)
            assert "rank_ip" not in agg.text and "rank_port" not in agg.text
            assert agg.json()["attn_tp_size"] == 1

            def expect(what: str, r: requests.Response, words: str) -> None:
                assert (r.status_code, words in r.text) == (401, True), (
                    what,
                    r.status_code,
                    r.text,
                )
                refusals.append((what, r.status_code, r.text))

            body = json.dumps(
                {
                    "attn_tp_size": 1,
                    "attn_tp_rank": 0,
                    "attn_cp_size": 1,
                    "attn_cp_rank": 0,
                    "attn_dp_size": 1,
                    "attn_dp_rank": 0,
                    "pp_size": 1,
                    "pp_rank": 0,
                    "system_dp_size": 1,
                    "system_dp_rank": 0,
                    "rank_ip": "10.9.9.9",
                    "rank_port": 9,
                    "page_size": 16,
                    "kv_cache_dtype": "float16",
                }
            ).encode()
            dp_body = b'{"bootstrap_room": 7, "dp_rank": 0}'
            missing = "missing X-SGL-NIXL-Auth header"
            expect("rank address, unsigned", requests.get(url + RANK0, timeout=5), missing)
            expect(
                "register a prefill, unsigned",
                requests.put(url + "/route", data=body, timeout=5),
                missing,
            )
            expect(
                "register a DP rank, unsigned",
                requests.post(url + "/register_dp_rank", data=dp_body, timeout=5),
                missing,
            )
            wrong = b"not-the-secret"
            expect(
                "rank address, wrong secret",
                requests.get(url + RANK0, headers=sign(wrong, "GET", RANK0), timeout=5),
                "bad signature",
            )
            expect(
                "register a prefill, wrong secret",
                requests.put(
                    url + "/route", data=body, headers=sign(wrong, "PUT", "/route", body), timeout=5
                ),
                "bad signature",
            )
            expect(
                "rank address, an hour-old signature",
                requests.get(url + RANK0, headers=_signed_stale(secret, "GET", RANK0), timeout=5),
                "signature expired",
            )
            expect(
                "register a DP rank with a signature made for another request",
                requests.post(
                    url + "/register_dp_rank",
                    data=dp_body,
                    headers=sign(secret, "GET", RANK0),
                    timeout=5,
                ),
                "bad signature",
            )
            expect(
                "register a DP rank, signed body altered",
                requests.post(
                    url + "/register_dp_rank",
                    data=dp_body.replace(b"7", b"8"),
                    headers=sign(secret, "POST", "/register_dp_rank", dp_body),
                    timeout=5,
                ),
                "bad signature",
            )
            expect(
                "every rank's address, unsigned",
                requests.get(url + "/nixl/routes", timeout=5),
                missing,
            )
            expect(
                "rank address, garbled header",
                requests.get(url + RANK0, headers={HEADER: "yesterday:abc"}, timeout=5),
                "malformed signature timestamp",
            )
            # Signed with the secret, the same requests succeed.
            r = requests.get(url + RANK0, headers=sign(secret, "GET", RANK0), timeout=5)
            assert r.status_code == 200, r.text
            prefill_ep = (r.json()["rank_ip"], int(r.json()["rank_port"]))
            server = url.removeprefix("http://")
            table = bootstrap_client.get_routes(server, secret)
            assert table is not None and table.routes == {
                bootstrap_client.route_query(0, 0, 0, 0): r.json()
            }
            r = requests.post(
                url + "/register_dp_rank",
                data=dp_body,
                headers=sign(secret, "POST", "/register_dp_rank", dp_body),
                timeout=5,
            )
            assert r.status_code == 200, r.text

            # ZMQ: a registration without the secret is dropped, unanswered.
            fake = FakeDecode(w, secret=secret)
            fake.send_frames(prefill_ep, Codec(None).encode(fake.registration))
            fake.send_frames(prefill_ep, Codec(wrong).encode(Ping("x", *fake.endpoint, 1)))
            with mock.patch.object(codec_mod.time, "time", return_value=time.time() - 3600):
                stale = fake.codec.encode(Ping("x", *fake.endpoint, 2))
            fake.send_frames(prefill_ep, stale)
            fake.sync(prefill_ep, 3)  # a signed ping is answered: all the above was handled
            assert not [m for m in fake.drain() if isinstance(m, RegistrationReply)], fake.received
            reply = fake.register(prefill_ep)  # signed, the same registration is accepted
            assert reply.accepted, reply.reason

            res = live.wait()
    finally:
        live.kill()
        if fake is not None:
            fake.close()

    # The decode's requests failed: it could not learn the prefill rank's address.
    dec = res.decode_results()
    assert len(dec) == len(w.make_requests()) and not any(d["ok"] for d in dec.values()), dec
    assert all("Could not fetch" in (d["reason"] or "") for d in dec.values()), dec
    assert "refused the rank query (HTTP 401): missing X-SGL-NIXL-Auth header" in log.text
    # ... so the prefill's rooms never got a destination and timed out.
    pre = res.prefill[(0, 0)]["results"]
    assert pre and all(not r["ok"] and "timed out" in r["reason"] for r in pre.values()), pre

    counts = rejected_counts(multiproc_registry(prom))
    decode_attempts = len(dec) + 1  # one refused rank query per room, and the warm-up's
    # (the warm-up asks for every rank's route at once)
    assert counts["http_unauthenticated"] == len(refusals) + decode_attempts, (counts, refusals)
    assert counts["unauthenticated"] == 1 and counts["bad_mac"] == 1 and counts["stale"] == 1, (
        counts
    )
    assert log.text.count(f"401 for GET /route from 127.0.0.1: {missing}") >= 1 + len(dec)
    assert log.text.count(f"401 for GET /nixl/routes from 127.0.0.1: {missing}") == 2
    assert "refused the route table query (HTTP 401)" in log.text
    assert "401 for PUT /route from 127.0.0.1: bad signature: the shared secrets differ" in log.text
    assert "dropped control message from unknown peer: unauthenticated" in log.text
    assert "bad_mac" in log.text and "stale (sent 36" in log.text


# =========================================================================== doctor


def _exposure(report: dict[str, Any]) -> dict[str, Any]:
    rows = [c for c in report["checks"] if c["name"] == "network exposure"]
    assert len(rows) == 1, report["checks"]
    return rows[0]


DOCTOR_CASES = {
    # name: (environment overrides, expected status, words in detail/fix)
    "exposed_no_secret": (
        {"SGLANG_HOST_IP": None, "HOST_IP": "10.1.2.3"},
        "warn",
        [
            "10.1.2.3 (from HOST_IP)",
            "without a shared secret",
            "SGLANG_NIXL_PLUGIN_SECRET=<secret>",
            "SGLANG_NIXL_PLUGIN_SECRET_FILE=",
            "SGLANG_HOST_IP=127.0.0.1",
        ],
    ),
    "wildcard_with_secret": (  # the spelling SGLang asks for
        {"SGLANG_HOST_IP": "0.0.0.0", "SGLANG_NIXL_PLUGIN_SECRET": "s3cret"},
        "ok",
        ["0.0.0.0 (from SGLANG_HOST_IP)", "signed", "SGLANG_NIXL_PLUGIN_SECRET is set"],
    ),
    "auto_detected_secret_file": (
        {"SGLANG_HOST_IP": None, "HOST_IP": None, "SGLANG_NIXL_PLUGIN_SECRET_FILE": "@FILE@"},
        "ok",
        ["get_local_ip_auto", "SGLANG_NIXL_PLUGIN_SECRET_FILE is set"],
    ),
}


@pytest.mark.timeout(int(subproc.TIMEOUT_S) + 60)
def test_doctor_warns_on_exposed_sockets_without_a_secret(tmp_path: Any) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text("from-a-file\n")
    cli = subproc.console_script("sgl-nixl-plugin")
    procs = {}
    for name, (overrides, _, _) in DOCTOR_CASES.items():
        env = {**dict.fromkeys(SECRET_VARS), **overrides}
        env = {k: (str(secret_file) if v == "@FILE@" else v) for k, v in env.items()}
        procs[name] = subprocess.Popen(  # all at once: each imports SGLang and probes NIXL
            [cli, "doctor", "--json"],
            env=subproc.clean_env(env),
            cwd=str(subproc.REPO_ROOT),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    try:
        outputs = {name: p.communicate(timeout=subproc.TIMEOUT_S) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for name, (_, status, words) in DOCTOR_CASES.items():
        out, err = outputs[name]
        assert procs[name].returncode == 0, (name, err[-2000:])  # a warning never fails
        report = json.loads(out)
        row = _exposure(report)
        text = row["detail"] + " " + row["fix"]
        assert row["status"] == status, (name, row)
        assert all(w in text for w in words), (name, row)
        assert report["ok"] is True and report["verdict"].startswith("OK:"), (
            name,
            report["verdict"],
        )
        assert report["facts"]["listen_exposed"] is True
        assert report["facts"]["shared_secret"] is (status == "ok")
    auto = json.loads(outputs["auto_detected_secret_file"][0])["facts"]
    assert auto["listen_host"] and "get_local_ip_auto" in auto["listen_host_source"]


def test_exposure_check_in_process(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("SGLANG_HOST_IP", "HOST_IP", *SECRET_VARS):
        monkeypatch.delenv(name, raising=False)

    def run() -> tuple[doctor.CheckResult, dict[str, Any]]:
        ctx = doctor.DoctorContext()
        (row,) = doctor.check_exposure(ctx)
        return row, ctx.facts

    monkeypatch.setenv("SGLANG_HOST_IP", "127.0.0.1")
    row, facts = run()
    assert row.status == "ok" and "loopback 127.0.0.1 (from SGLANG_HOST_IP)" in row.detail
    assert facts["listen_exposed"] is False and facts["shared_secret"] is False
    monkeypatch.setenv("SGLANG_HOST_IP", "::1")
    assert run()[0].status == "ok"
    monkeypatch.setenv("SGLANG_HOST_IP", "localhost")
    assert run()[0].status == "ok"
    monkeypatch.setenv("SGLANG_HOST_IP", "::")
    row, facts = run()
    assert (
        row.status == "warn"
        and ":: (from SGLANG_HOST_IP)" in row.detail
        and facts["listen_exposed"]
    )
    # HOST_IP is SGLang's second choice, after SGLANG_HOST_IP
    monkeypatch.setenv("HOST_IP", "127.0.0.1")
    assert "from SGLANG_HOST_IP" in run()[0].detail
    monkeypatch.delenv("SGLANG_HOST_IP")
    assert run()[0].status == "ok"
    monkeypatch.delenv("HOST_IP")
    # An unreadable secret file is no secret, and the warning says why.
    monkeypatch.setenv("SGLANG_HOST_IP", "192.0.2.7")
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_SECRET_FILE", str(tmp_path / "missing"))
    row, facts = run()
    assert row.status == "warn" and "unreadable" in row.detail and not facts["shared_secret"]
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("SGLANG_NIXL_PLUGIN_SECRET_FILE", str(tmp_path / "empty"))
    assert run()[0].status == "warn"
    monkeypatch.delenv("SGLANG_NIXL_PLUGIN_SECRET_FILE")
    # The 0.4 spelling alone is no secret either: the warning says to rename it.
    monkeypatch.setenv("SGL_NIXL_PLUGIN_SECRET", "s3cret")
    row, facts = run()
    assert row.status == "warn" and "rename SGL_NIXL_PLUGIN_SECRET" in row.detail
    assert not facts["shared_secret"]
    monkeypatch.delenv("SGL_NIXL_PLUGIN_SECRET")
    monkeypatch.delenv("SGLANG_HOST_IP")
    # Without SGLang, the address comes from this machine's sockets.
    monkeypatch.setitem(sys.modules, "sglang.srt.utils.network", None)
    host, source = doctor_exposure.listen_host()
    assert source == "auto-detected from this machine's sockets"
    assert host is None or host == doctor_exposure._socket_local_ip()
    # The warning does not change the exit code.
    monkeypatch.setenv("SGLANG_HOST_IP", "203.0.113.5")
    assert doctor.main(as_json=True, checks=[doctor.check_exposure]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["checks"][0]["status"] == "warn"
    assert doctor.check_exposure in doctor.CHECKS
