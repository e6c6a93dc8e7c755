"""``compat_hash`` and ``describe_mismatch``: what prefill and decode must agree on."""

from __future__ import annotations

import re

import msgspec
import pytest

from sgl_nixl_plugin.wire import compat_hash, describe_mismatch
from sgl_nixl_plugin.wire.compat import MAY_DIFFER
from sgl_nixl_plugin.wire.messages import MAX_NAME, PROTOCOL_VERSION, Compat

pytestmark = pytest.mark.timeout(60)

BASE = Compat(
    protocol_version=PROTOCOL_VERSION,
    kv_dtype="bfloat16",
    page_size=64,
    num_layers=32,
    is_mla=False,
)

# For every field, a value other than BASE's.
OTHER = {
    "protocol_version": PROTOCOL_VERSION + 1,
    "kv_dtype": "fp8_e4m3",
    "page_size": 16,
    "num_layers": 61,
    "is_mla": True,
}

FIELDS = list(Compat.__struct_fields__)
#: The fields both sides must agree on (the prefill pairs tokens across page sizes, and
#: checks layer counts against the pipeline stages).
AGREED = [f for f in FIELDS if f not in MAY_DIFFER]


@pytest.mark.parametrize("field", ["page_size", "num_layers"])
def test_only_the_page_size_and_layer_count_may_differ(field):
    assert MAY_DIFFER == {"page_size", "num_layers"}
    assert compat_hash(_changed(field)) == compat_hash(BASE)
    assert describe_mismatch(BASE, _changed(field)) == ""


def test_every_field_has_another_value():
    assert set(OTHER) == set(FIELDS)
    assert all(getattr(BASE, f) != v for f, v in OTHER.items())


def _changed(field: str, value=None) -> Compat:
    return msgspec.structs.replace(BASE, **{field: OTHER[field] if value is None else value})


def test_hash_equal_for_equal_compat():
    same = Compat(**{f: getattr(BASE, f) for f in FIELDS})
    assert same is not BASE
    assert compat_hash(same) == compat_hash(BASE)
    assert compat_hash(BASE) == compat_hash(BASE)


def test_hash_is_a_short_stable_hex_name():
    h = compat_hash(BASE)
    assert re.fullmatch(r"[0-9a-f]{32}", h)
    assert len(h) <= MAX_NAME  # it travels as a Name in PeerRegistration.compat_hash


def test_hash_survives_the_wire():
    # The peer hashes the Compat it decoded: that must give the sender's hash.
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(BASE), type=Compat)
    assert compat_hash(decoded) == compat_hash(BASE)
    decoded = msgspec.json.decode(msgspec.json.encode(BASE), type=Compat)
    assert compat_hash(decoded) == compat_hash(BASE)


@pytest.mark.parametrize("field", AGREED)
def test_hash_differs_when_one_field_differs(field):
    assert compat_hash(_changed(field)) != compat_hash(BASE)


def test_hashes_of_single_field_changes_are_all_distinct():
    hashes = {compat_hash(BASE)} | {compat_hash(_changed(f)) for f in AGREED}
    assert len(hashes) == len(AGREED) + 1


def test_hash_distinguishes_nearby_values():
    # values that differ only slightly (an extra digit, case, a trailing space)
    assert compat_hash(_changed("protocol_version", PROTOCOL_VERSION + 10)) != compat_hash(BASE)
    assert compat_hash(_changed("kv_dtype", "bfloat16 ")) != compat_hash(BASE)
    assert compat_hash(_changed("kv_dtype", "BFLOAT16")) != compat_hash(BASE)


def test_describe_mismatch_empty_when_equal():
    assert describe_mismatch(BASE, BASE) == ""
    assert describe_mismatch(BASE, Compat(**{f: getattr(BASE, f) for f in FIELDS})) == ""
    assert describe_mismatch(BASE, BASE, local_role="decode") == ""


@pytest.mark.parametrize("field", AGREED)
def test_describe_mismatch_names_the_field_and_both_values(field):
    remote = _changed(field)
    text = describe_mismatch(BASE, remote)
    assert text
    assert f"{field}: prefill={getattr(BASE, field)!r} decode={getattr(remote, field)!r}" in text
    for other in FIELDS:
        if other != field:
            assert f"{other}:" not in text  # only the differing field is named


@pytest.mark.parametrize("field", AGREED)
def test_describe_mismatch_roles_follow_the_local_side(field):
    remote = _changed(field)
    text = describe_mismatch(BASE, remote, local_role="decode")
    assert f"{field}: decode={getattr(BASE, field)!r} prefill={getattr(remote, field)!r}" in text


def test_describe_mismatch_names_every_differing_field():
    remote = Compat(**OTHER)
    text = describe_mismatch(BASE, remote)
    for field in AGREED:
        assert f"{field}: prefill={getattr(BASE, field)!r} decode={OTHER[field]!r}" in text
    assert "page_size" not in text
    # in declaration order, so the text is the same every time
    positions = [text.index(f"{field}: ") for field in AGREED]
    assert positions == sorted(positions)


def test_describe_mismatch_says_what_to_do():
    text = describe_mismatch(BASE, _changed("kv_dtype"))
    assert "same model" in text and "--kv-cache-dtype" in text


def test_hash_and_mismatch_agree():
    for field in FIELDS:
        remote = _changed(field)
        assert (compat_hash(remote) == compat_hash(BASE)) == (describe_mismatch(BASE, remote) == "")
