"""Decode side policy: which rooms fail when a prefill rank is lost or refuses this decode.

SGLang's decode fails a room at its handshake without telling anyone; when this side gives
a room up on its own, it tells the room's prefill ranks why (an ``Abort`` with a reason),
so that their senders fail now instead of at the bootstrap timeout.
"""

from __future__ import annotations

import logging
import time

from sgl_nixl_plugin.sides import decode_status
from sgl_nixl_plugin.sides.context import DecodeContext
from sgl_nixl_plugin.wire.messages import Abort

logger = logging.getLogger(__name__)

Endpoint = tuple[str, int]


#: The generation of a host room's abort when SGLang's deferred release is off (a prefill
#: ACKs only an abort that carries one; a host room waits for every ACK).
HOST_ABORT_GENERATION = 0

#: How long a retired socket may still flush what is queued on it.
RETIRE_LINGER_MS = 200


class DecodePolicy:
    def __init__(self, ctx: DecodeContext) -> None:
        self.ctx = ctx
        self._unused_since: dict[str, float] = {}  # socket URL -> when it stopped mattering

    def pending_endpoints(self) -> set[Endpoint]:
        """Prefill ranks that owe this decode data for some room, or an abort ACK for a
        host room."""
        rooms = self.ctx.rooms
        return rooms.pending_endpoints() | rooms.drain_endpoints()

    def known_endpoints(self) -> set[Endpoint]:
        """Every prefill rank this decode has a cached route to or a warm link with
        (watched for loss; their sockets stay open)."""
        known = self.ctx.sglang.cached_prefill_endpoints()
        if self.ctx.warmup is not None:
            known |= self.ctx.warmup.linked()
        return known

    def fail_endpoint(
        self, endpoint: Endpoint, reason: str, disconnect: bool = True
    ) -> dict[int, set[Endpoint]]:
        """Fail every unfinished room served by ``endpoint``, forget its cached route (and
        close the socket to it, unless the peer is alive: ``disconnect``), and return the
        rooms failed, each with every prefill rank that served it: read before the failure,
        as SGLang's scheduler may clear a failed room's record at once."""
        rooms = self.ctx.rooms
        served = {r: rooms.endpoints(r) for r in rooms.rooms_served_by(endpoint)}
        failed = {
            r: eps or {endpoint}
            for r, eps in served.items()
            if decode_status.fail(self.ctx, r, reason)
        }
        if disconnect:  # gone: no ACK will come from it
            rooms.peer_lost(endpoint)
        self.forget_endpoint(endpoint, disconnect)
        log = logger.error if failed else logger.info
        log(
            "sgl-nixl: %s (%d requests failed: rooms %s)", reason, len(failed), _rooms(list(failed))
        )
        return failed

    def forget_endpoint(self, endpoint: Endpoint, disconnect: bool = False) -> None:
        """Drop cached routes to ``endpoint``: the next request asks the bootstrap again
        (and registers again). ``disconnect`` also closes the socket, for a peer that is
        gone; a live one keeps it, so that messages queued on it (aborts) still leave."""
        self.ctx.sglang.forget_prefill_endpoint(endpoint, disconnect)
        self.ctx.one_pass.discard(endpoint)
        self.ctx.flag_ranks.pop(endpoint, None)
        if self.ctx.staging is not None:  # it has our staging area again once it asks again
            self.ctx.staging.offers.withdraw(endpoint)
        if self.ctx.warmup is not None:
            self.ctx.warmup.forget(endpoint)

    def close_unused_sockets(self, keep: set[Endpoint], grace_s: float) -> list[str]:
        """Close the sockets to prefill ranks this decode no longer has a route to.

        A prefill that comes back on another port gets a new route from SGLang; nothing
        else closes the old socket (its peer sent no reset if the link was cut when it
        died). A socket stays while its endpoint is in ``keep`` (known or owed data), and
        for ``grace_s`` after it left ``keep`` or after its prefill refused this decode,
        so that aborts queued on it still leave. Returns the URLs closed.
        """
        now, sg = time.monotonic(), self.ctx.sglang
        kept = {sg.socket_url(ep) for ep in keep}
        recent = {
            sg.socket_url(ep) for ep, (_, at) in self.ctx.refused.items() if now - at < grace_s
        }
        closed = []
        for url in sg.socket_urls():
            if url in kept or url in recent:
                self._unused_since.pop(url, None)
                continue
            since = self._unused_since.setdefault(url, now)
            if now - since >= grace_s:
                sg.close_socket(url, RETIRE_LINGER_MS)
                del self._unused_since[url]
                closed.append(url)
        for url in set(self._unused_since) - sg.socket_urls():
            del self._unused_since[url]  # closed by someone else
        if closed:
            logger.info("sgl-nixl: closed sockets to prefill ranks no route leads to: %s", closed)
        return closed

    def on_refused(self, endpoint: Endpoint, reason: str) -> None:
        self.ctx.refused[endpoint] = (reason, time.monotonic())
        why = f"prefill {endpoint[0]}:{endpoint[1]} refused this decode: {reason}"
        # the prefill is alive (it answered): the aborts below go out on the same socket;
        # a pipeline stage's refusal fails the room, and the other stages need telling too
        for room, endpoints in self.fail_endpoint(endpoint, why, disconnect=False).items():
            self.tell_prefills(room, endpoints, why)

    def refusal_since(self, endpoints: set[Endpoint], since: float) -> str | None:
        """Why one of ``endpoints`` refused this decode at or after ``since``, if one did."""
        for ep in sorted(endpoints):
            refused = self.ctx.refused.get(ep)
            if refused is not None and refused[1] >= since:
                return f"prefill {ep[0]}:{ep[1]} refused this decode: {refused[0]}"
        return None

    def abort_generation(self, room: int, generation: int | None) -> int | None:
        """The generation an abort of ``room`` carries: SGLang's, else, for a host room
        (whose pages wait for every prefill rank's ACK), ours; the room's machine learns of
        the abort (a host room's ACKs are due from now on)."""
        rooms = self.ctx.rooms
        rooms.aborted(room)  # no prefill status applies any more
        if not rooms.is_host(room):
            return generation
        return HOST_ABORT_GENERATION if generation is None else generation

    def tell_prefills(self, room: int, endpoints: set[Endpoint], reason: str) -> None:
        """This decode gave ``room`` up on its own: tell its prefill ranks why."""
        me = self.ctx.me
        msg = Abort(room, me.ip, me.port, self.abort_generation(room, None), reason)
        for ep in endpoints:
            self.ctx.send(ep, msg)


def _rooms(rooms: list[int], limit: int = 8) -> str:
    """Room ids for a log line, the first ``limit`` of them."""
    shown = ", ".join(str(r) for r in rooms[:limit])
    return shown + (f" and {len(rooms) - limit} more" if len(rooms) > limit else "") or "none"
