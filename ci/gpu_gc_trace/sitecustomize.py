"""Put first on PYTHONPATH (``GC_TRACE=1 bash ci/gpu_first_request.sh``) to have every process
report its slow garbage collections on stderr: each full (generation 2) one and any other
of 10 ms or more, with its process id and ``time.perf_counter()`` at its end; and each
wake-up of a watcher thread that came 30 ms or more late, with every thread's stack. A lead
for the learned first request's occasional 100-190 ms wait on the GPU host. It is a
``sitecustomize`` (the GPU machine runs Python with the user site off, so a
``usercustomize`` never loads) and runs the next ``sitecustomize`` on the path after it
(the GPU stubs'), which it shadows."""

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


def _watch(period_s: float = 0.005, late_s: float = 0.030) -> None:
    """Report each wake-up of this thread that came ``late_s`` or more after it was due: the
    process (or the host) did not run Python for that long. The stacks of the other threads
    at that moment name who held the interpreter."""
    import threading
    import traceback

    me = threading.get_ident()
    due = time.perf_counter() + period_s
    while True:
        time.sleep(period_s)
        now = time.perf_counter()
        if now - due >= late_s:
            frames = sys._current_frames()
            lines = [f"late-wake pid {os.getpid()} {(now - due) * 1e3:.1f} ms at {now:.4f}"]
            for ident, frame in frames.items():
                if ident != me:
                    stack = traceback.format_stack(frame, limit=4)
                    lines.append(
                        f"late-wake   thread {ident}: "
                        + " | ".join(s.strip().replace("\n", " ") for s in stack)
                    )
            sys.stderr.write("\n".join(lines) + "\n")
        due = now + period_s


if os.environ.get("GC_TRACE_WAKE", "1") == "1":
    import threading as _threading

    _threading.Thread(target=_watch, name="late-wake", daemon=True).start()


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows (the next on ``sys.path``)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in sys.path:
        path = os.path.join(folder, "sitecustomize.py")
        if folder and os.path.abspath(folder) != here and os.path.isfile(path):
            with open(path) as f:
                code = compile(f.read(), path, "exec")
            exec(code, {"__name__": "sitecustomize_shadowed", "__file__": path})
            return


_chain()
