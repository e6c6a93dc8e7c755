"""One module per supported SGLang release: our classes composed for it (the signatures
each release must have are ``adapter.contract.SIGNATURES``).

The plugin's own classes (``adapter/manager.py``, ``sender.py``, ``receiver.py``) are the
same on every release; a release module adds what that release's SGLang does not do for a
backend (``adapter/template.py``) and its own table APIs, by composition. Which module
serves the installed SGLang is ``release_gate.contract_for``'s answer.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def load(name: str) -> ModuleType:
    """The release module ``name`` (a value of ``release_gate.CONTRACTS``)."""
    return importlib.import_module(f"{__name__}.{name}")
