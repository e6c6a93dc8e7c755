"""The bench's ``KVArgs`` are the ones SGLang 0.5.23 would build, field by field.

Release 0.4.0 passed every test and failed every request in a real server: the bench and
the multi-process tests built ``KVArgs`` by hand (``Pools.kv_args``) with fields SGLang does
not set (e.g. ``kv_head_num`` on a decode). Here SGLang's own
``PrefillBootstrapQueue._init_kv_manager`` and ``DecodePreallocQueue._init_kv_manager`` run on
real CPU pools of the bench's geometry, with a manager class that records the ``KVArgs`` as
the constructor sees them (tests/helpers/sglang_kvargs.py, in subprocesses); every field of
``Pools.kv_args`` for the same rank must match: names and values.

Values that cannot be equal are compared by what must hold instead (see ``compare``):
raw pointers (two allocations) by count and by relations (non-zero, distinct, regions that
do not overlap); and, for hybrid pools only, the state component, whose tensors differ by
design: the bench's state is one replicated per-request tensor, SGLang's ``MambaPool`` has a
conv and a temporal tensor per Mamba layer, sliced across TP.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from helpers.sglang_kvargs import CASES, RESULT_MARKER, Case, _shape, case_groups
from helpers.subproc import TIMEOUT_S, clean_env, python_argv, run

HELPER = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "sglang_kvargs.py")
ROLES = ("prefill", "decode")
GROUPS = [(role, group) for role in ROLES for group in case_groups(role)]

pytestmark = pytest.mark.timeout(int(2 * TIMEOUT_S) + 60)

#: pointer lists, with the list of their regions' lengths
POINTER_FIELDS = {"kv_data_ptrs": "kv_data_lens", "aux_data_ptrs": "aux_data_lens"}
#: per-tensor lists of a state component (one inner list per entry of ``state_types``)
STATE_FIELDS = (
    "state_data_ptrs",
    "state_data_lens",
    "state_item_lens",
    "state_dim_per_tensor",
    "state_slice_outer_counts",
    "state_conv_shard_groups",
    "state_layer_ids",
)
CASE = {c.name: c for c in CASES}


@pytest.fixture(scope="module")
def captured() -> dict[tuple[str, str], dict[str, Any]]:
    # One process imports SGLang once and forks a child per group (a TP layout each)
    # No SGLANG_* variable of the caller's shell may change the pools or the method
    env = clean_env({k: None for k in os.environ if k.startswith("SGLANG_")})
    proc = run(python_argv(HELPER, "all"), env=env, timeout=TIMEOUT_S * 2)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(
            f"sglang_kvargs.py all failed (rc {proc.returncode}):\n"
            f"{proc.stderr[-4000:]}\n{proc.stdout[-2000:]}"
        )
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for result in json.loads(lines[-1][len(RESULT_MARKER) :]):
        for rec in result["cases"]:
            out[(result["role"], rec["case"])] = rec
    assert {key for key in out} == {(role, n) for role, g in GROUPS for n in g}
    return out


# -- the comparison ------------------------------------------------------------------------


def _pointer_relations(side: str, field: str, ptrs: Any, lens: Any) -> list[str]:
    """What any side's pointer list must satisfy: non-zero ints, distinct, and with their
    lengths, regions that do not overlap."""
    problems = []
    if not all(isinstance(p, int) and p > 0 for p in ptrs):
        problems.append(f"{field} ({side}): not all non-zero integers: {ptrs!r}")
        return problems
    if len(set(ptrs)) != len(ptrs):
        problems.append(f"{field} ({side}): repeated pointers: {ptrs!r}")
    if not isinstance(lens, list) or len(lens) != len(ptrs):
        problems.append(f"{field} ({side}): {len(ptrs)} pointers but lengths {lens!r}")
        return problems
    spans = sorted(zip(ptrs, lens, strict=True))
    for (p0, n0), (p1, _) in zip(spans, spans[1:], strict=False):
        if p0 + n0 > p1:
            problems.append(f"{field} ({side}): region {p0:#x}+{n0} overlaps {p1:#x}")
    return problems


def _state_consistency(side: str, fields: dict[str, Any]) -> list[str]:
    """Each state component's per-tensor lists line up (one entry per tensor)."""
    problems = []
    n = len(fields["state_types"])
    for f in STATE_FIELDS:
        if len(fields[f]) != n:
            problems.append(f"{f} ({side}): {len(fields[f])} components, state_types has {n}")
    if problems:
        return problems
    for i in range(n):
        sizes = {f: len(fields[f][i]) for f in STATE_FIELDS}
        if len(set(sizes.values())) != 1:
            problems.append(f"state component {i} ({side}): per-tensor lists differ: {sizes}")
        problems += _pointer_relations(
            side,
            f"state_data_ptrs[{i}]",
            fields["state_data_ptrs"][i],
            fields["state_data_lens"][i],
        )
    return problems


