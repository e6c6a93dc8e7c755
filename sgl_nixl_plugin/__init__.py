"""sgl-nixl-plugin: a NIXL KV-cache transfer backend for SGLang PD disaggregation.

Importing this package must stay cheap: SGLang imports our entry point in every
process, so nothing here may import torch, nixl or SGLang.
"""

__version__ = "0.4.1"
