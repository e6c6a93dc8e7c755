"""Wire protocol: msgspec control messages, their framing on ZMQ, and compatibility checks.

No sockets here: callers hand frames in and get frames out.
"""

from sgl_nixl_plugin.wire.codec import Codec, Decoded, Rejections, index_specs
from sgl_nixl_plugin.wire.compat import compat_hash, describe_mismatch
from sgl_nixl_plugin.wire.messages import PROTOCOL_VERSION, Compat, Region

__all__ = [
    "PROTOCOL_VERSION",
    "Codec",
    "Compat",
    "Decoded",
    "Region",
    "Rejections",
    "compat_hash",
    "describe_mismatch",
    "index_specs",
]
