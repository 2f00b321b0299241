"""Which Host headers the server answers: the defence against DNS rebinding.

A page on `http://rebind.example:8000` whose name an attacker points at 127.0.0.1 is the
same site as itself to a browser, so the Origin and fetch-metadata checks pass; only the
Host header gives it away. IP addresses are always answered (but 0.0.0.0 and
multicast ones): an address cannot be rebound, and a page served from one is this
server's own. (As Vite and Jupyter do.)
"""

import ipaddress


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port or IPv6 brackets, lower case."""
    host = host_header.strip().lower().rstrip(".")
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def host_allowed(host_header: str | None, patterns: list[str]) -> bool:
    """Whether `host_header` names an IP address or a name `patterns` allow: the name
    itself, `.example.com` (or `*.example.com`) for it and every subdomain, or `*`."""
    if "*" in patterns:
        return True
    if not host_header:  # HTTP/1.0 clients may send none: no browser page does
        return True
    name = host_name(host_header)
    try:
        address = ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        address = None
    if address is not None:
        # 0.0.0.0 reaches this machine on Linux and macOS, yet a browser sends no
        # fetch-metadata to it: a page's <img src=http://0.0.0.0:8000/...> would pass.
        return not (address.is_unspecified or address.is_multicast)
    for pattern in patterns:
        pattern = pattern.lower().removeprefix("*")
        if pattern.startswith("."):
            if name == pattern[1:] or name.endswith(pattern):
                return True
        elif name == pattern:
            return True
    return False
