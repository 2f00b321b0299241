"""The internal messages of the ingress -> replica hop."""

from app.protocol.messages import ContextAction, ContextOp, EngineRequest, context_op
from app.protocol.sampling import SamplingParams


def test_context_op_is_found_in_any_argument_of_any_call():
    op = ContextOp("7", ContextAction.SAVE)
    assert context_op((op, "file.bin")) is op
    assert context_op(("file.bin", op)) is op
    request = EngineRequest("r", [1, 2], SamplingParams(), ContextOp("8", ContextAction.GENERATE))
    assert context_op((request,)) is request.context
    assert context_op((EngineRequest("r", [1], SamplingParams()),)) is None
    assert context_op(()) is None


def test_only_fill_generate_and_restore_create_a_context():
    creating = {a for a in ContextAction if a.creates}
    assert creating == {ContextAction.FILL, ContextAction.GENERATE, ContextAction.RESTORE}
