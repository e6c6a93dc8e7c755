"""The ``sglang.srt.plugins`` bridge against real SGLang 0.5.23 (in subprocesses), plus unit
tests of the ``get_kv_class`` hook's calling convention."""

from __future__ import annotations

import enum
import json

import pytest
from helpers import subproc
from helpers.scenarios import ScenarioResult, ScenarioRunner
from helpers.subproc import SCENARIO_TEST_TIMEOUT_S

from sgl_nixl_plugin.adapter.hooks import extend_transfer_backend, make_get_kv_class_hook
from sgl_nixl_plugin.registry.builtin import NIXL_BACKEND
from sgl_nixl_plugin.registry.spec import CLASS_KINDS, BackendSpec

KVARGS = "sglang.srt.disaggregation.base.conn.KVArgs"
IN_TREE_NIXL_PREFIX = "sglang.srt.disaggregation.nixl."
GET_KV_CLASS = "sglang.srt.disaggregation.utils.get_kv_class"
TRANSFER_BACKEND = "sglang.srt.disaggregation.utils.TransferBackend"
OTHER_BUILTINS = ("mooncake", "fake", "ascend", "mori")


def _ok(result: ScenarioResult) -> dict:
    assert result.returncode == 0 and result.data is not None, result.explain()
    return result.data


def _assert_ours(row: dict, spec: BackendSpec) -> None:
    for kind in CLASS_KINDS:
        assert isinstance(row[kind], str), row
        assert row[kind].rsplit(".", 1)[-1] == spec.class_name(kind), row
    assert row["kvargs"] == KVARGS


def _assert_in_tree_nixl(row: dict) -> None:
    for kind in CLASS_KINDS:
        assert isinstance(row[kind], str) and row[kind].startswith(IN_TREE_NIXL_PREFIX), row
    assert row["kvargs"] == KVARGS


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("plugin", "baseline")
def test_plugin_routes_nixl_and_leaves_other_backends_alone(scenarios: ScenarioRunner) -> None:
    plugin = _ok(scenarios.result("plugin"))
    baseline = _ok(scenarios.result("baseline"))

    assert plugin["plugin_state"] == "registered"
    assert plugin["register_idempotent"] is True
    _assert_ours(plugin["kv"]["nixl"], NIXL_BACKEND)
    for kind in CLASS_KINDS:
        assert plugin["kv"]["nixl"][kind].startswith("sgl_nixl_plugin."), plugin["kv"]["nixl"]

    # "nixl" is a built-in name: no enum replacement, no CLI change, exactly one AROUND hook.
    assert plugin["transfer_backend_values"] == baseline["transfer_backend_values"]
    assert plugin["hooks"].get(GET_KV_CLASS) == ["around"]
    assert TRANSFER_BACKEND not in plugin["hooks"]

    # Every other backend answers exactly as without the plugin (classes or exception types).
    assert set(OTHER_BUILTINS) <= set(baseline["kv"])
    for value, row in baseline["kv"].items():
        if value != "nixl":
            assert plugin["kv"][value] == row, value


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("baseline")
def test_sglang_plugins_whitelist_keeps_in_tree_nixl(scenarios: ScenarioRunner) -> None:
    baseline = _ok(scenarios.result("baseline"))
    assert baseline["plugin_state"] is None  # SGLang never called register()
    assert GET_KV_CLASS not in baseline["hooks"]
    _assert_in_tree_nixl(baseline["kv"]["nixl"])
    assert baseline["parse"]["nixl_test"] == "rejected"


