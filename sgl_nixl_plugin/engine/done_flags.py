"""Completion flags for one-pass rooms: the prefill's copy stream tells the decode "done".

A one-pass room otherwise ends with the prefill polling the copy's event, encoding a status
and sending it over ZMQ, ~0.45 ms after the copy on an H200. Here the decode owns a small
board of 32-bit words in a file under ``/dev/shm`` (``FlagBoard``). Per room and prefill
rank it hands out a word and a value never used before on this board; a prefill on the same
host maps the board, registers it with CUDA (``FlagWriter``) and, once the room's aux rows
and state have landed, stores the value on the stream that runs the room's copies.
``cuStreamWriteValue32`` fences the copies' writes before the store, so a decode that reads
the value can use the pages (measured: seen in the other process as the writer's event
completes, every byte there; ``benchmarks/gpu_flag_probe.py``).

The flag only shortens the wait: the status message still follows, and a word that is
never written (or overwritten late by a room that ended) leaves the decode waiting for it.
A value matches one hand-out only, so a late write can delay a room, never complete it.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import re
import secrets
import stat
import threading
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

DIRECTORY = "/dev/shm"
#: the only paths a prefill opens: a forged registration cannot aim its writes elsewhere
PATH_PATTERN = r"^/dev/shm/sgl-nixl-flags-[0-9]{1,10}-[0-9a-f]{16}$"
_PATH_RE = re.compile(PATH_PATTERN)
WORD = 4  # bytes per flag
DEFAULT_SLOTS = 1 << 16
MAX_SLOTS = 1 << 20


class FlagError(RuntimeError):
    """A board could not be made or opened; the status message carries the rooms."""


class FlagBoard:
    """The decode's board: ``slots`` words, handed out per room and prefill rank.

    Thread-safe (the scheduler thread takes and frees words; ``seen`` reads one word).
    Freed words go to the back of the queue, so a word is reused only after every other
    word was handed out once more.
    """

    def __init__(self, slots: int = DEFAULT_SLOTS, directory: str = DIRECTORY) -> None:
        if not 0 < slots <= MAX_SLOTS:
            raise ValueError(f"a flag board holds 1 to {MAX_SLOTS} words, not {slots}")
        self.slots = slots
        remove_stale(directory)
        name = f"sgl-nixl-flags-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = os.path.join(directory, name)
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise FlagError(f"cannot create {self.path}: {exc}") from exc
        try:
            os.ftruncate(fd, slots * WORD)
            self._mm = mmap.mmap(fd, slots * WORD)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.path)
            raise FlagError(f"cannot map {self.path}: {exc}") from exc
        os.close(fd)
        self.words = np.frombuffer(self._mm, dtype=np.int32)
        self._free: collections.deque[int] = collections.deque(range(slots))
        self._next = 1
        self._lock = threading.Lock()
        self._closed = False

    def take(self) -> tuple[int, int] | None:
        """A free word and the value a prefill will store there, or None when none is
        free (the room then waits for its status message)."""
        with self._lock:
            if self._closed or not self._free:
                return None
            slot = self._free.popleft()
            value = self._next
            self._next = self._next + 1 if self._next < 0x7FFFFFFF else 1
            return slot, value

    def seen(self, slot: int, value: int) -> bool:
        """Whether the word holds ``value`` (a prefill stored it after the room's data)."""
        return not self._closed and int(self.words[slot]) == value

    def free(self, slot: int) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(slot)

    @property
    def in_use(self) -> int:
        with self._lock:
            return self.slots - len(self._free)

    def close(self) -> None:
        """Unmap and remove the file (idempotent); prefills that mapped it keep their
        mapping until they close it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.words = np.zeros(0, dtype=np.int32)
        try:
            self._mm.close()
        except BufferError:  # a view is still alive somewhere: the process exit frees it
            logger.debug("sgl-nixl: flag board %s left mapped", self.path)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def remove_stale(directory: str = DIRECTORY) -> int:
    """Remove the boards of this user whose decode process is gone (killed before it could
    remove its own); how many. A board of a live process in another pid namespace may go
    too: mappings made survive, and a prefill that cannot open it uses the status only."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        if not _PATH_RE.match(path):
            continue
        pid = int(name.split("-")[3])
        try:
            if os.stat(path, follow_symlinks=False).st_uid != os.getuid() or _alive(pid):
                continue
            os.unlink(path)
            removed += 1
        except OSError:
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check_path(path: str, slots: int) -> str | None:
    """None when ``path`` names a flag board of ``slots`` words a prefill may open, else
    why not (before anything is opened)."""
    if not _PATH_RE.match(path):
        return f"{path!r} is not a flag board path"
    if not 0 < slots <= MAX_SLOTS:
        return f"{slots} words is out of range"
    return None


class FlagWriter:
    """A decode's board mapped by a prefill and registered with CUDA on ``device``:
    ``write`` stores a value on a stream after the work queued there."""

    def __init__(self, path: str, slots: int, device: int) -> None:
        why = check_path(path, slots)
        if why is not None:
            raise FlagError(why)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise FlagError(f"cannot open {path}: {exc}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise FlagError(f"{path} is not a regular file of this user")
            if st.st_size != slots * WORD:
                raise FlagError(f"{path} holds {st.st_size} bytes, not {slots * WORD}")
            self._mm = mmap.mmap(fd, slots * WORD)
        except OSError as exc:
            raise FlagError(f"cannot map {path}: {exc}") from exc
        finally:
            os.close(fd)
        self.path, self.slots, self.device = path, slots, device
        self._words = np.frombuffer(self._mm, dtype=np.int32)
        self._host = self._words.ctypes.data
        self._lock = threading.Lock()
        try:
            self._dev = _register(self._host, slots * WORD, device)
        except Exception:
            self._words = np.zeros(0, dtype=np.int32)
            self._mm.close()
            raise
        self._closed = False

    def write(self, slot: int, value: int, stream: Any) -> None:
        """Store ``value`` in word ``slot`` once the work queued on ``stream`` (a torch
        stream) so far is done, its writes fenced before the store."""
        if not 0 <= slot < self.slots:
            raise FlagError(f"flag word {slot} is outside the board ({self.slots} words)")
        from cuda.bindings import driver

        with self._lock:
            if self._closed:
                raise FlagError("the flag board is closed")
            _check(
                "cuStreamWriteValue32",
                driver.cuStreamWriteValue32(
                    driver.CUstream(int(stream.cuda_stream)),
                    driver.CUdeviceptr(self._dev + slot * WORD),
                    int(value),
                    0,  # default flags: a memory fence before the store
                ),
            )

    def close(self) -> None:
        """Unregister and unmap (idempotent). Wait for the streams that write it first."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            _unregister(self._host, self.device)
        except Exception as exc:
            logger.warning("sgl-nixl: unregistering flag board %s: %s", self.path, exc)
        self._words = np.zeros(0, dtype=np.int32)
        try:
            self._mm.close()
        except BufferError:
            logger.debug("sgl-nixl: flag board %s left mapped", self.path)


def _check(what: str, result: Any) -> tuple[Any, ...]:
    err = result[0] if isinstance(result, tuple) else result
    if int(getattr(err, "value", err)) != 0:
        raise FlagError(f"{what} failed: {getattr(err, 'name', err)}")
    return tuple(result[1:]) if isinstance(result, tuple) else ()


def _register(host: int, nbytes: int, device: int) -> int:
    """Pin ``[host, host + nbytes)`` for ``device``; the address its kernels and stream
    operations use for it."""
    from cuda.bindings import runtime

    from sgl_nixl_plugin.engine.cuda_ipc import _OnDevice

    with _OnDevice(device):
        flags = runtime.cudaHostRegisterMapped | runtime.cudaHostRegisterPortable
        _check("cudaHostRegister", runtime.cudaHostRegister(host, nbytes, flags))
        try:
            (dev,) = _check("cudaHostGetDevicePointer", runtime.cudaHostGetDevicePointer(host, 0))
        except FlagError:
            runtime.cudaHostUnregister(host)
            raise
    return int(dev)


def _unregister(host: int, device: int) -> None:
    from cuda.bindings import runtime

    from sgl_nixl_plugin.engine.cuda_ipc import _OnDevice

    with _OnDevice(device):
        _check("cudaHostUnregister", runtime.cudaHostUnregister(host))
