"""The Wyoming listener announced on the local network by mDNS as a `_wyoming._tcp` service, which is how Home
Assistant discovers Wyoming services (it then offers to add the integration), where the `zeroconf` package is
installed (the `wyoming` extra installs it). The announcement is made on the interface the listener binds: on
loopback only this machine sees it."""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zeroconf.asyncio import AsyncZeroconf

logger = logging.getLogger("ray.serve")

SERVICE_TYPE = "_wyoming._tcp.local."
MDNS_GROUP = "224.0.0.251"


def announced_address(bound: str) -> str:
    """The IPv4 address announced for a listener bound to the address `bound`: that one, or for every interface
    (0.0.0.0) the one this machine's route to the mDNS group leaves from (a UDP `connect` picks it; nothing is sent)."""
    if not ipaddress.ip_address(bound).is_unspecified:
        return bound
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((MDNS_GROUP, 1))
        return probe.getsockname()[0]


def service_name() -> str:
    """The service's instance name, which Home Assistant shows: this program on this host."""
    return f"cosyvoice-serve on {socket.gethostname()}.{SERVICE_TYPE}"


class Announcement:
    """A `_wyoming._tcp` service registered by mDNS, until `close`."""

    def __init__(self, zeroconf: AsyncZeroconf) -> None:
        self.zeroconf = zeroconf

    @classmethod
    async def start(cls, host: str, port: int) -> Announcement | None:
        """Announce the listener on `host`:`port`; None where zeroconf is not installed or the network refuses
        (logged: the listener serves all the same, Home Assistant can add it by host and port)."""
        try:
            from zeroconf import Error, InterfaceChoice, IPVersion
            from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf
        except ImportError:
            logger.info("Wyoming is not announced by mDNS: the zeroconf package is not installed")
            return None
        try:
            bound = socket.gethostbyname(host)
            address = announced_address(bound)
            every_interface = ipaddress.ip_address(bound).is_unspecified
            zeroconf = AsyncZeroconf(
                interfaces=InterfaceChoice.All if every_interface else [address], ip_version=IPVersion.V4Only
            )
            info = AsyncServiceInfo(SERVICE_TYPE, service_name(), addresses=[socket.inet_aton(address)], port=port)
            await zeroconf.async_register_service(info)
        except (OSError, Error) as exc:
            logger.warning(
                "Wyoming could not be announced by mDNS (%s); add it in Home Assistant by host and port", exc
            )
            return None
        logger.info("Wyoming announced by mDNS as %r at %s:%d", service_name(), address, port)
        return cls(zeroconf)

    async def close(self) -> None:
        await self.zeroconf.async_unregister_all_services()
        await self.zeroconf.async_close()
