"""Per-room protocol state for both sides, free of SGLang, sockets and threads.

Each side keeps one record per room (``PrefillRoom``, ``DecodeRoom``) that owns everything
the room holds, and the decode keeps one ``SlotTable`` for its receiver staging slots.
Each record is a room machine (``prefill_machine``, ``decode_machine``): it takes an event
and returns the effects to carry out, and its phase decides. A record leaves its table in
exactly one place, on its machine's ``Close``, when the room's phase becomes terminal,
so a room cannot leak state into the next request that reuses its id. The tables return
what must be sent (grants, recalls) instead of sending it: the adapter owns the sockets.
"""
