"""SGLang-facing classes (manager, sender, receiver, bootstrap server).

This package and ``sgl_nixl_plugin.bridge`` are the only places that import SGLang.
Submodules are imported lazily by the bridge, only when SGLang asks for a class.
"""
