"""Reusable test code (subprocess runners, SGLang probes, throwaway plugin packages).

``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so import these as ``helpers.<module>``.
"""
