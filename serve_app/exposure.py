"""Which of Ray's ports on this machine listen on every interface, for `/healthz`'s warnings.

`cosyvoice-serve run` with HTTP on a loopback host binds every Ray port of its node to loopback (`RAY_LOOPBACK_ENV`);
elsewhere Ray 2.60 binds its GCS, raylet, workers and metrics exporters to every interface: what cannot be bound
otherwise is listed here, so an operator sees it (docs/security.md).
"""

from __future__ import annotations

import ipaddress
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


def exposure_warning() -> str | None:
    """What `/healthz` warns of Ray's ports listening on every interface here; None when none does."""
    ports = ray_ports()
    exposed = sorted(on_every_interface(ports))
    if not exposed:
        return None
    listed = ", ".join(f"{port} ({ports[port]})" for port in exposed)
    return (
        f"Ray's ports {listed} listen on every interface: anyone who reaches this machine reads its metrics (node, "
        "session and worker ids, request counts), and without Ray's token auth runs code in it; `cosyvoice-serve run` "
        f"on a loopback host binds them to loopback ({RAY_LOOPBACK_ENV}=0), a cluster needs a private network or a "
        "firewall (docs/security.md)"
    )
