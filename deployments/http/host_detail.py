"""What a caller who is not the operator may see of the host: no host names, no node
addresses, no absolute paths (they tell an attacker the user name and the layout). The
operator (deployments/http/caller.py) sees everything."""

from typing import Any

HOST_KEYS = frozenset({"hostname", "address", "node_ip", "nodeManagerAddress"})


def without_host_detail(value: Any) -> Any:
    """`value` (JSON) with host names and addresses dropped and each absolute path cut to
    its last part (the file or directory name)."""
    if isinstance(value, dict):
        return {k: without_host_detail(v) for k, v in value.items() if k not in HOST_KEYS}
    if isinstance(value, list):
        return [without_host_detail(v) for v in value]
    if isinstance(value, str) and value.startswith(("/", "~/")) and len(value) > 1:
        return value.rstrip("/").rsplit("/", 1)[-1]
    return value
