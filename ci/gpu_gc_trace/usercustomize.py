"""Put first on PYTHONPATH (``GC_TRACE=1 bash ci/gpu_first_request.sh``) to have every process
report its slow garbage collections on stderr: each full (generation 2) one and any other
of 10 ms or more, with its process id and ``time.perf_counter()`` at its end. A lead for
the learned first request's occasional 100-190 ms wait on the GPU host: a full collection
in a process that imported SGLang and torch takes ~290 ms on the CPU host. (The GPU stubs
own ``sitecustomize``; Python imports ``usercustomize`` after it.)"""

import gc
import os
import sys
import time

_started: dict[int, float] = {}


def _report(phase: str, info: dict) -> None:
    gen = int(info.get("generation", -1))
    now = time.perf_counter()
    if phase == "start":
        _started[gen] = now
        return
    ms = (now - _started.get(gen, now)) * 1e3
    if gen == 2 or ms >= 10:
        sys.stderr.write(f"gc-trace pid {os.getpid()} gen {gen} {ms:.1f} ms at {now:.4f}\n")


gc.callbacks.append(_report)
