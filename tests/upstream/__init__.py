"""Ports of SGLang's own CPU unit tests for the disaggregation layer, run against our classes.

SGLang's repository keeps them under ``test/registered/unit/disaggregation/``; the released
wheel does not ship them. Each module here names the upstream file (path and commit) it
ports. The tests drive one in-process cluster (``_harness``): our bootstrap server, one
prefill and one decode manager with real NIXL (UCX on loopback) and real ZMQ, plus fake
peers that speak our wire, all on 127.0.0.1.
"""
