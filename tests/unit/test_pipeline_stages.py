"""Which decode KV regions a prefill pipeline stage writes (``sides.pipeline_stages``)."""

from __future__ import annotations

import pytest

from sgl_nixl_plugin.sides.pipeline_stages import DecodeStage, PrefillStage, decode_kv_window


def _stage(first: int, layers: int, *, mla: bool = False, **kw: int | bool) -> PrefillStage:
    return PrefillStage(
        pp_rank=int(kw.pop("pp_rank", 1)),
        pp_size=int(kw.pop("pp_size", 2)),
        first_layer=first,
        kv_entries=layers * (1 if mla else 2),
        is_mla=mla,
        **kw,  # type: ignore[arg-type]
    )


def test_equal_pp_sizes_pair_one_to_one() -> None:
    assert decode_kv_window(_stage(2, 2), DecodeStage(1, 2, 4)) is None
    assert decode_kv_window(PrefillStage(kv_entries=8), DecodeStage(0, 1, 8)) is None


def test_a_stage_writes_its_k_and_v_layers_of_a_pp1_decode() -> None:
    # 4 layers at PP 2: stage 1 holds layers 2, 3 -> decode K regions 2, 3, V regions 6, 7
    assert decode_kv_window(_stage(2, 2), DecodeStage(0, 1, 8)) == (2, 3, 6, 7)
    assert decode_kv_window(_stage(0, 2, pp_rank=0), DecodeStage(0, 1, 8)) == (0, 1, 4, 5)


def test_uneven_split_takes_v_from_the_decodes_layer_count() -> None:
    # 27 layers at PP 2: 13 + 14; stage 1's V regions start at the decode's 27th entry
    # (a base of 2 x 14 = 28, a multiple of the stage's layers, would be one off)
    window = decode_kv_window(_stage(13, 14), DecodeStage(0, 1, 54))
    assert window == tuple(range(13, 27)) + tuple(range(40, 54))


def test_mla_has_one_region_a_layer() -> None:
    assert decode_kv_window(_stage(1, 1, mla=True, pp_size=3), DecodeStage(0, 1, 4)) == (1,)
    assert decode_kv_window(_stage(2, 2, mla=True, pp_size=3), DecodeStage(0, 1, 4)) == (2, 3)


@pytest.mark.parametrize(
    ("stage", "decode", "words"),
    [
        (_stage(2, 2), DecodeStage(0, 2, 4), "decode PP rank 0 registered with prefill PP rank 1"),
        (_stage(2, 2), DecodeStage(1, 2, 6), "num_layers: prefill=4 decode=6"),
        (_stage(2, 2, pp_size=4), DecodeStage(0, 2, 8), "decode PP size 2, prefill PP size 4"),
        (_stage(2, 2, draft_entries=2), DecodeStage(0, 1, 8), "speculative draft"),
        (_stage(2, 2), DecodeStage(0, 1, 10, draft_entries=2), "speculative draft"),
        (_stage(2, 2, has_state=True), DecodeStage(0, 1, 8), "state buffers"),
        (_stage(3, 2), DecodeStage(0, 1, 8), "layers 3..4, the decode 4"),
        (_stage(1, 2), DecodeStage(0, 1, 7), "do not split into K and V"),
    ],
    ids=[
        "other-rank",
        "other-layers",
        "pp-sizes",
        "prefill-draft",
        "decode-draft",
        "hybrid-state",
        "beyond-decode",
        "odd-list",
    ],
)
def test_what_cannot_pair_is_refused_with_what_differs(
    stage: PrefillStage, decode: DecodeStage, words: str
) -> None:
    with pytest.raises(ValueError) as exc:
        decode_kv_window(stage, decode)
    assert words in str(exc.value)
