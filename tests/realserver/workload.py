"""Greedy /generate requests and the exact comparison of their output token ids.

Prompts are fixed token-id lists (seeded), so no tokenizer round trip can blur a mismatch,
plus two text prompts that go through the server's tokenizer. Lengths straddle the page size
16 and the 64-token prefill chunk; the longest ones span several chunks, so the prefill
sends their KV in several pieces.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from .tiny_model import VOCAB_SIZE

#: (prompt length in tokens, new tokens). 150 and 300 span 3 and 5 chunks of 64.
SHAPES = (
    (1, 8), (5, 16), (15, 12), (16, 16), (17, 20), (40, 8),
    (63, 16), (64, 12), (65, 16), (150, 24), (300, 16),
)  # fmt: skip
TEXTS = (
    ("text-short", "the kv cache page moves from prefill to decode", 16),
    ("text-long", " ".join(["alpha beta gamma delta, the router sends a request"] * 12), 20),
)
#: Token ids 0..2 are the special tokens of the tiny tokenizer; prompts avoid them.
FIRST_ID = 3


@dataclass(frozen=True)
class Req:
    name: str
    max_new_tokens: int
    input_ids: tuple[int, ...] = ()
    text: str = ""

    def payload(self) -> dict:
        body: dict = {
            "sampling_params": {
                "temperature": 0.0,
                "max_new_tokens": self.max_new_tokens,
                "ignore_eos": True,
            },
        }
        if self.input_ids:
            body["input_ids"] = list(self.input_ids)
        else:
            body["text"] = self.text
        return body


def make_requests(seed: int, tag: str, with_text: bool = True) -> list[Req]:
    rng = random.Random(seed)
    reqs = [
        Req(
            f"{tag}-len{n}",
            new,
            input_ids=tuple(rng.randrange(FIRST_ID, VOCAB_SIZE) for _ in range(n)),
        )
        for n, new in SHAPES
    ]
    if with_text:
        reqs += [Req(f"{tag}-{name}", new, text=text) for name, text, new in TEXTS]
    return reqs


@dataclass
class Result:
    req: Req
    output_ids: list[int] | None
    error: str = ""
    e2e_s: float = 0.0


def generate(base_url: str, req: Req, timeout_s: float) -> Result:
    try:
        resp = requests.post(f"{base_url}/generate", json=req.payload(), timeout=timeout_s)
    except requests.RequestException as exc:
        return Result(req, None, f"{type(exc).__name__}: {exc}")
    if resp.status_code != 200:
        return Result(req, None, f"HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        body = resp.json()
    except ValueError:
        return Result(req, None, f"not JSON: {resp.text[:500]}")
    meta = body.get("meta_info") or {}
    ids = body.get("output_ids", meta.get("output_ids"))
    if not isinstance(ids, list):
        return Result(req, None, f"no output_ids in the response: {str(body)[:500]}")
    problems = []
    finish = meta.get("finish_reason") or {}
    if finish.get("type") != "length":
        problems.append(f"finish_reason {finish!r}, expected length")
    if len(ids) != req.max_new_tokens:
        problems.append(f"{len(ids)} output ids, asked for {req.max_new_tokens}")
    if meta.get("completion_tokens") not in (None, len(ids)):
        problems.append(f"completion_tokens {meta.get('completion_tokens')} != {len(ids)}")
    return Result(req, ids, "; ".join(problems), float(meta.get("e2e_latency") or 0.0))


def run_sequential(base_url: str, reqs: Sequence[Req], timeout_s: float) -> list[Result]:
    return [generate(base_url, r, timeout_s) for r in reqs]


def run_concurrent(base_url: str, reqs: Sequence[Req], timeout_s: float) -> list[Result]:
    """All requests in flight at once (one thread each)."""
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        return list(pool.map(lambda r: generate(base_url, r, timeout_s), reqs))


def mismatches(results: Sequence[Result], expected: dict[str, list[int]]) -> list[str]:
    """One line per request whose ids differ from ``expected`` (or that failed)."""
    out = []
    for res in results:
        want = expected.get(res.req.name)
        if res.error or res.output_ids is None:
            out.append(f"{res.req.name}: {res.error or 'no output'}")
        elif want is None:
            out.append(f"{res.req.name}: no reference output")
        elif res.output_ids != want:
            first = next(
                (i for i, (a, b) in enumerate(zip(res.output_ids, want, strict=False)) if a != b),
                min(len(res.output_ids), len(want)),
            )
            out.append(
                f"{res.req.name}: first difference at output token {first}: "
                f"got {res.output_ids} expected {want}"
            )
    return out
