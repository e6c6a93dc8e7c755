"""What one rank of a bench session is: its role, place in its server, and its requests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from sgl_nixl_plugin.bench.workload import Request, Workload


@dataclass
class RankSpec:
    role: str  # prefill | decode | bootstrap
    instance: int
    tp_size: int
    tp_rank: int
    workload: Workload
    bootstrap_port: int  # the port this prefill instance registers to / serves
    prefill_addrs: list[str] = field(default_factory=list)  # decode: one per prefill instance
    n_prefill: int = 1
    n_decode: int = 1
    serve_bootstrap: bool = False
    mem_kind: str = "DRAM"
    gpu_id: int = 0
    env: dict[str, str] = field(default_factory=dict)
    deadline_s: float = 300.0
    verify: bool = True
    pp_size: int = 1  # pipeline stages of this rank's server
    pp_rank: int = 0
    pp_port: int = 0  # a PP prefill's gloo rendezvous (its instance's ranks), on 127.0.0.1
    dp_size: int = 1  # attention DP groups of this rank's server (DP attention when > 1)
    # decode: registers with its prefills at start-up (SGLANG_NIXL_PLUGIN_PREFILLS), and
    # sends its first request to each once that is done
    preconnect: bool = False

    @property
    def rank(self) -> int:
        """SGLang's world rank within the server: PP stage-major, TP rank within a stage."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def attn_tp_size(self) -> int:
        """Ranks of one attention DP group (SGLang: TP size // DP size)."""
        return self.tp_size // self.dp_size

    @property
    def attn_tp_rank(self) -> int:
        return self.tp_rank % self.attn_tp_size

    @property
    def attn_dp_rank(self) -> int:
        return self.tp_rank // self.attn_tp_size

    def my_requests(self) -> list[Request]:
        """This rank's requests (``requests_of``)."""
        return requests_of(
            self.workload.make_requests(),
            self.role,
            self.instance,
            self.n_prefill if self.role == "prefill" else self.n_decode,
            self.dp_size,
            self.attn_dp_rank,
        )

    def prefill_addr_of(self, index: int) -> str:
        return self.prefill_addrs[index % self.n_prefill]


def requests_of(
    reqs: Sequence[Request], role: str, instance: int, instances: int, dp_size: int, dp_rank: int
) -> list[Request]:
    """The requests of attention DP group ``dp_rank`` of server ``instance`` of ``role``.

    Request i goes to prefill instance i % n_prefill and decode instance i % n_decode. In a
    server with DP attention, as SGLang routes by default: a prefill's DP controller sends a
    room to DP rank ``room % dp_size`` (``follow_bootstrap_room``, which its sender checks), a
    decode's deals its requests round robin (``round_robin``), whatever their rooms.
    """
    mine = [r for i, r in enumerate(reqs) if i % instances == instance]
    if dp_size == 1:
        return mine
    if role == "prefill":
        return [r for r in mine if r.room % dp_size == dp_rank]
    return [r for j, r in enumerate(mine) if j % dp_size == dp_rank]


#: ``SGLANG_PLUGINS`` of an in-tree run: no general plugin loads, so SGLang's own nixl serves.
INTREE_PLUGINS = "__none__"
