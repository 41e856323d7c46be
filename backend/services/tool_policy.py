"""Which tool URLs the bot may call: not the server's own network (loopback, private, link-local or otherwise
non-public addresses) unless the operator allows it (``KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS``).

Asked twice: when a tool is registered (a 422 with the reason, so the admin hears it at once, not from a customer's
apology) and again at each call (a host may resolve elsewhere later). NOTE: a host that resolves differently between
the check and the connection (DNS rebinding) is not caught here: put an egress proxy in front if tenants are not
trusted with that.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from urllib.parse import urlsplit

RESOLVE_TIMEOUT_S = 3.0


async def refused_address(url: str, allow_private_networks: bool) -> str | None:
    """Why the policy refuses ``url`` (its host is, or resolves to, a non-public address), or None. A host that does
    not resolve (in time) is not refused here: the call then fails as unreachable, with the resolver's reason."""
    if allow_private_networks:
        return None
    host = urlsplit(url).hostname or ""
    try:
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):
        return None
    for info in infos:
        address = ipaddress.ip_address(info[4][0])
        if not address.is_global:
            return f"{host} {'is' if str(address) == host else f'resolves to {address}, which is'} {_kind(address)}"
    return None


def _kind(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address"
    if address.is_private:
        return "a private address"
    return "not a public address"
