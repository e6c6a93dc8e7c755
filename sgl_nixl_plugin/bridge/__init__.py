"""The start-up side of the plugin: the ``sglang.srt.plugins`` entry function and the version
gate. Nothing here is imported until SGLang calls ``register()``; the ``get_kv_class`` hook it
installs lives with the rest of the SGLang-facing code, in ``sgl_nixl_plugin.adapter.hooks``.
"""
