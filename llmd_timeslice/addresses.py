"""``host:port`` as every flag, setting and file of the project reads it: one parser, one-line errors.

Accepted: ``name:port``, ``ipv4:port``, ``[ipv6]:port`` (RFC 3986 section 3.2.2: an IPv6 literal in brackets, as
gRPC's and Envoy's own address syntax), with a port in 1..65535. Refused with one line naming the value: no port,
an empty host, a port that is not a number or is out of range (``127.0.0.1:99999``: gRPC's resolver would wrap it
to another port instead of refusing it), an unbracketed IPv6 address (``::1:50051`` is ambiguous).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(frozen=True)
class HostPort:
    """A parsed address: ``host`` without brackets (``::1``), ``port`` in 1..65535."""

    host: str
    port: int

    def __str__(self) -> str:
        """``host:port``, an IPv6 host in brackets (``[::1]:50051``)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_host_port(value: str, what: str = "host:port") -> HostPort:
    """Parse ``value`` as ``host:port`` (module docstring).

    Raises:
        ValueError: one line, ``expected <what>, got '<value>': <the problem>``.
    """

    def bad(problem: str) -> ValueError:
        return ValueError(f"expected {what}, got {value!r}: {problem}")

    if not isinstance(value, str) or not value:
        raise bad("empty")
    text = value
    if "://" in text:
        raise bad(f"a URL, not an address: give host:port without the scheme, e.g. {text.split('://', 1)[1].rstrip('/')!r}")
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep:
            raise bad("an IPv6 address in [ ] is not closed")
        if not rest.startswith(":") or rest == ":":
            raise bad("no port")
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise bad(f"{host!r} in [ ] is not an IPv6 address") from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise bad("no port")
        if ":" in host:
            raise bad("an IPv6 address goes in brackets, e.g. [::1]:50051")
    if not host:
        raise bad("no host")
    if not port_text:
        raise bad("no port")
    if not (port_text.isascii() and port_text.isdigit()):
        raise bad(f"port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise bad(f"port {port} is out of 1..65535")
    return HostPort(host, port)


def check_host_port(value: str, what: str = "host:port") -> str:
    """``value`` unchanged when it parses (:func:`parse_host_port`), for validators and option parsers.

    Raises:
        ValueError: as :func:`parse_host_port`.
    """
    parse_host_port(value, what)
    return value


def check_ip_port(value: str, what: str = "ip:port") -> str:
    """``value`` unchanged when its host is an IP address (not a name): for what Envoy uses as an address without
    resolving it (the EPP's ``x-gateway-destination-endpoint``).

    Raises:
        ValueError: as :func:`parse_host_port`, or the host is a name.
    """
    hp = parse_host_port(value, what)
    try:
        ipaddress.ip_address(hp.host)
    except ValueError:
        raise ValueError(f"expected {what} ({hp.host!r} is not an IP address), got {value!r}") from None
    return value


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_network(text: str) -> Network:
    """``10.0.0.0/8``, ``192.168.1.7`` (one address), ``::1`` or ``fd00::/8`` -> a network.

    Raises:
        ValueError: one line naming ``text`` (not an address or CIDR, or host bits set as in ``10.0.0.1/8``).
    """
    try:
        return ipaddress.ip_network(str(text).strip(), strict=True)
    except ValueError as exc:
        raise ValueError(f"expected an IP address or CIDR (e.g. 10.0.0.0/8), got {text!r}: {exc}") from None


def check_network(text: str) -> str:
    """``text`` unchanged once :func:`parse_network` accepts it (for settings that keep the string)."""
    parse_network(text)
    return text


def peer_ip(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP address in a gRPC peer string (``ipv4:10.1.2.3:5000``, ``ipv6:[::1]:5000``, percent-encoded forms
    too; an IPv4-mapped IPv6 address as its IPv4 address); None for other transports (``unix:...``)."""
    from urllib.parse import unquote

    kind, _, rest = unquote(peer or "").partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host = rest.rsplit(":", 1)[0].strip("[]").split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip
