"""A tiny random-weight Llama (or Qwen3) written at test time (nothing comes from any model hub).

2 decoder layers, 2 KV heads (4 query heads), hidden size 64, float32, weights drawn from
a fixed seed, and a byte-level BPE tokenizer trained here on a fixed synthetic corpus with
the ``tokenizers`` library. The same arguments always give the same files, so the reference
server and the prefill/decode pair load bit-identical weights.

Run it by hand with ``python tests/realserver/tiny_model.py OUT_DIR``.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

SEED = 1234
VOCAB_SIZE = 384
NUM_LAYERS = 2
NUM_KV_HEADS = 2
NUM_HEADS = 4
HIDDEN = 64
HEAD_DIM = HIDDEN // NUM_HEADS
MAX_POSITIONS = 2048

_WORDS = (
    "the a an of to and in on at by for with from kv cache page token prefill decode "
    "transfer layer head rank agent room chunk queue server router model weight plugin "
    "nixl memory buffer index slot request batch greedy sample output input prompt "
    "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
    "zero one two three four five six seven eight nine ten red green blue cyan black white"
).split()


def _corpus(lines: int = 4000) -> list[str]:
    rng = random.Random(SEED)
    out = []
    for _ in range(lines):
        n = rng.randint(3, 24)
        out.append(" ".join(rng.choice(_WORDS) for _ in range(n)) + rng.choice(".,!?;:"))
    out.append("".join(chr(c) for c in range(32, 127)))  # every printable ASCII byte
    return out


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    return tok


def build_tiny_llama(out_dir: str | os.PathLike) -> Path:
    """Write config, weights and tokenizer to ``out_dir`` and return it as a Path."""
    return _build(out_dir, "llama")


def build_tiny_qwen3(out_dir: str | os.PathLike) -> Path:
    """The same model as Qwen3, for DP attention: SGLang's Qwen3 shards attention over the
    attention TP group and gathers the DP ranks' tokens around its MLP; its Llama splits
    heads over the whole TP group and has no DP gather (wrong tokens under DP attention)."""
    return _build(out_dir, "qwen3")


def _build(out_dir: str | os.PathLike, arch: str) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)

    config_cls, model_cls, extra = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    }[arch]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        # A wide init spreads the logits, so greedy argmax is far from ties.
        initializer_range=0.2,
        torch_dtype="float32",
        **extra,
    )
    torch.manual_seed(SEED)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


if __name__ == "__main__":
    print(build_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
