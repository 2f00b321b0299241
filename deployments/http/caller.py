"""Caller: who sent a request, as the request guard found it (`request.state.caller`).

Keys come in two roles. `api_keys` are for inference; `admin_api_keys` are also for the
operator's actions (downloads, models started and stopped, shutdown, the WebSocket's
commands) and see every key's stored objects. With no admin keys, only a loopback client
may act as the operator (unless `loopback_operator` is off: behind a proxy or a service
mesh sidecar on the same machine every client is a loopback one): a page or a host
elsewhere on the network never can.
"""

import hashlib
import ipaddress
from dataclasses import dataclass
from typing import Any

from fastapi import Request


@dataclass(frozen=True)
class Caller:
    # A stable id of the key presented (never the key); None when the server has no keys.
    key_id: str | None = None
    # Presented one of admin_api_keys: sees every key's assistants, threads and files.
    admin: bool = False
    # May change the operator's state and read host detail (names, addresses, paths).
    operator: bool = False
    # The server has keys (api_keys or admin_api_keys): objects then belong to one.
    keyed: bool = False

    def owns(self, owner: str | None) -> bool:
        """Whether this caller may see an object stored by `owner` (a key_id): its own, or
        any for an admin or on a server without keys. (A caller without a valid key on a
        server with only admin keys sees only what such callers made.)"""
        return self.admin or not self.keyed or owner == self.key_id


def key_id(key: bytes) -> str:
    return hashlib.sha256(key).hexdigest()[:16]


def is_loopback(scope: dict[str, Any]) -> bool:
    client = scope.get("client")
    host = client[0] if client else ""
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 from a dual stack
    return (mapped or address).is_loopback


def caller_of(request: Request) -> Caller:
    return getattr(request.state, "caller", None) or Caller()
