"""What a short link cut does to a NIXL WRITE stream over UCX/TCP (root: makes two network
namespaces; not a test, prints what it saw)::

    python benchmarks/netns_cut/run.py [CUT_AT_S [CUT_S]]     # default: 1.5 s in, 1.5 s long

Two processes (``peer.py``), one per namespace, joined by a veth pair, UCX on ``tcp``; the
initiator WRITEs 1 MiB every 50 ms for 6 s, and the link goes down and up again. It prints
every WRITE posted from 0.5 s before the cut to 1 s after the restore, or slower than
0.1 s: post and end in seconds after the cut. TCP resends what the cut held on its
backed-off timer (0.2, 0.6, 1.4, 3.0 s after a segment's first send), so WRITEs can stay
in flight well after the link is back (the chaos checker's cut bound allows for it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
from helpers.faults import netns_pair  # noqa: E402

SECONDS = 6.0


def _wait_up(net: object, timeout_s: float = 10.0) -> None:
    """UCX refuses a device whose link is not up yet (the veth pair's carrier comes late)."""
    deadline = time.time() + timeout_s
    for ns, dev in zip(net.ns, net.dev, strict=True):  # type: ignore[attr-defined]
        show = ["ip", "-n", ns, "link", "show", "dev", dev]
        while "state UP" not in subprocess.run(show, capture_output=True, text=True).stdout:
            if time.time() > deadline:
                sys.exit(f"{dev} in {ns} did not come up")
            time.sleep(0.05)


def main(cut_at: float, cut_s: float) -> None:
    folder = tempfile.mkdtemp(prefix="netns-cut-")
    try:
        with netns_pair() as net:
            _wait_up(net)
            procs = []
            for side, role in ((1, "target"), (0, "initiator")):
                env = dict(os.environ, UCX_TLS="tcp,self", UCX_NET_DEVICES=net.dev[side])
                cmd = ["ip", "netns", "exec", net.ns[side], sys.executable]
                cmd += [str(HERE / "peer.py"), role, folder, str(SECONDS)]
                with open(f"{folder}/{role}.out", "w") as out:
                    procs.append(
                        subprocess.Popen(
                            ["timeout", "60", *cmd], env=env, stdout=out, stderr=subprocess.STDOUT
                        )
                    )
            deadline = time.time() + 30
            while not os.path.exists(f"{folder}/t.meta"):
                if time.time() > deadline or procs[0].poll() is not None:
                    sys.exit(Path(f"{folder}/target.out").read_text()[-800:])
                time.sleep(0.05)
            time.sleep(cut_at)
            net.link(0, "down")
            cut = time.time()
            time.sleep(cut_s)
            net.link(0, "up")
            restored = time.time()
            for p in procs:
                p.wait(70)
        print(f"link down {cut_s:.2f} s (restored {restored - cut:.2f} s after the cut)")
        for line in Path(f"{folder}/initiator.out").read_text().splitlines():
            if not line.startswith("W "):
                continue
            _, i, posted, ended, state = line.split()
            post, end = float(posted) - cut, float(ended) - cut
            if -0.5 < post < restored - cut + 1.0 or end - post > 0.1:
                print(f"WRITE {i}: posted {post:+.2f} s, ended {end:+.2f} s, {state}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    args = [float(a) for a in sys.argv[1:3]]
    main(*(args + [1.5, 1.5][len(args) :]))
