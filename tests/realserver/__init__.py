"""Real-server stage: the plugin in real SGLang 0.5.23 server processes (see test_real_server.py)."""
