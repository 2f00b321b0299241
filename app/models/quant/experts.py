"""QuantizedExperts: a MoE layer's routed experts kept as the GGUF file stores them, so
a replica holds them at their file size and a step reads each expert's bytes once.

The loader hands over one piece per expert and projection (gate, up, down: llama.cpp
stacks each projection's experts in one tensor, which the reader splits). Once all are
in, each projection's experts are stacked into one PackedWeight, expert after expert,
gate and up side by side per expert (gate_e's rows, then up_e's) when they share a
type. A step then runs every active expert of a projection in one kernel call
(quant.grouped_matmul): tokens sorted by expert, threads spread over all the experts'
rows together. A projection whose type the kernels do not run arrives dequantized and
stays a float (E, rows, K) tensor, multiplied expert by expert.
"""

import torch
import torch.nn.functional as F

from app.models.quant.packed_weight import GROUP, PackedWeight, concat
from app.models.quantized_tensor import QuantizedTensor

GATE, UP, DOWN = 0, 1, 2
Projection = PackedWeight | torch.Tensor | tuple[PackedWeight | torch.Tensor, ...]


class QuantizedExperts:
    def __init__(self, num_experts: int, inter: int, hidden: int, dtype: torch.dtype) -> None:
        self.num_experts, self.inter, self.hidden, self.dtype = num_experts, inter, hidden, dtype
        self._pieces: dict[tuple[int, int], PackedWeight | torch.Tensor] = {}
        self.gate_up: Projection | None = None  # one weight of E * 2I rows, or (gate, up)
        self.down: Projection | None = None

    def set_piece(self, expert: int, part: int, weight: QuantizedTensor | torch.Tensor) -> None:
        from app.models import quant

        rows, cols = (self.hidden, self.inter) if part == DOWN else (self.inter, self.hidden)
        if tuple(weight.shape) != (rows, cols):
            raise ValueError(
                f"expert weight of shape {tuple(weight.shape)}, expected {(rows, cols)}"
            )
        if isinstance(weight, QuantizedTensor):
            self._pieces[(expert, part)] = quant.pack(weight.data, weight.qtype, weight.cols)
        else:
            self._pieces[(expert, part)] = weight.detach().to(self.dtype)
        if len(self._pieces) == 3 * self.num_experts:
            self._stack()

    @property
    def ready(self) -> bool:
        return self.down is not None

    def _stack(self) -> None:
        experts = range(self.num_experts)
        gate = [self._pieces[(e, GATE)] for e in experts]
        up = [self._pieces[(e, UP)] for e in experts]
        if _packable(gate + up):
            self.gate_up = concat([w for pair in zip(gate, up, strict=True) for w in pair])
        else:
            self.gate_up = (_stacked(gate, self.dtype), _stacked(up, self.dtype))
        self.down = _stacked([self._pieces[(e, DOWN)] for e in experts], self.dtype)
        self._pieces.clear()

    def nbytes(self) -> int:
        from app.models import quant

        parts = [
            p for w in (self.gate_up, self.down) for p in (w if isinstance(w, tuple) else (w,))
        ]
        return sum(quant.nbytes(p) for p in parts if p is not None)

    def routed(
        self, x: torch.Tensor, logits: torch.Tensor, top_k: int, normalize: bool, act: str
    ) -> torch.Tensor | None:
        """The routed experts' sum for x (T, H) in one C++ call (moe_experts.cpp): the
        router's top-k, the grouped products and the weighted sum. None where it does
        not apply (gate and up of different types, a float projection, another
        activation, x not float32, no kernels): SparseMoE's Python path then runs."""
        from app.models import quant

        native = quant.load()
        if (
            native is None
            or act != "silu"
            or x.dtype != torch.float32
            or not isinstance(self.gate_up, PackedWeight)
            or not isinstance(self.down, PackedWeight)
        ):
            return None
        gu_type, gu_parts = self.gate_up.kernel_args
        dn_type, dn_parts = self.down.kernel_args
        activations = 1 if quant.float_activations else 0
        return native.quant_moe_experts(
            x,
            logits,
            top_k,
            normalize,
            gu_type,
            gu_parts,
            dn_type,
            dn_parts,
            self.inter,
            activations,
        )

    def forward(self, xs: torch.Tensor, starts: list[int], act: str) -> torch.Tensor:
        """Rows of xs grouped by expert (rows starts[e]..starts[e+1]-1 go to expert e):
        each row through its expert's MLP."""
        from app.models.dense_mlp import activate

        gate_up = xs.new_empty(xs.shape[0], 2 * self.inter)
        if isinstance(self.gate_up, tuple):
            _project(self.gate_up[0], xs, starts, gate_up[:, : self.inter])
            _project(self.gate_up[1], xs, starts, gate_up[:, self.inter :])
        else:
            _project(self.gate_up, xs, starts, gate_up)
        g, u = gate_up.split(self.inter, dim=-1)
        hidden = activate(g, act) * u
        return _project(self.down, hidden, starts, xs.new_empty(xs.shape[0], self.hidden))


def _packable(weights: list) -> bool:
    """Quantized, of one type, in whole row groups: stackable as one weight."""
    first = weights[0]
    return all(
        isinstance(w, PackedWeight) and w.qtype == first.qtype and w.n % GROUP == 0 for w in weights
    )


def _stacked(weights: list, dtype: torch.dtype) -> PackedWeight | torch.Tensor:
    if _packable(weights):
        return concat(weights)
    return torch.stack([_dense(w).to(dtype) for w in weights])


def _dense(weight: PackedWeight | torch.Tensor) -> torch.Tensor:
    from app.models.quant import dequantize_packed

    return dequantize_packed(weight) if isinstance(weight, PackedWeight) else weight


def _project(
    weight: PackedWeight | torch.Tensor, x: torch.Tensor, starts: list[int], out: torch.Tensor
) -> torch.Tensor:
    from app.models import quant

    if isinstance(weight, PackedWeight):
        return quant.grouped_matmul(x, weight, starts, out)
    for e in range(len(starts) - 1):
        if starts[e + 1] > starts[e]:
            rows = slice(starts[e], starts[e + 1])
            out[rows] = F.linear(x[rows], weight[e].to(x.dtype))
    return out
