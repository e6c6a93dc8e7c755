"""SGLang-facing code: the KV classes (manager, sender, receiver, bootstrap server), the
``get_kv_class`` hook (``hooks``) and the bench's and doctor's calls into SGLang (``harness``).

This package is the only one that imports SGLang (tests/unit/test_structure.py checks it). This
file imports nothing, so importing one submodule (as the bridge does for ``hooks``) loads only
that one; the classes are imported lazily, only when SGLang asks for them.
"""
