"""Which of Ray's ports on this machine listen on every interface, for `/healthz`'s warnings.

`cosyvoice-serve run` with HTTP on a loopback host binds Ray's ports of its node to loopback (`RAY_LOOPBACK_ENV`);
elsewhere Ray 2.60 binds its GCS, raylet, workers and metrics exporters to every interface, and each Serve replica's
inter-deployment gRPC server listens on [::] whatever the node address (no setting changes it). What listens on
every interface is listed here, so an operator sees it (docs/security.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Ray's switch for the node address it picks: "0" makes a single-node Ray take the loopback address, and then every
# one of its processes binds loopback (GCS, raylet, workers, the metrics exporters). Its name is about clusters on
# macOS and Windows, whose default it is; Ray 2.60 reads it in every process it starts.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
# The ports a node lists (ray.nodes()), by what listens there.
NODE_PORTS = {
    "NodeManagerPort": "raylet",
    "ObjectManagerPort": "object manager",
    "MetricsExportPort": "metrics (Prometheus)",
    "MetricsAgentPort": "metrics agent",
    "DashboardAgentListenPort": "dashboard agent",
    "RuntimeEnvAgentPort": "runtime env agent",
}
TCP_LISTEN = "0A"


@dataclass(frozen=True)
class ListeningSocket:
    address: ipaddress.IPv4Address | ipaddress.IPv6Address
    port: int
    inode: int


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def is_loopback(host: str) -> bool:
    name = host.strip().strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def listening_sockets() -> list[ListeningSocket]:
    """Every TCP socket listening on this machine (Linux: /proc/net/tcp and tcp6; none elsewhere)."""
    sockets = []
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == TCP_LISTEN:
                address, port = fields[1].split(":")
                sockets.append(ListeningSocket(_address(address), int(port, 16), int(fields[9])))
    return sockets


def on_every_interface(ports: Iterable[int]) -> set[int]:
    """Those of `ports` that a socket listens on with the wildcard address (0.0.0.0 or ::)."""
    wanted = set(ports)
    return {socket.port for socket in listening_sockets() if socket.address.is_unspecified and socket.port in wanted}


def process_tree(root: int) -> set[int]:
    """`root` and every process it started, and they started (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # the command name (in parentheses) may hold spaces: the fields after it are split
            parents[int(stat.parent.name)] = int(stat.read_text().rpartition(")")[2].split()[1])
    tree = {root}
    while grown := {pid for pid, parent in parents.items() if parent in tree} - tree:
        tree |= grown
    return tree


def socket_owners(pids: Iterable[int]) -> dict[int, int]:
    """socket inode -> the process of `pids` that holds it (those whose file descriptors can be read)."""
    owners = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if (target := os.readlink(fd)).startswith("socket:["):
                        owners[int(target[len("socket:[") : -1])] = pid
    return owners


def process_title(pid: int) -> str:
    """What a process calls itself (Ray's workers: `ray::ServeReplica:<app>:<deployment>`, without the `.<method>`
    Ray adds while one runs)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return f"process {pid}"
    return title.partition(".")[0] if title.startswith("ray::") else title


def ray_ports() -> dict[int, str]:
    """The ports of this Ray node's services, by what listens there (the GCS and the head's metrics servers too: on
    another node nothing of Ray's listens on those)."""
    import ray
    from ray.autoscaler._private.constants import AUTOSCALER_METRIC_PORT
    from ray.dashboard.consts import DASHBOARD_METRIC_PORT

    context = ray.get_runtime_context()
    ports = {int(context.gcs_address.rpartition(":")[2]): "GCS"}
    ports |= {AUTOSCALER_METRIC_PORT: "autoscaler metrics", DASHBOARD_METRIC_PORT: "dashboard metrics"}
    for node in ray.nodes():
        if node["NodeID"] == context.get_node_id():
            ports |= {node[field]: name for field, name in NODE_PORTS.items() if node.get(field)}
    return ports


def exposed_ray_ports() -> dict[int, str]:
    """Ray's ports on this machine that listen on every interface, by what listens there: its services' (`ray_ports`),
    and any of a process its raylet started (workers, Serve's replicas, Ray's agents); this process is one of them.
    Nothing outside a Ray worker."""
    import ray

    if not ray.is_initialized():
        return {}
    named = ray_ports()
    owners = socket_owners(process_tree(os.getppid()))  # a worker's parent is its node's raylet
    return {
        socket.port: named.get(socket.port) or process_title(owners[socket.inode])
        for socket in listening_sockets()
        if socket.address.is_unspecified and (socket.port in named or socket.inode in owners)
    }


def exposure_warning() -> str | None:
    """What `/healthz` warns of Ray's ports listening on every interface here; None when none does."""
    exposed = exposed_ray_ports()
    if not exposed:
        return None
    listed = ", ".join(f"{port} ({exposed[port]})" for port in sorted(exposed))
    return (
        f"Ray's ports {listed} listen on every interface, where anyone who reaches this machine connects to them (its "
        "metrics tell node, session and worker ids and request counts; without Ray's token auth its GCS and raylet run "
        f"code); `cosyvoice-serve run` on a loopback host binds Ray's own to loopback ({RAY_LOOPBACK_ENV}=0) but not "
        "Serve's replica gRPC servers, which Ray 2.60 binds to [::] whatever it is told: keep the machine behind a "
        "firewall or on a private network (docs/security.md)"
    )
