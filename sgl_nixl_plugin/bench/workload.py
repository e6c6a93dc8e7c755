"""Workloads for PD sessions: model shapes, requests, page allocation, byte patterns.

Every process of a session derives the same requests from the same seed, so prefill and
decode agree on rooms and sizes without talking. Page contents follow a pattern of
(room, region, page of the request, token, *global* head, word), so a decode rank can
check every byte it received even when its heads are a slice of a prefill rank's heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8_e4m3": 1, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelShape:
    """What the KV pool of one model looks like, before tensor parallelism splits it."""

    name: str
    layers: int
    kv_heads: int  # total KV heads (1 for MLA)
    head_dim: int  # per head; for MLA the latent width (kv_lora_rank + rope dim)
    dtype: str = "bfloat16"
    mla: bool = False

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def head_bytes(self) -> int:
        return self.head_dim * self.dtype_bytes

    def heads_per_rank(self, tp: int) -> int:
        if self.mla:
            return 1
        if self.kv_heads % tp:
            raise ValueError(f"{self.kv_heads} KV heads do not split over TP {tp}")
        return self.kv_heads // tp

    def regions(self) -> int:
        """K and V per layer for MHA; one latent buffer per layer for MLA."""
        return self.layers if self.mla else 2 * self.layers

    def token_bytes(self, tp: int = 1) -> int:
        """KV bytes of one token held by one rank."""
        return self.regions() * self.heads_per_rank(tp) * self.head_bytes


PRESETS = {
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 8, 128),
    "deepseek-mla": ModelShape("deepseek-mla", 61, 1, 576, mla=True),
    "tiny": ModelShape("tiny", 4, 4, 16, "float16"),
    "tiny-mla": ModelShape("tiny-mla", 4, 1, 32, "float16", mla=True),
}

AUX_ITEM_BYTES = (64, 8)  # two metadata buffers: "output ids" rows and "bootstrap_room" rows
STATE_ITEM_BYTES = 256  # one state component (e.g. a Mamba/SWA slot per request)


@dataclass(frozen=True)
class Request:
    room: int
    tokens: int
    chunks: int
    contiguous: bool
    with_state: bool
    send_delay_ms: float = 0.0  # before its first send (see ``Workload.send_delays_ms``)
    host: bool = False  # the decode receives it into its host pool (SGLang's host receive)
    abort_at_ms: float | None = None  # the decode aborts it this long after its request

    def pages(self, page_size: int) -> int:
        return -(-self.tokens // page_size)

    def split(self, pages: np.ndarray) -> list[np.ndarray]:
        """The request's pages in the chunks SGLang's scheduler sends: at most ``chunks``,
        none empty. SGLang's sender calls the chunk that completes the pages the last one
        (aux row with it) and ignores sends after the room ends, while the scheduler hands
        the state to its own last send: an empty trailing chunk would carry the state
        after the room could already have ended, and the state would never be written."""
        return np.array_split(pages, max(1, min(self.chunks, len(pages))))

    def chunk_tokens(self, parts: list[int], page_size: int) -> list[int]:
        """SGLang's ``num_kv_tokens`` of each chunk of ``parts`` pages: its pages' tokens,
        as far as the request reaches (the chunk holding the last page ends the request)."""
        out, left = [], self.tokens
        for n in parts:
            out.append(min(n * page_size, left))
            left -= out[-1]
        return out


@dataclass(frozen=True)
class Workload:
    shape: ModelShape
    page_size: int = 16
    requests: int = 32
    min_tokens: int = 256
    max_tokens: int = 1024
    concurrency: int = 8
    chunks: tuple[int, ...] = (1,)
    chunk_gap_ms: float = 0.0  # between a request's chunked-prefill sends (its forward passes)
    # before a request's first send, cycled over the requests like ``chunks`` (its wait for
    # a forward pass: rooms the decode asked for early can be ready late)
    send_delays_ms: tuple[float, ...] = (0.0,)
    fragmentation: str = "random"  # random | contiguous | mixed
    state: bool = True
    seed: int = 1234
    extra_pool_pages: int = 8
    # every n-th request (from the first) goes to the decode's host pool; 0: none. SGLang's
    # host receive takes full KV (and paged SWA) only: no per-request state with it
    host_every: int = 0
    # the decode's page size where it differs from the prefill's ``page_size`` (0: equal):
    # the prefill pairs the two sides' pages token by token
    decode_page_size: int = 0
    # SGLang's StateType of the per-request state (``state``): how the pool names it to
    # the backend (e.g. "swa", indexed by pages, pairs only between equal page sizes)
    state_kind: str = "mamba"
    # every n-th device-pool request (from the second) is aborted by the decode at a random
    # moment up to ``abort_within_ms`` after its transfer request (0: none): its pages are
    # then painted once the abort is safe, and must stay painted (no write after the ACK)
    abort_every: int = 0
    abort_within_ms: float = 2.0

    def page_size_of(self, role: str) -> int:
        """Tokens a page on ``role``'s side (prefill or decode)."""
        if role == "decode" and self.decode_page_size:
            return self.decode_page_size
        return self.page_size

    @property
    def pages_differ(self) -> bool:
        return self.page_size_of("decode") != self.page_size

    def __post_init__(self) -> None:
        if self.host_every and self.state:
            raise ValueError(
                "host destinations carry no per-request state (SGLang's host receive "
                "refuses state pools other than SWA): run them without state"
            )

    def make_requests(self) -> list[Request]:
        rng = np.random.default_rng(self.seed)
        out = []
        for i in range(self.requests):
            tokens = int(rng.integers(self.min_tokens, self.max_tokens + 1))
            contiguous = {"random": False, "contiguous": True, "mixed": bool(i % 2)}[
                self.fragmentation
            ]
            room = int(rng.integers(1, 2**63 - 1))
            host = bool(self.host_every) and i % self.host_every == 0
            abort_at = None
            if self.abort_every and not host and i % self.abort_every == 1 % self.abort_every:
                abort_at = float(np.random.default_rng((self.seed, i)).uniform(0, 1))
                abort_at *= self.abort_within_ms
            out.append(
                Request(
                    room,
                    tokens,
                    self.chunks[i % len(self.chunks)],
                    contiguous,
                    self.state,
                    self.send_delays_ms[i % len(self.send_delays_ms)],
                    host,
                    abort_at,
                )
            )
        return out

    def pool_pages(self, role: str = "prefill") -> int:
        per_req = -(-self.max_tokens // self.page_size_of(role))
        held = -(-self.requests // self.abort_every) if self.abort_every and role == "decode" else 0
        return per_req * (self.concurrency + held) + self.extra_pool_pages


@dataclass
class PagePool:
    """A free list of pages; random allocations scatter, contiguous ones take a run."""

    num_pages: int
    seed: int
    free: list[int] = field(default_factory=list)

    padding_page: bool = True  # page 0 stays unused, as SGLang's device pools keep it

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        self.mask = np.ones(self.num_pages, dtype=bool)
        self.mask[0] = not self.padding_page

    def alloc(self, n: int, contiguous: bool) -> np.ndarray | None:
        free = np.flatnonzero(self.mask)
        if len(free) < n:
            return None
        if contiguous:
            # first run of n free pages
            if n == 0:
                return np.empty(0, np.int32)
            starts = free[: len(free) - n + 1]
            ok = free[n - 1 :] - starts == n - 1
            hits = np.flatnonzero(ok)
            if not len(hits):
                return None
            pages = np.arange(starts[hits[0]], starts[hits[0]] + n)
        else:
            pages = self.rng.choice(free, size=n, replace=False)
        self.mask[pages] = False
        return pages.astype(np.int32)

    def release(self, pages: np.ndarray) -> None:
        self.mask[pages] = True


def pattern(
    room: int,
    region: int,
    page_in_req: np.ndarray,
    page_size: int,
    heads: np.ndarray,
    head_words: int,
) -> np.ndarray:
    """uint32 words for pages ``page_in_req`` of a request: shape (pages, tokens, heads, words).

    A function of the token's position in the request, not of its page: sides with
    different page sizes expect the same words for the same token."""
    base = np.uint32((room * 2654435761 + region * 40503) & 0xFFFFFFFF)
    pos = page_in_req.astype(np.uint32)[:, None] * np.uint32(page_size) + np.arange(
        page_size, dtype=np.uint32
    )
    t = pos[:, :, None, None] * np.uint32(7919)
    h = heads.astype(np.uint32)[None, None, :, None] * np.uint32(104729)
    w = np.arange(head_words, dtype=np.uint32)[None, None, None, :]
    return base + t + h + w


def aux_pattern(room: int, buf: int, nbytes: int) -> np.ndarray:
    rng = np.random.default_rng([room & 0xFFFFFFFF, room >> 32, buf])
    return rng.integers(1, 256, nbytes, dtype=np.uint8)


def state_pattern(room: int, nbytes: int) -> np.ndarray:
    rng = np.random.default_rng([room & 0xFFFFFFFF, room >> 32, 99])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)
