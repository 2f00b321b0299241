"""What a caller who is not the operator may see of the host: no host names, no node
addresses, no absolute paths (they tell an attacker the user name and the layout). The
operator (deployments/http/caller.py) sees everything."""

import re
from typing import Any

HOST_KEYS = frozenset({"hostname", "address", "node_ip", "nodeManagerAddress"})
# An absolute path inside any text ("FROM /home/ann/models/x.gguf", an error, a JSON string
# of metadata), not the path part of a URL: the last part is kept.
_PATH = re.compile(r"(?<![\w.:/~-])~?/(?:[^\s/\"'\\]+/)+([^\s/\"'\\]+)")


def without_host_detail(value: Any) -> Any:
    """`value` (JSON) with host names and addresses dropped (Ray's `node:<ip>` resources
    too) and each absolute path cut to its last part (the file or directory name)."""
    if isinstance(value, dict):
        return {
            k: without_host_detail(v)
            for k, v in value.items()
            if k not in HOST_KEYS and not k.startswith("node:")
        }
    if isinstance(value, list):
        return [without_host_detail(v) for v in value]
    if isinstance(value, str):
        return _PATH.sub(r"\1", value)
    return value