def compare(bench: dict[str, Any], sglang: dict[str, Any], *, hybrid: bool) -> list[str]:
    """Every difference between the bench's fields and SGLang's, one line each."""
    problems = [
        f"missing: {k} (SGLang sets it to {sglang[k]!r})" for k in sorted(set(sglang) - set(bench))
    ]
    problems += [
        f"extra: {k}={bench[k]!r} (SGLang does not set it before constructing the manager)"
        for k in sorted(set(bench) - set(sglang))
    ]
    for k in sorted(set(bench) & set(sglang)):
        b, s = bench[k], sglang[k]
        if k in POINTER_FIELDS:
            # Different allocations: equal counts, and each side's own relations hold
            if len(b) != len(s):
                problems.append(f"{k}: bench has {len(b)} pointers, sglang {len(s)}")
            lens = POINTER_FIELDS[k]
            problems += _pointer_relations("bench", k, b, bench.get(lens))
            problems += _pointer_relations("sglang", k, s, sglang.get(lens))
        elif hybrid and k in STATE_FIELDS:
            # Different state tensors by design (module docstring): the same components,
            # the same state layers; the per-tensor lists are checked per side below
            if len(b) != len(s):
                problems.append(f"{k}: bench has {len(b)} state components, sglang {len(s)}")
            elif k == "state_layer_ids" and [set(x) for x in b] != [set(x) for x in s]:
                problems.append(f"{k}: state layers bench={b!r} sglang={s!r}")
        elif b != s:
            problems.append(f"{k}: bench={b!r} sglang={s!r}")
    if hybrid and not problems:
        problems += _state_consistency("bench", bench) + _state_consistency("sglang", sglang)
    return problems


# -- the contract ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "role,case", [(r, n) for r, names in GROUPS for n in names], ids=lambda v: str(v)
)
def test_bench_kvargs_are_sglangs(
    captured: dict[tuple[str, str], dict[str, Any]], role: str, case: str
) -> None:
    rec = captured[(role, case)]
    problems = compare(rec["bench"], rec["sglang"], hybrid=CASE[case].state)
    assert not problems, (
        f"{role} {case} ({rec['pool']}): Pools.kv_args differs from SGLang's "
        f"_init_kv_manager at manager construction:\n  " + "\n  ".join(problems)
    )


def test_comparison_reports_every_kind_of_difference(
    captured: dict[tuple[str, str], dict[str, Any]],
) -> None:
    """The comparison itself: a missing, an extra and a changed field are all reported."""
    rec = captured[("prefill", "mha-p16")]
    assert compare(rec["bench"], rec["sglang"], hybrid=False) == []
    bench = dict(rec["bench"])
    del bench["page_size"]
    bench["kv_buf_groups"] = 1
    bench["kv_item_lens"] = [n + 1 for n in bench["kv_item_lens"]]
    bench["aux_data_ptrs"] = bench["aux_data_ptrs"][:1] * len(bench["aux_data_ptrs"])
    problems = "\n".join(compare(bench, rec["sglang"], hybrid=False))
    for needle in (
        "missing: page_size",
        "extra: kv_buf_groups",
        "kv_item_lens: bench=",
        "aux_data_ptrs (bench): repeated",
    ):
        assert needle in problems, problems


# -- what SGLang does, spelled out (the facts 0.4.0 got wrong) --------------------------------


