"""The SGLang facade: the KV classes SGLang asks for (manager, sender, receiver, bootstrap
server) composed per supported release (``releases``, ``contract``, ``release_gate``), the
``get_kv_class`` hook (``hooks``), the facade over SGLang's room tables (``sglang_rooms``) and
the bench's and doctor's calls into SGLang (``harness``).

This package is the only one that imports SGLang (tests/unit/test_structure.py checks it); the
threads it starts live in ``sides``. This file imports nothing, so importing one submodule (as
the bridge does for ``hooks``) loads only that one; the classes are imported lazily, only when
SGLang asks for them.
"""