@pytest.mark.timeout(SCENARIO_TEST_TIMEOUT_S)
@pytest.mark.scenarios("thirdparty", "baseline")
def test_third_party_backend_gets_cli_choice_enum_member_and_classes(
    scenarios: ScenarioRunner,
) -> None:
    data = _ok(scenarios.result("thirdparty"))
    baseline = _ok(scenarios.result("baseline"))

    assert data["parse"] == {"nixl_test": "accepted:nixl_test", "nixl": "accepted:nixl"}
    assert data["transfer_backend_values"] == sorted(
        baseline["transfer_backend_values"] + ["nixl_test"]
    )
    assert data["hooks"].get(TRANSFER_BACKEND) == ["replace"]
    assert data["hooks"].get(GET_KV_CLASS) == ["around"]

    row = data["kv"]["nixl_test"]
    assert row == {
        "kvargs": KVARGS,
        "manager": "nixl_test_backend.classes.TestManager",
        "sender": "nixl_test_backend.classes.TestSender",
        "receiver": "nixl_test_backend.classes.TestReceiver",
        "bootstrap_server": "nixl_test_backend.classes.TestBootstrapServer",
    }
    _assert_ours(data["kv"]["nixl"], NIXL_BACKEND)
    # The replaced enum's members still reach SGLang's own branches.
    for value in OTHER_BUILTINS:
        assert data["kv"][value] == baseline["kv"][value], value


@pytest.mark.timeout(int(subproc.TIMEOUT_S) + 30)
def test_importing_the_entry_point_is_cheap() -> None:
    code = (
        "import json, sys\n"
        "import sgl_nixl_plugin.bridge.entry, sgl_nixl_plugin.cli.main\n"
        "import sgl_nixl_plugin.adapter.release_gate\n"
        "heavy = ('torch', 'nixl', 'nixl._api', 'sglang', 'numpy')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    proc = subproc.run(subproc.python_argv("-c", code))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


# ------------------------------------------------------------------ hook unit tests


class _Backend(enum.Enum):
    NIXL = "nixl"
    FAKE = "fake"


class _Kind(enum.Enum):
    KVARGS = "kvargs"
    MANAGER = "manager"
    SENDER = "sender"
    RECEIVER = "receiver"
    BOOTSTRAP_SERVER = "bootstrap_server"
    FUTURE = "future_kind"


class _KVArgs:
    pass


_SPEC = BackendSpec(
    name="nixl",
    classes_module=__name__,
    manager="_KVArgs",
    sender="_KVArgs",
    receiver="_KVArgs",
    bootstrap_server="_KVArgs",
)


def _original(transfer_backend: enum.Enum, class_type: enum.Enum) -> tuple[type, str]:
    return (type(transfer_backend), transfer_backend.name)


def test_hook_accepts_sglang_around_convention_positional_and_keyword() -> None:
    hook = make_get_kv_class_hook({"nixl": _SPEC}, kvargs_class=int)
    # HookRegistry calls AROUND hooks as hook(original_fn, *args, **kwargs).
    assert hook(_original, _Backend.NIXL, _Kind.MANAGER) is _KVArgs
    assert hook(_original, transfer_backend=_Backend.NIXL, class_type=_Kind.SENDER) is _KVArgs
    assert hook(_original, _Backend.NIXL, class_type=_Kind.KVARGS) is int
    assert hook(_original, _Backend.NIXL, _Kind.FUTURE) is None
    assert hook(_original, _Backend.FAKE, _Kind.MANAGER) == (_Backend, "FAKE")
    assert hook(_original, transfer_backend=_Backend.FAKE, class_type=_Kind.MANAGER) == (
        _Backend,
        "FAKE",
    )


def test_hook_hands_sglang_the_current_enum_member_after_a_replacement() -> None:
    extended = extend_transfer_backend(_Backend, ("nixl_test",))
    assert [m.value for m in extended] == ["nixl", "fake", "nixl_test"]
    assert extended.__module__ == _Backend.__module__
    assert extended("nixl_test").name == "NIXL_TEST"

    hook = make_get_kv_class_hook({}, kvargs_class=int, transfer_backend_enum=lambda: extended)
    # A member of the old enum (captured before the swap) is translated to the new one.
    assert hook(_original, _Backend.FAKE, _Kind.MANAGER) == (extended, "FAKE")
    assert hook(_original, transfer_backend=_Backend.FAKE, class_type=_Kind.MANAGER) == (
        extended,
        "FAKE",
    )
    assert hook(_original, extended.FAKE, _Kind.MANAGER) == (extended, "FAKE")