def _plain_cases(role: str) -> list[Case]:
    return [c for c in CASES if role in c.roles and not c.state and not c.staging]


def test_decode_kvargs_have_no_head_counts_and_label_kv_vram(
    captured: dict[tuple[str, str], dict[str, Any]],
) -> None:
    for c in [c for c in CASES if "decode" in c.roles]:
        fields = captured[("decode", c.name)]["sglang"]
        absent = {
            "kv_head_num",
            "total_kv_head_num",
            "rust_http_port",
            "prefill_start_layer",
            "prefill_end_layer",
        } & set(fields)
        assert not absent, f"{c.name}: decode KVArgs has {sorted(absent)} at construction"
        # NIXL backend: VRAM for every KV buffer, even for this CPU pool
        assert fields["kv_data_mem_kinds"] == ["VRAM"] * len(fields["kv_data_ptrs"]), c.name


def test_decode_sets_head_counts_only_after_construction_and_only_with_staging(
    captured: dict[tuple[str, str], dict[str, Any]],
) -> None:
    rec = captured[("decode", "mha-p16-staging")]
    assert "kv_head_num" not in rec["sglang"]
    assert rec["after"]["kv_head_num"] == rec["heads_per_rank"]
    assert rec["after"]["total_kv_head_num"] == _shape("tiny").kv_heads
    for c in _plain_cases("decode"):  # without staging: never, not even afterwards
        assert "kv_head_num" not in captured[("decode", c.name)]["after"], c.name


def test_prefill_head_counts_only_for_pools_sglang_does_not_call_mla(
    captured: dict[tuple[str, str], dict[str, Any]],
) -> None:
    for c in [c for c in CASES if "prefill" in c.roles]:
        rec = captured[("prefill", c.name)]
        fields, shape = rec["sglang"], _shape(c.shape)
        assert "kv_data_mem_kinds" not in fields, c.name  # prefill never labels its KV
        if shape.mla and not c.state:
            assert "kv_head_num" not in fields and "total_kv_head_num" not in fields, c.name
        else:  # MHA, and hybrid pools (is_mla_backend() is False for them, even over MLA)
            assert fields["kv_head_num"] == rec["heads_per_rank"], c.name
            assert fields["total_kv_head_num"] == shape.kv_heads, c.name


def test_manager_gets_the_role_and_sglangs_mla_flag(
    captured: dict[tuple[str, str], dict[str, Any]],
) -> None:
    for (role, name), rec in captured.items():
        c, shape = CASE[name], _shape(CASE[name].shape)
        assert rec["manager"]["mode"] == role
        assert rec["manager"]["kwargs"] == []
        # SGLang's queue asks is_mla_backend(pool): a hybrid pool over MLA layers says False
        assert rec["manager"]["is_mla_backend"] == (shape.mla and not c.state), name
        assert rec["kvargs_class"] == "sglang.srt.disaggregation.base.conn.KVArgs"


def test_layer_ids_and_end_layer_depend_on_the_pool_kind(
    captured: dict[tuple[str, str], dict[str, Any]],
) -> None:
    for (role, name), rec in captured.items():
        c, fields = CASE[name], rec["sglang"]
        layers = _shape(c.shape).layers
        if c.state:  # hybrid: the attention layers' ids (K then V for MHA), no end layer
            per = 1 if _shape(c.shape).mla else 2
            assert fields["kv_layer_ids"] == list(range(layers)) * per, name
        else:  # plain pools report none
            assert fields["kv_layer_ids"] == [], name
        if role == "prefill":
            # a stage's first layer, and its end (exclusive) as SGLang's pool configurator
            # gives it to the pool: tiny's 4 layers are 1 + 1 + 2 at PP 3, 2 + 2 at PP 2
            first, end = {1: (0, layers), 2: (2, 4), 3: (2, 4)}[c.pp_size]
            assert fields["prefill_start_layer"] == first, name
            assert fields["prefill_end_layer"] == (None if c.state else end), name
            ptrs = len(fields["kv_data_ptrs"])
            assert ptrs == (end - first) * (1 if _shape(c.shape).mla else 2), name
