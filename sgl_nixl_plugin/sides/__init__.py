"""The per-side threads and their policy, free of SGLang: the prefill's control thread and
transfer worker, the decode's listener, staging and warm-up, and what they are handed
(``context``). SGLang's room tables reach them as the ``RoomTables`` protocol, which the
adapter's ``SGLangRooms`` implements; tests/unit/test_sglang_free.py imports every module
here with SGLang refused.
"""
