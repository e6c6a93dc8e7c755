"""The pluggy registry: entry-point loading, conflict rules, and fault isolation (in-process,
no SGLang needed)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import pytest
from helpers import thirdparty

from sgl_nixl_plugin.registry import (
    AgentConfig,
    BackendSpec,
    ReceiveEvent,
    TransferEvent,
    hookimpl,
    manager,
)
from sgl_nixl_plugin.registry.builtin import NIXL_BACKEND
from sgl_nixl_plugin.registry.hookspecs import PROJECT_NAME

pytestmark = pytest.mark.usefixtures("fresh_registry")

EVENT = TransferEvent(
    room=7,
    peer="10.0.0.2:1234",
    ok=True,
    bytes=4096,
    duration_s=0.001,
    descriptors=2,
    path="direct",
)


def _errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r for r in caplog.records if r.levelno >= logging.ERROR and r.name.startswith(PROJECT_NAME)
    ]


def _spec(name: str, module: str = "collections") -> BackendSpec:
    return BackendSpec(
        name=name,
        classes_module=module,
        manager="OrderedDict",
        sender="Counter",
        receiver="deque",
        bootstrap_server="ChainMap",
    )


def _install(monkeypatch: pytest.MonkeyPatch, root: Path, modules: list[str]) -> None:
    monkeypatch.syspath_prepend(str(root))
    for name in modules:  # leave no imported test package behind for other tests
        monkeypatch.delitem(sys.modules, name, raising=False)


# ------------------------------------------------------------------ data types


def test_builtin_nixl_backend_is_registered() -> None:
    backends = manager.backends()
    assert backends["nixl"] == NIXL_BACKEND
    assert NIXL_BACKEND.classes_module == "sgl_nixl_plugin.adapter.classes"
    assert NIXL_BACKEND.manager == "NixlPluginKVManager"
    assert NIXL_BACKEND.bootstrap_server == "NixlPluginKVBootstrapServer"


def test_backend_spec_validates_and_loads_lazily() -> None:
    spec = _spec("mine")
    assert spec.load("manager").__name__ == "OrderedDict"
    assert spec.load("bootstrap_server").__name__ == "ChainMap"
    with pytest.raises(ValueError, match="unknown class kind"):
        spec.load("kvargs")
    with pytest.raises(ValueError, match="lower-case identifier"):
        _spec("Bad-Name")
    with pytest.raises(ImportError, match="backend 'gone'.*no_such_module_xyz"):
        _spec("gone", "no_such_module_xyz").load("sender")
    with pytest.raises(ImportError, match="has no 'Missing'"):
        dataclasses.replace(_spec("odd"), receiver="Missing").load("receiver")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "other"  # type: ignore[misc]


def test_agent_config_and_event_shapes() -> None:
    config = AgentConfig()
    assert (config.backend, config.backend_params, config.num_threads) == ("UCX", {}, 0)
    assert config.capture_telemetry is True
    assert AgentConfig().backend_params is not config.backend_params
    with pytest.raises(dataclasses.FrozenInstanceError):
        EVENT.ok = False  # type: ignore[misc]
    assert EVENT.reason is None


# ------------------------------------------------------------------ entry points


def test_broken_third_party_plugin_is_skipped_with_one_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    thirdparty.write_dist(
        tmp_path,
        "broken-backend",
        {"broken": "broken_backend_pkg"},
        {"broken_backend_pkg/__init__.py": "raise RuntimeError('boom at import')\n"},
    )
    thirdparty.write_dist(
        tmp_path,
        "good-backend",
        {"good": "good_backend_pkg"},
        {
            "good_backend_pkg/__init__.py": """
                from sgl_nixl_plugin.registry import BackendSpec, hookimpl

                @hookimpl
                def sgl_nixl_register_backends():
                    return [BackendSpec("good_one", "collections", "OrderedDict", "Counter",
                                        "deque", "ChainMap")]
            """,
        },
    )
    _install(monkeypatch, tmp_path, ["broken_backend_pkg", "good_backend_pkg"])
    with caplog.at_level(logging.INFO):
        backends = manager.backends()
    assert set(backends) == {"nixl", "good_one"}
    errors = _errors(caplog)
    assert len(errors) == 1
    assert "broken" in errors[0].getMessage() and "boom at import" in errors[0].getMessage()


def test_third_party_cannot_take_over_our_backend_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Hijacker:
        @hookimpl
        def sgl_nixl_register_backends(self) -> list[BackendSpec]:
            return [_spec("nixl"), _spec("extra")]

    manager.get_plugin_manager().register(Hijacker(), name="hijacker")
    backends = manager.backends()
    assert backends["nixl"] == NIXL_BACKEND
    assert backends["extra"] == _spec("extra")
    (error,) = _errors(caplog)
    assert "'nixl'" in error.getMessage() and "hijacker" in error.getMessage()


def test_failing_or_bad_backend_hooks_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    class Raises:
        @hookimpl
        def sgl_nixl_register_backends(self) -> list[BackendSpec]:
            raise RuntimeError("cannot")

    class Garbage:
        @hookimpl
        def sgl_nixl_register_backends(self) -> list[object]:
            return ["not a spec", _spec("fine")]

    pm = manager.get_plugin_manager()
    pm.register(Raises(), name="raises")
    pm.register(Garbage(), name="garbage")
    assert set(manager.backends()) == {"nixl", "fine"}
    messages = [r.getMessage() for r in _errors(caplog)]
    assert len(messages) == 2
    assert any("raises" in m and "cannot" in m for m in messages)
    assert any("garbage" in m and "not a BackendSpec" in m for m in messages)


@pytest.mark.parametrize("a_first", [True, False])
def test_backend_conflict_between_third_parties_is_deterministic(
    caplog: pytest.LogCaptureFixture, a_first: bool
) -> None:
    class A:
        @hookimpl
        def sgl_nixl_register_backends(self) -> list[BackendSpec]:
            return [_spec("shared", "collections")]

    class B:
        @hookimpl
        def sgl_nixl_register_backends(self) -> list[BackendSpec]:
            return [_spec("shared", "functools")]

    pm = manager.get_plugin_manager()
    for plugin, name in [(A(), "a_plugin"), (B(), "b_plugin")][:: 1 if a_first else -1]:
        pm.register(plugin, name=name)
    assert manager.backends()["shared"].classes_module == "collections"  # a_plugin < b_plugin
    assert len(_errors(caplog)) == 1


# ------------------------------------------------------------------ agent config / observers


def test_agent_config_hooks_edit_in_place_and_failures_are_isolated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Deployer:
        @hookimpl
        def sgl_nixl_agent_config(self, config: AgentConfig) -> None:
            config.backend = "LIBFABRIC"
            config.backend_params["fi_provider"] = "efa"
            config.num_threads = 4

    class Broken:
        @hookimpl(tryfirst=True)
        def sgl_nixl_agent_config(self, config: AgentConfig) -> None:
            raise ValueError("bad deployer hook")

    pm = manager.get_plugin_manager()
    pm.register(Deployer(), name="deployer")
    pm.register(Broken(), name="broken_cfg")
    config = manager.apply_agent_config(AgentConfig())
    assert (config.backend, config.backend_params, config.num_threads) == (
        "LIBFABRIC",
        {"fi_provider": "efa"},
        4,
    )
    (error,) = _errors(caplog)
    assert "broken_cfg" in error.getMessage()


def test_default_agent_config_reads_sglang_nixl_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(manager.BACKEND_ENV, "LIBFABRIC")
    monkeypatch.setenv(manager.BACKEND_PARAMS_ENV, '{"num_workers": 2, "x": "y"}')
    config = manager.resolve_agent_config()
    assert config.backend == "LIBFABRIC"
    assert config.backend_params == {"num_workers": "2", "x": "y"}
    monkeypatch.setenv(manager.BACKEND_PARAMS_ENV, "{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        manager.default_agent_config()
    monkeypatch.setenv(manager.BACKEND_PARAMS_ENV, "[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        manager.default_agent_config()


def test_observer_exceptions_never_propagate(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[TransferEvent] = []

    class Faulty:
        @hookimpl(tryfirst=True)
        def sgl_nixl_transfer_done(self, event: TransferEvent) -> None:
            raise RuntimeError("observer bug")

    class Recorder:
        @hookimpl
        def sgl_nixl_transfer_done(self, event: TransferEvent) -> None:
            seen.append(event)

    pm = manager.get_plugin_manager()
    pm.register(Faulty(), name="faulty")
    pm.register(Recorder(), name="recorder")
    with caplog.at_level(logging.DEBUG, logger=PROJECT_NAME):
        manager.notify_transfer(EVENT)
        manager.notify_transfer(EVENT)
    assert seen == [EVENT, EVENT]  # the faulty observer ran first and did not stop the rest
    (error,) = _errors(caplog)  # the first failure loudly, the second at DEBUG
    assert "faulty" in error.getMessage() and "observer bug" in error.getMessage()
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "faulty" in r.getMessage()]
    assert len(debug) == 1


def test_notify_without_observers_is_a_no_op() -> None:
    manager.notify_transfer(EVENT)


def test_decode_observers_get_the_receive_event_alone() -> None:
    """``sgl_nixl_receive_done`` is its own hook: a prefill observer never sees decode rooms."""
    got: list[object] = []

    class Both:
        @hookimpl
        def sgl_nixl_transfer_done(self, event: TransferEvent) -> None:
            got.append(("transfer", event))

        @hookimpl
        def sgl_nixl_receive_done(self, event: ReceiveEvent) -> None:
            got.append(("receive", event))

    manager.get_plugin_manager().register(Both(), name="both")
    received = ReceiveEvent(room=7, ok=True, staged=False, senders=1, timeline={"ended_at": 1.0})
    manager.notify_receive(received)
    manager.notify_transfer(EVENT)
    assert got == [("receive", received), ("transfer", EVENT)]
