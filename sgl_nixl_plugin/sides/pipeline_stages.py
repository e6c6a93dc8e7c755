"""Which of a decode's KV regions a prefill pipeline-parallel (PP) stage writes.

SGLang hands each PP stage a ``KVArgs`` with its own layers only, in global order (MHA
``[K_s..K_e-1, V_s..V_e-1]``, MLA ``[KV_s..KV_e-1]``), and ``prefill_start_layer`` = ``s``.
A decode runs at the prefill's PP size (its stage ``r`` holds the same layers as the
prefill's stage ``r``: regions pair one to one) or at PP 1 (it holds every layer: the stage
writes a window of them). SGLang's decode refuses anything else, so do we, at registration.
The V window starts at the decode's own layer count, read from its registration (not from a
multiple of the stage's layers, which is wrong for uneven splits such as 27 layers at PP 2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillStage:
    """This prefill rank's place in the pipeline and the shape of its KV list."""

    pp_rank: int = 0
    pp_size: int = 1
    first_layer: int = 0  # SGLang's prefill_start_layer (full-attention layers for hybrids)
    kv_entries: int = 0  # len(kv_data_ptrs)
    draft_entries: int = 0  # the speculative draft model's, appended after the target's
    is_mla: bool = False
    has_state: bool = False  # per-request or per-layer state groups (hybrid models)


@dataclass(frozen=True)
class DecodeStage:
    """What a decode rank's registration says of its pipeline place and KV list."""

    pp_rank: int
    pp_size: int
    kv_entries: int
    draft_entries: int = 0


def decode_kv_window(prefill: PrefillStage, decode: DecodeStage) -> tuple[int, ...] | None:
    """The decode's KV region for each of the prefill's, in order; None when they pair one
    to one (equal PP sizes). ``ValueError`` names what differs when the two cannot pair."""
    if decode.pp_size == prefill.pp_size:
        if decode.pp_rank != prefill.pp_rank:
            raise ValueError(
                f"decode PP rank {decode.pp_rank} registered with prefill PP rank "
                f"{prefill.pp_rank}: at equal PP sizes each stage serves its own"
            )
        if decode.kv_entries != prefill.kv_entries:
            raise ValueError(
                f"num_layers: prefill={prefill.kv_entries} decode={decode.kv_entries} "
                "(KV buffers of this PP stage): start both servers with the same model"
            )
        return None
    if decode.pp_size != 1:
        raise ValueError(
            f"decode PP size {decode.pp_size}, prefill PP size {prefill.pp_size}: a decode "
            "runs at the prefill's PP size or at PP 1"
        )
    if prefill.draft_entries or decode.draft_entries:
        raise ValueError(
            "speculative draft KV buffers with a PP prefill and a PP 1 decode are not "
            "served: run the decode at the prefill's PP size, or without a draft model"
        )
    if prefill.has_state:
        raise ValueError(
            "this model's state buffers (hybrid attention) are per PP stage and are not "
            "paired with a PP 1 decode: run the decode at the prefill's PP size"
        )
    halves = 1 if prefill.is_mla else 2
    if prefill.kv_entries % halves or decode.kv_entries % halves:
        raise ValueError(
            f"KV buffers of prefill ({prefill.kv_entries}) and decode ({decode.kv_entries}) "
            "do not split into K and V halves"
        )
    mine, theirs = prefill.kv_entries // halves, decode.kv_entries // halves
    start = prefill.first_layer
    if start < 0 or start + mine > theirs:
        raise ValueError(
            f"num_layers: prefill stage {prefill.pp_rank} holds layers {start}.."
            f"{start + mine - 1}, the decode {theirs}: start both servers with the same model"
        )
    return tuple(h * theirs + start + i for h in range(halves) for i in range(mine))
