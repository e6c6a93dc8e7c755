"""A prefill rank that writes into the decode's pool in one pass (CUDA IPC) says so in its
``RegistrationReply``; the decode then grants it no staging slots: slots it would only
send back, and page indices uploaded for scatters that never come.

On our live decode manager (built through SGLang's classes): the reply arrives over the
wire from a fake prefill rank, and the request is built by the manager's own
``build_receiver_metadata_message``, what our receiver sends.
"""

from __future__ import annotations

import numpy as np
import pytest

from sgl_nixl_plugin.wire.codec import Codec
from sgl_nixl_plugin.wire.messages import RegistrationReply, TransferRequest

from ._harness import wait_for

pytestmark = pytest.mark.timeout(60)

PAGES = np.array([3, 5, 7], dtype=np.int32)


def _request_to(cluster, room: int, target: tuple[str, int]) -> TransferRequest:
    mgr = cluster.decode
    mgr.decode.ctx.rooms.start_requests(room, [target])
    frames = mgr.build_receiver_metadata_message(
        bootstrap_room=room,
        required_dst_info_num=1,
        kv_indices=PAGES,
        aux_index=1,
        state_indices=None,
        decode_prefix_len=0,
        is_dummy=False,
    )
    decoded = Codec().decode([bytes(f) for f in frames])
    assert decoded is not None and isinstance(decoded.msg, TransferRequest)
    return decoded.msg


def _reply(fake, one_pass: bool) -> None:
    side = fake.cluster.decode.decode
    fake.send(
        fake.cluster.decode.rank_port,
        RegistrationReply(
            "decode", 0, True, "", fake.ip, fake.port, one_pass=one_pass, wants_staging=not one_pass
        ),
    )
    ep = (fake.ip, fake.port)
    wait_for(lambda: (ep in side.ctx.one_pass) == one_pass, 5, f"one_pass={one_pass} noted")


def test_a_one_pass_prefill_gets_no_staging_slots(cluster, rooms, fake_rank) -> None:
    side = cluster.decode.decode
    if side.staging is None:
        pytest.skip("the decode's staging path is off here")
    fake = fake_rank("prefill")
    fake.cluster = cluster
    ep = (fake.ip, fake.port)

    staged = _request_to(cluster, rooms(), ep)
    # no reply yet: staged as before, its slots by asking once our staging area went to it
    assert staged.staged and staged.staging_slots == [], staged

    _reply(fake, one_pass=True)
    room = rooms()
    req = _request_to(cluster, room, ep)
    assert not req.staged and req.staging_slots == [], req
    assert not cluster.decode.decode.ctx.rooms.is_staged(room)

    _reply(fake, one_pass=False)  # it registered again without the mapping: it stages
    wait_for(lambda: ep in side.staging.offers.offered, 5, "staging area offered")
    again = _request_to(cluster, rooms(), ep)
    assert again.staged, again  # its slots come now or by asking (the first room holds some)

    _reply(fake, one_pass=True)
    side.policy.forget_endpoint(ep)  # its route is dropped (lost, refused or restarted)
    assert ep not in side.ctx.one_pass
    assert _request_to(cluster, rooms(), ep).staged
