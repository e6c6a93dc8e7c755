"""The decode ranks a prefill rank has accepted, those it refused, and those being set up."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from sgl_nixl_plugin.engine.engine import GroupBounds, PeerLink
from sgl_nixl_plugin.engine.staging import RemoteStaging
from sgl_nixl_plugin.wire.messages import PeerRegistration


@dataclass(eq=False)  # identity: holds arrays and live state
class DecodePeer:
    """A registered decode rank: its NIXL link and what it told us."""

    agent: str
    link: PeerLink
    reg: PeerRegistration
    endpoint: tuple[str, int]
    staging: RemoteStaging | None = None
    window: tuple[int, ...] | None = None  # its KV regions we write (a PP stage's); None: all
    wants_staging: bool = False  # we asked for its staging area (sent in a ``StagingOffer``)
    may_stage: bool = False  # it may take staged transfers; nothing set up until one is due

    @property
    def staging_slot_bytes(self) -> int:
        """Its staging slot size: of its area, or, while that is on its way, of its
        registration (its rooms then wait for slots); 0: we do not stage into it."""
        if self.staging is not None:
            return self.staging.slot_bytes
        return self.reg.staging_slot_bytes if self.wants_staging else 0


@dataclass(eq=False)
class PendingDecode:
    """A decode rank whose link is being set up: its requests are checked against
    ``bounds`` and filed meanwhile (SGLang's prefill starts a request's forward pass only
    once it is filed); their chunks wait for the link. ``rooms``: those filed so far."""

    reg: PeerRegistration
    bounds: dict[str, GroupBounds]
    rooms: set[int] = field(default_factory=set)
    # the staging slots each staged request granted: its room's credits, should the
    # setup accept the decode for staged transfers
    slots: dict[int, list[int]] = field(default_factory=dict)


class DecodePeers:
    """Accepted decode ranks by agent name, the reason each refused one was refused, and
    the ones being set up. A decode moves from ``pending`` to ``accepted`` or ``refused``
    (or out, to register again) under ``lock``, so a reader never finds it in none."""

    def __init__(self) -> None:
        self.accepted: dict[str, DecodePeer] = {}
        self.refused: dict[str, str] = {}
        self.pending: dict[str, PendingDecode] = {}
        self.lock = threading.Lock()

    def get(self, agent: str) -> DecodePeer | None:
        return self.accepted.get(agent)

    def lookup(self, agent: str) -> tuple[DecodePeer | None, str | None]:
        with self.lock:
            return self.accepted.get(agent), self.refused.get(agent)

    def waits_for_link(self, agent: str) -> bool:
        """Whether ``agent`` is still being set up (its chunks wait for the link)."""
        with self.lock:
            return agent in self.pending and agent not in self.accepted
