"""The SGLang side of start-up: the ``sglang.srt.plugins`` entry function, the version gate,
and the ``get_kv_class`` hook. Nothing here is imported until SGLang calls ``register()``.
"""
