"""The defences of a server without API keys against web pages in its user's browser: the Host header (DNS rebinding)
and the Origin of writes (cross-site request forgery), which `serve_app.guard.RequestGuard` applies."""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.request_args import SecurityArgs

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "[::1]"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "[::]"})
ANY = "*"
# Methods a cross-site form or fetch can send that change something here (GET and HEAD only read).
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# A WebSocket handshake is checked as a write: any page may open one to any host (CORS does not cover it), and a
# text stream synthesizes.
WEBSOCKET = "WEBSOCKET"


def normalized_host(host: str) -> str:
    """A host as a Host header spells it: lowercase, no trailing dot, an IPv6 address in brackets."""
    host = host.strip().lower().rstrip(".")
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def host_of(authority: str) -> str:
    """The host of a Host header value: 'example.com:8000' -> 'example.com', '[::1]:8000' -> '[::1]'."""
    authority = authority.strip().lower()
    if authority.startswith("["):
        return authority.partition("]")[0] + "]"
    return authority.partition(":")[0].rstrip(".")


def without_default_port(authority: str, scheme: str | None = None) -> str:
    """`authority` lowercase, without the default port of `scheme` (of either http or https when None)."""
    authority = authority.strip().lower()
    ports = {"http": (":80",), "https": (":443",)}.get(scheme or "", (":80", ":443"))
    for port in ports:
        if authority.endswith(port):
            return authority.removesuffix(port)
    return authority


def origin_authority(origin: str) -> str | None:
    """'https://Example.com:443' -> 'example.com'; None for an opaque ('null') or malformed origin."""
    scheme, separator, authority = origin.strip().lower().partition("://")
    if not separator or not authority or "/" in authority:
        return None
    return without_default_port(authority, scheme)


def header(headers: list[tuple[bytes, bytes]], wanted: bytes) -> str | None:
    for name, value in headers:
        if name.lower() == wanted:
            return value.decode("latin-1")
    return None


@dataclass(frozen=True)
class BrowserRules:
    """Defences of a server without API keys against web pages in the user's browser: an unknown Host (DNS
    rebinding: another site's name resolved to this server) gets 421, a write from another origin (cross-site
    request forgery) 403. Clients that are not browsers send no Origin and a Host that names the server."""

    allowed_hosts: frozenset[str] | None = None  # None: any
    allowed_origins: frozenset[str] | None = None  # cross-origin writes from these; None: any (no check)

    def refusal(self, method: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, str, str] | None:
        """(status, message, code) for a request these rules refuse, None for one they let through."""
        host_header = header(headers, b"host")
        if self.allowed_hosts is not None and host_header is not None:
            host = host_of(host_header)
            if host not in self.allowed_hosts:
                allowed = ", ".join(sorted(self.allowed_hosts))
                return 421, f"unknown host {host!r}: this server answers {allowed} (security.allowed_hosts)", "bad_host"
        origin = header(headers, b"origin")
        if self.allowed_origins is None or origin is None or method.upper() not in WRITE_METHODS | {WEBSOCKET}:
            return None
        same_origin = host_header is not None and origin_authority(origin) == without_default_port(host_header)
        if same_origin or origin.strip().lower().rstrip("/") in self.allowed_origins:
            return None
        return (
            403,
            f"cross-origin {method.upper()} from {origin!r} refused: a server without API keys takes writes from "
            "its own pages and from clients that send no Origin (set security.api_keys, or list the origin in "
            "security.allowed_origins)",
            "cross_origin_refused",
        )


def browser_rules(security: SecurityArgs, bound_host: str | None, has_keys: bool) -> BrowserRules:
    """The rules of `security` for a server whose HTTP proxy binds `bound_host` (None: unknown). With API keys no
    page can act for the user (it cannot read the key), so the defaults check nothing; without keys they accept
    the loopback names and the bound host, and writes from the server's own origin."""
    if security.allowed_hosts is not None:
        hosts = None if ANY in security.allowed_hosts else frozenset(map(normalized_host, security.allowed_hosts))
    elif has_keys:
        hosts = None
    else:
        bound = normalized_host(bound_host or "")
        hosts = LOOPBACK_HOSTS | ({bound} if bound not in WILDCARD_HOSTS else set())
    if has_keys or ANY in security.allowed_origins:
        origins = None
    else:
        origins = frozenset(origin.strip().lower().rstrip("/") for origin in security.allowed_origins)
    return BrowserRules(hosts, origins)
