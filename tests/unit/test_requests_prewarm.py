"""SGLang's first HTTP call paid at start-up (``transport.requests_prewarm``)."""

from __future__ import annotations

import threading

import pytest

from sgl_nixl_plugin.transport import requests_prewarm


def _prewarm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "sgl-nixl-http-prewarm"]


def test_the_call_is_answered_here_even_with_a_proxy_configured(monkeypatch):
    # A proxy that answers nothing: had the call gone through it, it would have failed.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    ms = requests_prewarm.pay_first_call()
    assert ms is not None and ms > 0
    assert _prewarm_threads() == []  # the one-shot listener answered and is gone


def test_a_failure_is_reported_not_raised(monkeypatch):
    def no_socket(*args: object, **kwargs: object) -> None:
        raise OSError("no sockets here")

    monkeypatch.setattr(requests_prewarm.socket, "create_server", no_socket)
    assert requests_prewarm.pay_first_call() is None


def test_a_listener_nobody_calls_gives_up_within_its_bound(monkeypatch):
    monkeypatch.setattr(requests_prewarm, "TIMEOUT_S", 0.2)

    def refuse(*args: object, **kwargs: object) -> None:
        raise ConnectionError("refused before sending")

    import requests

    monkeypatch.setattr(requests, "get", refuse)
    assert requests_prewarm.pay_first_call() is None
    for t in _prewarm_threads():
        t.join(5)
    assert _prewarm_threads() == []


@pytest.mark.parametrize("warmup", [True, False])
def test_a_decode_pays_it_at_start_only_with_the_warm_up_on(monkeypatch, warmup):
    from types import SimpleNamespace

    from sgl_nixl_plugin.sides import decode_side

    calls: list[int] = []
    monkeypatch.setattr(requests_prewarm, "pay_first_call", lambda: calls.append(1) or 1.0)
    side = SimpleNamespace(
        ctx=SimpleNamespace(staging=None, settings=SimpleNamespace(warmup=warmup)),
        listener=SimpleNamespace(start=lambda: None),
    )
    decode_side.DecodeSide.start(side)  # type: ignore[arg-type]
    assert calls == ([1] if warmup else [])
