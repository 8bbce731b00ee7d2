"""A server as a detached daemon: launched, found again, waited for, stopped.

A ``ServerKind`` says how one server (PostgreSQL, Valkey, NATS) is launched, probed, prepared and
stopped; ``ensure_running`` starts it, or reuses the one a recorded pid and port name. Each is
started through ``/bin/sh -c '... &'`` in a new session (``spawn_detached``), so it is never this
process's child: no zombie, no ``ResourceWarning``, no tie to the terminal. Also here: the small
process, port and socket helpers the servers' probes share.
"""

from __future__ import annotations

import os
import pwd
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aivedio.errors import AivedioError

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.05
LOG_TAIL_CHARS = 2000


class ServicesError(AivedioError):
    """An embedded server could not be found, started or stopped."""


@dataclass(frozen=True, slots=True)
class ServerKind:
    name: str  # state key and folder name
    title: str  # for messages
    process_name: str  # found in /proc/PID/cmdline of the server
    stop_signal: signal.Signals
    launch: Callable[[Path, int], int]  # (folder, port) -> pid, returns at once
    probe: Callable[[int], bool]  # does the port answer like this server, ready for work?
    prepare: Callable[[int], None]  # once ready: e.g. create the database
    url: Callable[[int], str]
    log_name: str


def no_prepare(port: int) -> None:
    return None


def ensure_running(
    kind: ServerKind, folder: Path, record: dict[str, int | None]
) -> tuple[int, int]:
    pid, port = record.get("pid"), record.get("port")
    log = folder / kind.log_name
    if pid:
        if port and is_ours(kind, pid) and kind.probe(port):
            kind.prepare(port)
            return pid, port
        stop(kind, pid, log)  # hung, or dying: wait for it, then start afresh
    attempts = 3
    for attempt in range(1, attempts + 1):
        if not (port and port_free(port)):
            port = free_port()
        pid = kind.launch(folder, port)
        died = wait_ready(kind, pid, port, log)
        if not died:
            try:
                kind.prepare(port)
            except BaseException:
                stop(kind, pid, log)  # not recorded yet: down() could not find it
                raise
            return pid, port
        if attempt == attempts or port_free(port):
            raise ServicesError(
                f"{kind.title} exited during startup (pid {pid}, port {port}); "
                f"see {log}:\n{tail(log)}"
            )
        port = None  # someone took the port between our check and the server's bind
    raise AssertionError("unreachable")


def wait_ready(kind: ServerKind, pid: int, port: int, log: Path) -> bool:
    """Block until the server answers; True if it died first. Raises on timeout."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if not alive(pid):
            return True
        if kind.probe(port) and alive(pid):
            return False
        if time.monotonic() > deadline:
            stop(kind, pid, log)
            raise ServicesError(
                f"{kind.title} did not accept connections on {HOST}:{port} within "
                f"{START_TIMEOUT_S:.0f}s; see {log}:\n{tail(log)}"
            )
        time.sleep(POLL_S)


def stop(kind: ServerKind, pid: int, log: Path) -> None:
    """Graceful signal, then SIGKILL after STOP_TIMEOUT_S; only if ``pid`` still runs ``kind``."""
    if not alive(pid):
        return
    cmdline = read_cmdline(pid)
    if cmdline == b"":  # exiting (its memory is gone, it is not a zombie yet): let it finish
        wait_gone(pid, STOP_TIMEOUT_S)
        return
    if cmdline is not None and kind.process_name.encode() not in cmdline:
        return  # the pid now belongs to another program
    for sig, wait_s in ((kind.stop_signal, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if wait_gone(pid, wait_s):
            return
    raise ServicesError(f"{kind.title} (pid {pid}) did not stop; see {log}")


def wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


# --- processes, ports, sockets ---------------------------------------------------------------

# ``cmd &`` in a non-interactive shell: the server is the shell's child, the shell exits at once,
# the server is re-parented to init. $! is the server's pid (the background child execs it).
_DETACH_SCRIPT = 'log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'


def spawn_detached(argv: list[str], log: Path, cwd: Path, owner: pwd.struct_passwd | None) -> int:
    result = subprocess.run(  # noqa: S603
        ["/bin/sh", "-c", _DETACH_SCRIPT, "sh", str(log), *argv],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
        start_new_session=True,
        user=owner.pw_uid if owner else None,
        group=owner.pw_gid if owner else None,
        extra_groups=[] if owner else None,
    )
    try:
        return int(result.stdout.strip())
    except ValueError:
        raise ServicesError(
            f"could not launch {argv[0]}: {result.stderr.strip() or result.stdout.strip()}"
        ) from None


def alive(pid: int) -> bool:
    """Is ``pid`` a running process? Zombies are dead (PID 1 may never reap them)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        proc_stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc (macOS): kill(0) is all we have
    return proc_stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def read_cmdline(pid: int) -> bytes | None:
    """``/proc/PID/cmdline``; None where there is no /proc (macOS) or it cannot be read."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def is_ours(kind: ServerKind, pid: int) -> bool:
    """Alive and running the expected program (a recorded pid may have been reused)."""
    if not alive(pid):
        return False
    cmdline = read_cmdline(pid)
    return cmdline is None or kind.process_name.encode() in cmdline


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def recv_line(sock: socket.socket, limit: int = 65536) -> bytes:
    data = b""
    while not data.endswith(b"\r\n") and len(data) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def run_checked(argv: list[str], what: str) -> str:
    result = subprocess.run(  # noqa: S603
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )
    if result.returncode != 0:
        raise ServicesError(f"{what} failed: {result.stderr.strip()}")
    return result.stdout


def tail(log: Path) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-LOG_TAIL_CHARS:]
