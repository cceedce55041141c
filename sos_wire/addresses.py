"""Network addresses as every command and client reads them: pure parsing, no I/O.

One grammar for ``--server``, ``--listen`` (``sos gateway``, ``sos-server serve``) and
``--advertise``: ``HOST``, ``HOST:PORT``, ``[V6]`` or ``[V6]:PORT``. An IPv6 address with a
port is written in brackets; a bare one with colons is refused (``::1:5`` could be read two
ways). What differs between the commands is policy, given as arguments: whether the port may
be left out (and what it then is) and whether port 0 ("any free port") is allowed.

:func:`address_key` is the unit the per-address limits of the server and the gateway count
by (an IPv4 address, or an IPv6 /64).
"""

from __future__ import annotations

import ipaddress

__all__ = ["address_key", "format_address", "is_loopback", "is_wildcard", "parse_address", "split_address"]


def split_address(text: str) -> tuple[str, int | None]:
    """``HOST``, ``HOST:PORT``, ``[V6]``, ``[V6]:PORT`` -> (host, port or None). ValueError
    (its message says what is wrong, not which option it came from) for anything else: no
    host, a bare IPv6 address with a port, a port that is not a number in 0..65535."""
    if not isinstance(text, str):
        raise ValueError(f"expected 'host:port', not {text!r}")
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("expected [ipv6]:port")
        port_text = rest[1:] if rest else None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif ":" in text:
        raise ValueError("write an IPv6 address as [addr]:port")
    else:
        host, port_text = text, None
    if not host:
        raise ValueError("no host")
    if port_text is None:
        return host, None
    if not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ValueError("port must be a number in 0..65535")
    return host, int(port_text)


def parse_address(text: str, *, default_port: int | None = None, any_port: bool = False) -> tuple[str, int]:
    """:func:`split_address`, then the caller's policy: without a port, ``default_port`` (a
    ValueError if None: the port is required); port 0 only with ``any_port`` (a listener)."""
    host, port = split_address(text)
    if port is None:
        if default_port is None:
            raise ValueError("no port")
        port = default_port
    if port == 0 and not any_port:
        raise ValueError("port must be 1..65535")
    return host, port


def format_address(host: str, port: int) -> str:
    """``host:port``, ``[v6]:port``: what :func:`split_address` reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    """A listen host that means every interface (no address of its own to advertise)."""
    if host in ("", "*"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_unspecified
    except ValueError:
        return False


def address_key(host: str) -> str:
    """What per-address limits count by: an IPv4 address, or an IPv6 /64 (one host usually
    holds a whole /64); an IPv4-mapped IPv6 address counts as its IPv4 address."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)
