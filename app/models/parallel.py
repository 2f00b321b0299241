"""Tensor parallelism (Megatron-style) for our decoder: who holds which slice.

Shard r of N holds: query heads [r*nh/N, (r+1)*nh/N); its KV heads (a slice of them, or,
when N exceeds the KV heads, the one KV head its query heads read, replicated); rows
[r*I/N, (r+1)*I/N) of gate/up and the same columns of down; the matching columns of
o_proj; the same slice of every expert's intermediate dimension (routers are
replicated); and a slice of the vocabulary for the embedding and the LM head. Norms are
replicated. After o_proj and down_proj the partial sums are all-reduced; the LM head's
vocabulary slices are gathered on rank 0, where sampling runs.

`TPGroup` wraps torch.distributed (gloo on CPU, NCCL on GPU); with size 1 every
collective is a no-op, so the single-device path pays nothing.
"""

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from app.models.arch import ArchConfig


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce_(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            import torch.distributed as dist

            dist.all_reduce(x)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's `x` along the last dim on rank 0 (None elsewhere)."""
        if not self.enabled:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled: for small step messages)."""
        if not self.enabled:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def init_tp_group(
    rank: int, size: int, master: str, backend: str = "gloo", timeout_s: float = 60.0
) -> TPGroup:
    """Join the replica's process group; `master` is "host:port" where rank 0 listens."""
    if size > 1:
        import torch.distributed as dist

        dist.init_process_group(
            backend,
            init_method=f"tcp://{master}",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=timeout_s),
        )
    return TPGroup(rank, size)


def check_divisible(arch: ArchConfig, size: int) -> None:
    problems = []
    if arch.num_heads % size:
        problems.append(f"{arch.num_heads} query heads")
    if arch.num_kv_heads % size and size % arch.num_kv_heads:
        problems.append(f"{arch.num_kv_heads} KV heads")
    if arch.intermediate_size % size:
        problems.append(f"intermediate size {arch.intermediate_size}")
    if arch.moe is not None:
        if arch.moe.intermediate_size % size:
            problems.append(f"expert intermediate size {arch.moe.intermediate_size}")
        if arch.moe.shared_intermediate_size % size:
            problems.append(f"shared expert size {arch.moe.shared_intermediate_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not divide the model's {', '.join(problems)}"
        )


def shard_arch(arch: ArchConfig, tp: TPGroup) -> ArchConfig:
    """The sizes one shard computes with (all of them when tp.size is 1)."""
    if not tp.enabled:
        return arch
    check_divisible(arch, tp.size)
    moe = arch.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // tp.size,
            shared_intermediate_size=moe.shared_intermediate_size // tp.size,
        )
    return dataclasses.replace(
        arch,
        moe=moe,
        num_heads=arch.num_heads // tp.size,
        num_kv_heads=max(1, arch.num_kv_heads // tp.size),
        intermediate_size=arch.intermediate_size // tp.size,
    )


def vocab_range(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """[start, start + per_shard) of the padded vocabulary this shard holds."""
    per_shard = -(-vocab_size // tp.size)
    return tp.rank * per_shard, per_shard


def kv_head_range(arch: ArchConfig, tp: TPGroup) -> tuple[int, int]:
    """(first KV head, count) this shard holds: a slice, or one replicated head."""
    if arch.num_kv_heads >= tp.size:
        per = arch.num_kv_heads // tp.size
        return tp.rank * per, per
    # More shards than KV heads: shard r's query heads all read KV head r*nkv/N.
    return tp.rank * arch.num_kv_heads // tp.size, 1


def slice_rows(t: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """Rows [start, start+count) of t, zero-padded past its end (the padded vocabulary)."""
    if start + count <= t.shape[0]:
        return t.narrow(0, start, count)
    out = t.new_zeros((count, *t.shape[1:]))
    have = max(0, t.shape[0] - start)
    if have:
        out[:have] = t[start:]
    return out
