"""``aivedio cluster``: N supervised processes of every role on one machine.

Default layout: ``--replicas N`` processes of ``aivedio run --role all --reuse-port`` on one port
(the kernel spreads connections over them). ``--split``: one process kind per role instead, N
processes each (the HTTP roles api, callbacks and gateway share a kind and the port). The
services are the configured ones (``AIVEDIO_*_URL``) or the embedded servers (started if they do
not run); ``--nats-cluster 3`` runs a real three-node JetStream cluster instead of one NATS server
and the streams get three replicas (``AIVEDIO_BUS_REPLICAS``), so losing one node loses nothing.
``--sandbox`` also runs the sandbox provider, for the demo and ``aivedio chaos``.

Every process the cluster starts is supervised: when one exits (a crash, a SIGKILL, an exit for a
configuration error) it is started again after a jittered, capped exponential backoff
(:func:`aivedio.process.restart.restart_delay`, as for a failed role loop), reset after a
healthy spell. Ctrl-C (or SIGTERM) stops every process:
SIGTERM, then SIGKILL after ``stop_timeout_s``. The embedded PostgreSQL, Valkey and single NATS
keep running, as after ``aivedio demo`` (``aivedio services down`` stops them); the cluster's own
NATS nodes stop with it.

One JSON line is printed once everything was started: the URLs, and each process with its roles,
pid and log file; ``<data_dir>/cluster/cluster.json`` holds the same, rewritten at every restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aivedio.admin import run_migrate
from aivedio.config import Settings
from aivedio.logs import log, setup_logging
from aivedio.process.restart import RestartPolicy, consecutive_failures, restart_delay
from aivedio.runtime import resolve_urls
from aivedio.services import nats_cluster
from aivedio.services.embedded import ServiceUrls

__all__ = [
    "SPLIT_KINDS",
    "Cluster",
    "ClusterConfig",
    "Member",
    "run_cluster",
]

logger = logging.getLogger("aivedio.cluster")

# --split: one process kind per role; the HTTP roles share the port, hence one kind.
SPLIT_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("http", ("api", "callbacks", "gateway")),
    ("inbox", ("inbox",)),
    ("submitter", ("submitter",)),
    ("poller", ("poller",)),
    ("relay", ("relay",)),
    ("dispatcher", ("dispatcher",)),
    ("media", ("media",)),
    ("billing", ("billing",)),
    ("reconciler", ("reconciler", "maintenance")),
)
HTTP_ROLES = frozenset({"api", "callbacks", "gateway"})


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    data_dir: Path
    replicas: int = 2
    split: bool = False
    nats_cluster: int = 0  # 0: one NATS (configured or embedded); 3: a three-node cluster
    sandbox: bool = False
    port: int = 8000
    # A process that exits waits as a failed role loop does (aivedio.process.restart), but a
    # process that ran 30 s counts as healthy.
    restart: RestartPolicy = field(
        default_factory=lambda: RestartPolicy(first_s=0.5, cap_s=30.0, healthy_s=30.0)
    )
    stop_timeout_s: float = 20.0
    extra_env: Mapping[str, str] = field(default_factory=dict)  # for every process started


@dataclass
class Member:
    """One supervised process."""

    name: str
    kind: str  # "role", "sandbox" or "nats"
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    roles: tuple[str, ...] = ()
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    failures: int = 0  # exits in a row without a healthy spell
    restarts: int = 0
    exits: list[int] = field(default_factory=list)  # return codes, newest last

    @property
    def pid(self) -> int | None:
        if self.proc is None or self.proc.returncode is not None:
            return None
        return self.proc.pid

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "roles": list(self.roles),
            "pid": self.pid,
            "restarts": self.restarts,
            "log": str(self.log_path),
        }


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the cluster process dies (Linux), so a cluster
    that was SIGKILLed leaves no orphaned role processes behind."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Cluster:
    """Start with ``await start()``, supervise with ``await run(stopping)`` (it stops every
    process when ``stopping`` is set). ``members`` and ``urls`` are for callers such as
    ``aivedio chaos``; ``restarted`` is set (and replaced) whenever a process was started again."""

    def __init__(self, settings: Settings, config: ClusterConfig) -> None:
        self.settings = settings
        self.config = config
        self.folder = config.data_dir.expanduser().resolve() / "cluster"
        self.members: list[Member] = []
        self.urls: ServiceUrls | None = None
        self.sandbox_url: str | None = None
        self.nats_nodes: list[nats_cluster.NatsNode] = []
        self.rand = random.Random()
        self._stopping = asyncio.Event()
        self._keepers: list[asyncio.Task[None]] = []

    @property
    def api_url(self) -> str:
        return f"http://{self.settings.host}:{self.config.port}"

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Services, migrations, then every process; returns once all were launched."""
        self.folder.mkdir(parents=True, exist_ok=True)
        settings = self.settings.model_copy(update={"data_dir": self.config.data_dir.resolve()})
        nats_members: list[Member] = []
        if self.config.nats_cluster:
            self.nats_nodes = nats_cluster.plan_nodes(
                self.folder / "nats", self.config.nats_cluster
            )
            nats_members = [
                Member(
                    name=f"nats-{node.name}",
                    kind="nats",
                    argv=nats_cluster.node_argv(node, self.nats_nodes),
                    env=dict(os.environ),
                    log_path=self.folder / f"nats-{node.name}.log",
                )
                for node in self.nats_nodes
            ]
            settings = settings.model_copy(
                update={"nats_url": nats_cluster.cluster_url(self.nats_nodes)}
            )
        self.urls = await asyncio.to_thread(resolve_urls, settings)
        settings = settings.model_copy(update=self.urls.as_dict())
        await run_migrate(settings)
        if self.config.sandbox:
            self.sandbox_url = settings.sandbox_url
            if "sandbox_url" not in self.settings.model_fields_set:
                self.sandbox_url = f"http://127.0.0.1:{_free_port()}"
        env = self._child_env(settings)
        self.members = [*nats_members, *self._role_members(env)]
        if self.sandbox_url is not None:
            self.members.append(
                Member(
                    name="sandbox",
                    kind="sandbox",
                    argv=[sys.executable, "-m", "aivedio", "sandbox-provider"],
                    env=env,
                    log_path=self.folder / "sandbox.log",
                )
            )
        for member in nats_members:
            await self._launch(member)
        if nats_members:
            await self._wait_nats_ready()
        for member in self.members:
            if member.kind != "nats":
                await self._launch(member)
        self._write_state()

    def _child_env(self, settings: Settings) -> dict[str, str]:
        assert self.urls is not None
        env = dict(os.environ) | dict(self.config.extra_env)
        env |= {
            "AIVEDIO_DATABASE_URL": self.urls.database_url,
            "AIVEDIO_REDIS_URL": self.urls.redis_url,
            "AIVEDIO_NATS_URL": self.urls.nats_url,
            "AIVEDIO_DATA_DIR": str(settings.data_dir),
            "AIVEDIO_PORT": str(self.config.port),
        }
        if self.config.nats_cluster:
            env["AIVEDIO_BUS_REPLICAS"] = str(min(3, self.config.nats_cluster))
        if self.sandbox_url is not None:
            env["AIVEDIO_SANDBOX_URL"] = self.sandbox_url
        return env

    def _role_members(self, env: dict[str, str]) -> list[Member]:
        kinds: Sequence[tuple[str, tuple[str, ...]]] = (
            SPLIT_KINDS if self.config.split else (("all", ("all",)),)
        )
        members = []
        for kind, roles in kinds:
            for n in range(1, self.config.replicas + 1):
                argv = [sys.executable, "-m", "aivedio", "run", "--role", ",".join(roles)]
                if "all" in roles or HTTP_ROLES & set(roles):
                    argv += ["--port", str(self.config.port), "--reuse-port"]
                members.append(
                    Member(
                        name=f"{kind}-{n}",
                        kind="role",
                        argv=argv,
                        env=env,
                        log_path=self.folder / f"{kind}-{n}.log",
                        roles=roles,
                    )
                )
        return members

    async def _wait_nats_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not all(await asyncio.gather(*(asyncio.to_thread(n.ready) for n in self.nats_nodes))):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the NATS cluster did not start; see {self.folder}")
            await asyncio.sleep(0.2)

    async def _launch(self, member: Member) -> None:
        with member.log_path.open("ab") as out:
            out.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting\n".encode())
            out.flush()
            member.proc = await asyncio.create_subprocess_exec(
                *member.argv,
                env=member.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # Ctrl-C reaches the cluster, which stops them in order
                preexec_fn=_die_with_parent,
            )
        member.started_at = time.monotonic()

    # -- supervise ------------------------------------------------------------------------------

    async def run(self, stopping: asyncio.Event) -> None:
        """Keep every process running until ``stopping`` is set, then stop them all."""
        self._keepers = [asyncio.create_task(self._keep(m)) for m in self.members]
        try:
            await stopping.wait()
        finally:
            self._stopping.set()
            await self.stop()
            for keeper in self._keepers:
                keeper.cancel()
            await asyncio.gather(*self._keepers, return_exceptions=True)

    async def _keep(self, member: Member) -> None:
        cfg = self.config
        while not self._stopping.is_set():
            proc = member.proc
            if proc is None:
                await self._launch(member)
                continue
            code = await proc.wait()
            if self._stopping.is_set():
                return
            member.exits.append(code)
            ran_s = time.monotonic() - member.started_at
            member.failures = consecutive_failures(member.failures, ran_s, cfg.restart)
            delay = restart_delay(member.failures, cfg.restart, self.rand.random())
            log(
                logger,
                logging.WARNING,
                "cluster process exited; restarting",
                process=member.name,
                code=code,
                in_s=round(delay, 2),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            await self._launch(member)
            member.restarts += 1
            self._write_state()

    async def stop(self) -> None:
        """SIGTERM every process (roles first, NATS nodes last), SIGKILL what is left."""
        order = ("role", "sandbox", "nats")
        for kind in order:
            group = [m for m in self.members if m.kind == kind and m.pid is not None]
            for member in group:
                assert member.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    member.proc.send_signal(signal.SIGTERM)
            for member in group:
                assert member.proc is not None
                try:
                    await asyncio.wait_for(member.proc.wait(), self.config.stop_timeout_s)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        member.proc.kill()
                    await member.proc.wait()

    # -- describe -------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        assert self.urls is not None
        return {
            "api": self.api_url,
            **self.urls.as_dict(),
            "sandbox_url": self.sandbox_url,
            "replicas": self.config.replicas,
            "split": self.config.split,
            "nats_nodes": [n.url for n in self.nats_nodes],
            "processes": [m.describe() for m in self.members],
            "data_dir": str(self.config.data_dir.resolve()),
        }

    def _write_state(self) -> None:
        path = self.folder / "cluster.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.describe(), indent=2) + "\n")
        tmp.replace(path)


async def _main(settings: Settings, config: ClusterConfig) -> int:
    cluster = Cluster(settings, config)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await cluster.start()
    except BaseException:
        await cluster.stop()
        raise
    print(json.dumps(cluster.describe()), flush=True)
    await cluster.run(stopping)
    return 0


def run_cluster(settings: Settings, config: ClusterConfig) -> int:
    setup_logging(settings.log_level)
    code: int = asyncio.run(_main(settings, config))
    return code
