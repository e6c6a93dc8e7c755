"""The first request of a fresh PD pair in real SGLang servers, as a client sees it (CPU).

Starts the real-server stage's PD stack (``sglang.launch_server`` prefill and decode, SGLang's
router, the tiny random-weight Llama; tests/realserver/stack.py) once per round and mode, and
sends the same greedy request ``--requests`` times, one at a time. Each request is clocked at
the client, from before its POST to the router until its answer is read: the first request
of each stack is the first a user sends to a freshly started pair, so it pays whatever the
backend sets up when the decode first meets the prefill. Prints each mode's first request,
the median of the others (steady) and their ratio, per round and pooled.

Modes: ``plugin`` (the decode learns the prefill from the first request), ``named`` (the
decode names the prefill in ``SGLANG_NIXL_PLUGIN_PREFILLS`` at start-up), ``in-tree``
(SGLang's own nixl backend, our plugin skipped), ``single`` (one plain SGLang server, no
PD: SGLang's own first-request cost)::

    python benchmarks/real_server_first.py --mode plugin --mode in-tree --rounds 2

SGLang's own first-request costs (its first forward passes of a shape its start-up warm-up
did not run) are in every mode's first request alike; ``single`` shows them alone. Needs the real-server stage's packages (ci/setup_env.sh installs them). Every
process is stopped by its pid at the end; all of them bind to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests"):  # the stage's modules import the suite's helpers
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from real_server_rooms import room_fields  # noqa: E402

from tests.realserver import stack as rs  # noqa: E402
from tests.realserver.procs import ProcessGroup  # noqa: E402
from tests.realserver.tiny_model import VOCAB_SIZE, build_tiny_llama  # noqa: E402
from tests.realserver.workload import FIRST_ID, Req, generate  # noqa: E402

MODES = ("plugin", "named", "in-tree", "single")


def one_stack(mode: str, args: argparse.Namespace, tmp: Path, model: Path, tag: str) -> list[float]:
    """Client-side milliseconds of each request to a fresh stack, in order. With
    ``--room-lines``, also prints our rooms' timeline fields on both sides (the first room,
    then the median of the others): what of the client's time the plugin's rooms span."""
    logs = tmp / f"logs-{tag}"
    logs.mkdir()
    group = ProcessGroup(logs, tmp)
    env = {"SGLANG_NIXL_PLUGIN_LOG_LEVEL": "DEBUG"} if args.room_lines else {}
    launcher = rs.Launcher(group, model, tmp, plugin_env=env)
    rng = random.Random(7)
    ids = tuple(rng.randrange(FIRST_ID, VOCAB_SIZE) for _ in range(args.tokens))
    req = Req(f"{tag}-len{args.tokens}", args.new_tokens, input_ids=ids)
    out: list[float] = []
    try:
        stack = None
        if mode == "single":
            url = launcher.reference(1, args.page).url
        else:
            backend = "in-tree" if mode == "in-tree" else "plugin"
            stack = launcher.pd(backend, 1, args.page, named=mode == "named")
            url = stack.url
        for _ in range(args.requests):
            t0 = time.perf_counter()
            res = generate(url, req, rs.REQUEST_TIMEOUT_S)
            if res.error:
                raise RuntimeError(f"{mode}: request failed: {res.error}")
            out.append((time.perf_counter() - t0) * 1e3)
        if args.room_lines and stack is not None and mode != "in-tree":
            _print_rooms(tag, "decode", stack.decode.proc.log_text(), "sgl-nixl decode room")
            _print_rooms(tag, "prefill", stack.prefill.proc.log_text(), "sgl-nixl room")
    finally:
        group.stop()
    return out


def _print_rooms(tag: str, side: str, log: str, prefix: str) -> None:
    """Each timeline field of our rooms on one side: the first room's value, then the
    median of the others."""
    fields = room_fields(log, prefix)
    parts = [
        f"{k} {v[0]:.1f}/{statistics.median(v[1:]):.1f}"
        for k, v in fields.items()
        if k.endswith("_ms") and len(v) > 1
    ]
    print(f"[{tag}] our {side} rooms, first/median of the rest: {', '.join(parts)}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", action="append", choices=MODES, default=[])
    p.add_argument("--rounds", type=int, default=2, help="fresh stacks per mode, interleaved")
    p.add_argument("--requests", type=int, default=12, help="requests per stack")
    p.add_argument("--tokens", type=int, default=300, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=1)
    p.add_argument("--page", type=int, default=16)
    p.add_argument(
        "--room-lines", action="store_true", help="print our rooms' timelines (first, others)"
    )
    args = p.parse_args(argv)
    modes = args.mode or ["plugin", "in-tree"]
    runs: dict[str, list[list[float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="sgl-nixl-first-") as d:
        tmp = Path(d)
        model = build_tiny_llama(tmp / "tiny-llama")
        for r in range(args.rounds):
            for m in modes:
                ms = one_stack(m, args, tmp, model, f"{m}-{r}")
                runs[m].append(ms)
                steady = statistics.median(ms[1:])
                print(
                    f"[{m} round {r}] first {ms[0]:.1f} ms, steady p50 {steady:.1f} ms, "
                    f"{ms[0] / steady:.2f}x; all: {' '.join(f'{x:.1f}' for x in ms)}",
                    flush=True,
                )
    print(f"{'mode':10s} {'first (each round), ms':28s} {'steady p50':>10s} {'first/steady':>13s}")
    for m, rounds in runs.items():
        firsts = [ms[0] for ms in rounds]
        steady = statistics.median(x for ms in rounds for x in ms[1:])
        ratios = " ".join(f"{ms[0] / statistics.median(ms[1:]):.2f}" for ms in rounds)
        print(f"{m:10s} {' '.join(f'{f:.1f}' for f in firsts):28s} {steady:10.1f} {ratios:>13s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
