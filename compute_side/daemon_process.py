"""Starts a storage daemon as a child process, for the embedded default and for tests."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from compute_side.client import StorageClient, StorageNodeError

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class LocalDaemon:
    url: str
    pid: int  # also its process group's id: signal the group to fault the node whole


@contextmanager
def local_daemon(store_url: str, log_path: Path, extra_args: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, start_timeout_s: float = 60.0,
                 cpus: set[int] | None = None) -> Iterator[str]:
    """Run ``python -m storage_side`` on a free loopback port; yield its URL; stop it after."""
    with local_daemon_process(store_url, log_path, extra_args, env, start_timeout_s, cpus) as daemon:
        yield daemon.url


@contextmanager
def local_daemon_process(store_url: str, log_path: Path, extra_args: tuple[str, ...] = (),
                         env: dict[str, str] | None = None, start_timeout_s: float = 60.0,
                         cpus: set[int] | None = None) -> Iterator[LocalDaemon]:
    """``local_daemon``, yielding its process id too (fault injection kills or stops it).

    The daemon gets its own session so a Ctrl-C reaches only us, and we stop it with
    SIGTERM (gunicorn's graceful shutdown) whatever happens, killing it if it lingers.
    Should we die without a word (kill -9), the kernel sends it SIGTERM (Linux). ``cpus``
    pins it to those cores, to emulate a storage host beside the compute host.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "storage_side", "--store", store_url, "--port", str(port), *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    parent = os.getpid()
    with open(log_path, "ab") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})}, start_new_session=True,
                                   preexec_fn=lambda: _in_child(parent, cpus))
    try:
        _wait_healthy(process, url, log_path, start_timeout_s)
        log.info("storage daemon pid %d at %s (log: %s)", process.pid, url, log_path)
        yield LocalDaemon(url, process.pid)
    finally:
        stop_process_group(process)


def _in_child(parent: int, cpus: set[int] | None) -> None:
    """Runs in the daemon's process before it execs: dies with ``parent``, on ``cpus``."""
    if sys.platform == "linux":
        # PR_SET_PDEATHSIG fires when the thread that started the child exits: start local
        # daemons from a thread that lives as long as the run (the main thread does).
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)
    if cpus:
        os.sched_setaffinity(0, cpus)


def _wait_healthy(process: subprocess.Popen, url: str, log_path: Path, timeout_s: float) -> None:
    client = StorageClient(url, timeout_s=2, retries=0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"storage daemon exited with {process.returncode}; last log lines:\n"
                               + _tail(log_path))
        try:
            client.health()
            return
        except StorageNodeError:
            time.sleep(0.2)
    raise RuntimeError(f"storage daemon not healthy after {timeout_s:.0f} s; last log lines:\n" + _tail(log_path))


def stop_process_group(process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM the process's group and wait until every process in it is gone, SIGKILL what
    lingers. The daemon leads the group; its decode workers and multiprocessing's resource
    tracker (which ignores SIGTERM and leaves once the daemon's end of its pipe closes)
    outlive it by a moment."""
    _signal_group(process.pid, signal.SIGTERM)
    if not _group_gone(process, timeout_s):
        _signal_group(process.pid, signal.SIGKILL)
        if not _group_gone(process, timeout_s):
            log.warning("process group %d outlived SIGKILL by %.0f s", process.pid, timeout_s)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the whole group is gone already
        os.killpg(pgid, signum)


def _group_gone(process: subprocess.Popen, timeout_s: float) -> bool:
    """Whether the group led by ``process`` empties within ``timeout_s`` (reaping its leader)."""
    deadline = time.monotonic() + timeout_s
    while True:
        process.poll()  # a leader that exited stays in the group until it is reaped
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
