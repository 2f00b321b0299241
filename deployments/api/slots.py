"""llama.cpp's slots as more than one dialect names them (`id_slot` in /completion and in
OpenAI's chat, as llama-server takes it): slot `i` of a model is the persistent context
`slot-{i}` on the replica that holds it."""

from app.protocol.errors import InvalidRequestError
from app.protocol.messages import ContextAction, ContextOp
from deployments.ingress import Ingress


def slot_op(slot_id: int, action: ContextAction) -> ContextOp:
    """The context that holds slot `slot_id`'s tokens and KV."""
    return ContextOp(f"slot-{slot_id}", action)


def check_slot(ingress: Ingress, name: str, id_slot: int, allow_any: bool) -> None:
    slots = ingress.model(name).engine.max_num_seqs
    if allow_any and id_slot == -1:
        return
    if not 0 <= id_slot < slots:
        what = "-1 (any) or in" if allow_any else "in"
        raise InvalidRequestError(f"id_slot must be {what} [0, {slots})", "id_slot")
