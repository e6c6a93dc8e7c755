"""Processes for the real-server stage: own session, log file, hard deadline, stop by pid.

Every process is started with ``start_new_session=True``, so it leads its own process group
and everything it forks (SGLang's scheduler, detokenizer and TP rank processes) is in that
group. ``stop()`` signals the group by its id -- SIGTERM, a grace period, then SIGKILL.
The deadline is enforced twice: the command runs under coreutils ``timeout`` (which signals
the whole group when it expires, even if pytest itself was killed), and a watchdog thread
here SIGKILLs the group shortly after, as a backstop. Output goes to one log file per
process; ``tail()`` reads it back for failure reports.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import requests

from sgl_nixl_plugin.bench.ports import free_ports  # noqa: F401  (the stage's port picks)


class ManagedProcess:
    """One command in its own process group, logging to ``log_path``, killed at a deadline."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        log_path: Path,
        deadline_s: float,
        cwd: Path,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        timeout = shutil.which("timeout")
        launch = self.argv
        if timeout:
            launch = [timeout, "-k", "15", str(int(deadline_s)), *self.argv]
        self.log_path = log_path
        self.deadline_s = deadline_s
        self.started_at = time.monotonic()
        self.killed_by_watchdog = False
        with open(log_path, "wb") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self.popen = subprocess.Popen(
                launch,
                env=dict(env),
                cwd=str(cwd),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pgid = self.popen.pid  # session leader: its pid is the group id
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name=f"watchdog-{name}", daemon=True)
        self._watchdog.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _watch(self) -> None:
        if not self._stopped.wait(self.deadline_s + 30):
            self.killed_by_watchdog = True
            self._append_note(f"watchdog: {self.name} outlived its {self.deadline_s:.0f}s deadline")
            self._signal_group(signal.SIGKILL)

    def _append_note(self, text: str) -> None:
        try:
            with open(self.log_path, "a") as log:
                log.write(f"\n[realserver-test] {text}\n")
        except OSError:
            pass

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def alive(self) -> bool:
        return self.popen.poll() is None

    def describe_exit(self) -> str:
        rc = self.popen.poll()
        if rc is None:
            return f"{self.name} (pid {self.pid}) is running"
        how = ""
        if self.killed_by_watchdog:
            how = " (killed by the test's watchdog)"
        elif rc in (124, 137):
            how = f" (its {self.deadline_s:.0f}s deadline expired, or it was SIGKILLed)"
        return f"{self.name} (pid {self.pid}) exited with code {rc}{how}"

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the group, wait up to ``grace_s``, then SIGKILL whatever is left."""
        if not self._stopped.is_set():
            self._stopped.set()
            if self.alive():
                self._signal_group(signal.SIGTERM)
                try:
                    self.popen.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            # The leader may be gone while forked children of the group still run.
            self._signal_group(signal.SIGKILL)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._append_note(f"{self.name} (pid {self.pid}) did not exit after SIGKILL")
        self._watchdog.join(timeout=1)

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<cannot read {self.log_path}: {exc}>"

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def wait_http_ok(
    url: str,
    proc: ManagedProcess,
    timeout_s: float,
    others: Sequence[ManagedProcess] = (),
    poll_s: float = 0.5,
) -> float:
    """Poll ``url`` until it answers 200; return seconds waited.

    Fails early, with the reason, when ``proc`` (or any of ``others``) exits first.
    """
    start = time.monotonic()
    deadline = start + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        for p in (proc, *others):
            if not p.alive():
                raise RuntimeError(f"{p.describe_exit()} while waiting for {url}")
        try:
            resp = requests.get(url, timeout=5)
            if resp.status_code == 200:
                return time.monotonic() - start
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
        except requests.RequestException as exc:
            last = f"{type(exc).__name__}"
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s (last: {last})")


class ProcessGroup:
    """The processes of one module: stopped together, their logs reported together."""

    def __init__(self, log_dir: Path, cwd: Path) -> None:
        self.log_dir = log_dir
        self.cwd = cwd
        self.procs: list[ManagedProcess] = []

    def start(
        self, name: str, argv: Sequence[str], env: Mapping[str, str], deadline_s: float
    ) -> ManagedProcess:
        log_path = self.log_dir / f"{len(self.procs):02d}-{name}.log"
        proc = ManagedProcess(name, argv, env, log_path, deadline_s, self.cwd)
        self.procs.append(proc)
        return proc

    def stop(self, procs: Sequence[ManagedProcess] | None = None) -> None:
        targets = list(self.procs if procs is None else procs)
        threads = [threading.Thread(target=p.stop) for p in targets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def report(self, lines: int = 60) -> str:
        """Tail of every process's log (the ones already stopped too)."""
        parts = [f"realserver logs: {self.log_dir}"]
        for p in self.procs:
            parts.append(
                f"===== {p.name}: {p.describe_exit()}; log {p.log_path} (last {lines} lines)"
            )
            parts.append(p.tail(lines))
        return "\n".join(parts)
