"""A LoRA adapter load's id: how the ingress, Serve's multiplexing and a replica's engine
know one load of an adapter (deployments/replica_adapters.py says why), and the name its
requests give it, for messages."""

import hashlib


def adapter_id(name: str, path: str, version: int = 0) -> str:
    """The id of adapter `name` as loaded from `path` at `version` (0: the config's)."""
    digest = hashlib.sha256(f"{path}\n{version}".encode()).hexdigest()[:12]
    return f"{name}@{digest}"


def shown(name: str) -> str:
    """An adapter's name as its requests name it: `name` without an adapter_id's digest."""
    base, at, digest = name.rpartition("@")
    hexdigits = set("0123456789abcdef")
    return base if at and len(digest) == 12 and set(digest) <= hexdigits else name
