"""What a chaos run is given (``ChaosConfig``) and what it holds while it goes (``Run``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aivedio.chaos.proxy import TcpProxy
from aivedio.chaos.schedule import Fault, FaultKind
from aivedio.cluster import Cluster
from aivedio.config import ServicesConfig, Settings


@dataclass(frozen=True, slots=True)
class ChaosConfig:
    seed: int = 1
    tasks: int = 40
    projects: int = 3
    replicas: int = 2
    split: bool = False
    nats_cluster: int = 0
    window_s: float = 60.0  # faults happen within this window
    interval_s: float = 6.0  # about one fault this often
    create_share: float = 0.6  # tasks are created over this share of the window
    converge_timeout_s: float = 180.0
    catch_up_timeout_s: float = 60.0
    kinds: tuple[FaultKind, ...] = tuple(FaultKind)
    data_dir: Path | None = None  # None: a temporary folder, removed after a passing run
    keep: bool = False  # keep the data folder (logs) even after a passing run


@dataclass
class Created:
    task_id: str
    project_id: str
    key: str
    client_request_id: str | None = None


@dataclass
class Run:
    config: ChaosConfig
    rng: random.Random
    folder: Path
    services: ServicesConfig
    settings: Settings
    proxies: dict[str, TcpProxy] = field(default_factory=dict)
    cluster: Cluster | None = None
    projects: list[dict[str, Any]] = field(default_factory=list)
    created: list[Created] = field(default_factory=list)
    faults_done: list[tuple[Fault, str]] = field(default_factory=list)
    last_fault_end: float = 0.0
    real_database_url: str = ""
