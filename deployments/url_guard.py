"""Where the server may connect: the SSRF guard under every HTTP request it makes for a
client (the operator's downloads, image URLs).

The rule is checked on each TCP connection, not on the URL, so redirects and DNS tricks
meet it too:
- for downloads, the host must be the configured hub or one of its storage hosts (an
  allow list); image URLs may name any host;
- the host is resolved once, here, and every address it resolves to must be public
  (no private, loopback, link-local, multicast, reserved or unspecified address, IPv4
  mapped into IPv6 included) unless the host is listed in `private_hosts`;
- the socket connects to the address that was checked, never to a second lookup, so a
  name that answers a public address first and a private one next (DNS rebinding)
  cannot slip through. TLS still verifies the certificate against the host name.
- every request is https, checked on each request of a redirect chain: a redirect that
  downgrades to plain http (whose bytes anyone on the path may read or change) is
  refused. The one exception is a hub endpoint configured as http:// (a mirror inside
  the cluster, the tests' local hub): its own origin (scheme, host and port) keeps http,
  since whoever configured it chose that; a redirect from it to any other origin,
  storage hosts included, must still be https. Image URLs may be plain http anywhere
  (as other servers fetch them): only their addresses are checked.

`guarded_client()` is an httpx2 client (huggingface_hub's HTTP library) with this guard
as its network backend and no proxies from the environment.
"""

import asyncio
import ipaddress
import socket
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpcore2
import httpx2

from app.protocol.errors import OverloadedError, PermissionDeniedError

Resolver = Callable[[str, int], list[str]]
LOOKUP_THREADS = 8  # host name lookups at once, for every asyncio client of the process


class TargetRefusedError(PermissionDeniedError):
    code = "target_refused"


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not (ip.is_multicast or ip.is_reserved or ip.is_unspecified)


class HostPolicy:
    """Which hosts a request may reach, and the one address it connects to for each.
    `allowed_hosts` None: any host; `plain_http` holds "host:port" origins kept on http,
    or "*" for every origin; `ports`: the only ports it may reach (None: any); `what`
    names the requests in refusals."""

    def __init__(
        self,
        allowed_hosts: Iterable[str] | None,
        private_hosts: Iterable[str] = (),
        resolver: Resolver = system_resolver,
        plain_http: Iterable[str] = (),
        what: str = "downloads",
        ports: Iterable[int] | None = None,
    ) -> None:
        self.allowed = None if allowed_hosts is None else {_name(h) for h in allowed_hosts}
        self.private = {_name(h).strip("[]") for h in private_hosts}
        self.resolver = resolver
        self.plain_http = {o.lower() for o in plain_http}
        self.what = what
        self.ports = None if ports is None else set(ports)

    @classmethod
    def for_hub(
        cls,
        endpoint: str,
        storage_hosts: Iterable[str],
        private_hosts: Iterable[str] = (),
        resolver: Resolver = system_resolver,
    ) -> "HostPolicy":
        parts = urlsplit(endpoint)
        hub = parts.hostname or ""
        plain = [f"{hub}:{parts.port or 80}"] if parts.scheme == "http" else []
        return cls([hub, *storage_hosts], private_hosts, resolver, plain)

    @classmethod
    def for_images(
        cls,
        private_hosts: Iterable[str] = (),
        resolver: Resolver = system_resolver,
        ports: Iterable[int] = (80, 443),
    ) -> "HostPolicy":
        return cls(None, private_hosts, resolver, ["*"], "image URLs", ports)

    def _check_host(self, host: str) -> None:
        if self.allowed is not None and host not in self.allowed:
            raise TargetRefusedError(f"{self.what} may not reach {host!r}: not the configured hub")

    def check_request(self, request: httpx2.Request) -> None:
        """Before each request, redirects included: https, or the http hub's own origin."""
        url = request.url
        host = _name(url.host or "")
        self._check_host(host)
        port = url.port or {"http": 80, "https": 443}.get(url.scheme)
        if self.ports is not None and port not in self.ports:
            raise TargetRefusedError(f"{self.what} may not reach port {port}")
        plain_ok = self.plain_http & {"*", f"{host}:{url.port or 80}"}
        if url.scheme == "https" or (url.scheme == "http" and plain_ok):
            return
        if url.scheme != "http":
            raise TargetRefusedError(f"{self.what} may not use {url.scheme}:// ({host})")
        raise TargetRefusedError(
            f"{self.what} may not use plain http ({url.scheme}://{host}): only https, but "
            "for a hub endpoint configured as http://"
        )

    def address(self, host: str, port: int) -> str:
        """The checked address to connect to for `host`; TargetRefusedError otherwise."""
        name = _name(host).strip("[]")
        self._check_host(name)
        try:
            addresses = self.resolver(name, port)
        except OSError as exc:
            raise TargetRefusedError(f"cannot resolve {host!r}: {exc}") from None
        if not addresses:
            raise TargetRefusedError(f"{host!r} resolves to no address")
        if name not in self.private:
            bad = [a for a in addresses if not is_public(a)]
            if bad:
                raise TargetRefusedError(
                    f"{host!r} resolves to a non-public address ({bad[0]}): refused"
                )
        return addresses[0]


