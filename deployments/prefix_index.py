"""PrefixIndex: which replica most likely still holds a prompt's prefix in its KV cache.

The router cannot see replicas' caches, so it remembers where it sent each prompt: the
prompt's token ids are cut into the engine's KV blocks, and each full block is keyed by a
hash of it and every block before it (as the engine's prefix cache keys its blocks). A new
prompt walks its chain of keys; the replicas that were sent every block so far are the
candidates, and the deepest level reached is the match. Keys are kept in LRU order and the
oldest are dropped past `max_blocks`, an approximation of the replicas' own eviction.
Replicas that are gone are simply never asked about again, and their entries age out.

Plain Python, no Ray: one per router (per ingress process, per model deployment), and one
per deployment in the RoutingState every ingress shares (routing_state.py), which sees
only the keys. Keys hash int tuples: the same in every process.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence


def block_keys(token_ids: Sequence[int], block_size: int, max_tokens: int) -> list[int]:
    """Chained hashes of the full blocks among the first `max_tokens` tokens."""
    keys: list[int] = []
    key = 0
    n = min(len(token_ids), max_tokens) // block_size * block_size
    for start in range(0, n, block_size):
        key = hash((key, tuple(token_ids[start : start + block_size])))
        keys.append(key)
    return keys


class PrefixIndex:
    def __init__(self, block_size: int, max_tokens: int = 4096, max_blocks: int = 200_000):
        self.block_size = block_size
        self.max_tokens = max_tokens
        self.max_blocks = max_blocks
        # block key -> replicas sent that block (a dict used as an ordered set)
        self._holders: OrderedDict[int, dict[str, None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, token_ids: Sequence[int], replicas: Iterable[str]) -> tuple[list[str], int]:
        """(replicas holding the longest indexed prefix among `replicas`, its length in
        tokens). No match: ([], 0)."""
        holders, depth = self.match_keys(self.keys(token_ids), replicas)
        return holders, depth * self.block_size

    def match_keys(self, keys: Sequence[int], replicas: Iterable[str]) -> tuple[list[str], int]:
        """`match` of a prompt's block keys; the depth in blocks."""
        alive = set(replicas)
        best: list[str] = []
        depth = 0
        for i, key in enumerate(keys):
            holders = self._holders.get(key)
            if not holders:
                break
            alive = alive.intersection(holders)
            if not alive:
                break
            best, depth = sorted(alive), i + 1
        return best, depth

    def insert(self, token_ids: Sequence[int], replica: str) -> None:
        self.insert_keys(self.keys(token_ids), replica)

    def insert_keys(self, keys: Sequence[int], replica: str) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                holders = self._holders[key] = {}
            else:
                self._holders.move_to_end(key)
            holders[replica] = None
        while len(self._holders) > self.max_blocks:
            self._holders.popitem(last=False)

    def keys(self, token_ids: Sequence[int]) -> list[int]:
        return block_keys(token_ids, self.block_size, self.max_tokens)