def _name(host: str) -> str:
    return host.lower().rstrip(".")


class GuardedBackend(httpcore2.SyncBackend):
    def __init__(self, policy: HostPolicy) -> None:
        self.policy = policy

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ) -> httpcore2.NetworkStream:
        address = self.policy.address(host, port)
        return super().connect_tcp(address, port, timeout, local_address, socket_options)


class LookupsBusyError(OverloadedError):
    code = "lookups_busy"


class AsyncGuardedBackend(httpcore2.AnyIOBackend):
    """GuardedBackend's rule for an asyncio client. Names are resolved on a few threads
    of their own, counted until each lookup ends (a cancelled fetch does not end its
    thread's lookup): when all are busy (slow name servers, which a client may choose)
    a fetch is refused at once (503) rather than queued behind them."""

    threads = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="url-lookup")
    busy = 0
    lock = threading.Lock()

    def __init__(self, policy: HostPolicy) -> None:
        self.policy = policy

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        cls = AsyncGuardedBackend
        with cls.lock:
            if cls.busy >= LOOKUP_THREADS:
                raise LookupsBusyError("too many host names are being looked up: retry")
            cls.busy += 1

        def lookup() -> str:
            try:
                return self.policy.address(host, port)
            finally:
                with cls.lock:
                    cls.busy -= 1

        address = await asyncio.get_running_loop().run_in_executor(cls.threads, lookup)
        return await super().connect_tcp(address, port, timeout, local_address, socket_options)


def guarded_async_client(
    policy: HostPolicy, timeout_s: float, max_connections: int = 16
) -> httpx2.AsyncClient:
    """`guarded_client` for asyncio: cancel it (asyncio.timeout) to bound a whole fetch."""
    transport = httpx2.AsyncHTTPTransport(trust_env=False)
    transport._pool = httpcore2.AsyncConnectionPool(
        ssl_context=httpx2.create_ssl_context(),
        network_backend=AsyncGuardedBackend(policy),
        max_connections=max_connections,
    )

    async def check(request: httpx2.Request) -> None:
        policy.check_request(request)

    return httpx2.AsyncClient(
        transport=transport,
        follow_redirects=True,
        max_redirects=5,
        timeout=httpx2.Timeout(timeout_s),
        trust_env=False,
        event_hooks={"request": [check]},
    )


def guarded_client(
    policy: HostPolicy, timeout_s: float = 30.0, headers: dict | None = None
) -> httpx2.Client:
    transport = httpx2.HTTPTransport(trust_env=False)
    # httpx2 takes no network backend argument: swap its pool for one that has ours.
    transport._pool = httpcore2.ConnectionPool(
        ssl_context=httpx2.create_ssl_context(),
        network_backend=GuardedBackend(policy),
    )
    return httpx2.Client(
        transport=transport,
        follow_redirects=True,
        max_redirects=5,
        timeout=httpx2.Timeout(timeout_s, connect=10.0),
        trust_env=False,
        headers=headers,
        event_hooks={"request": [policy.check_request]},
    )
