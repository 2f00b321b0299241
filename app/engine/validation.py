"""Request checks only the engine can make: token ids against this model's vocabulary.

Everything else (ranges, types, bounds) is checked where SamplingParams are made; these
run when a request arrives, before it touches the scheduler, so a bad id never reaches
an embedding lookup inside a step.
"""

from collections.abc import Sequence

from app.protocol.errors import InvalidRequestError
from app.protocol.sampling import SamplingParams


def checked_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """A copy of `token_ids`; InvalidRequestError naming `param` if one is out of range."""
    tokens = list(token_ids)
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param=param
        )
    return tokens


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """The token ids that sampling params name (biases, stop tokens) are in range."""
    for field, ids in (
        ("logit_bias", params.logit_bias),
        ("stop_token_ids", params.stop_token_ids),
    ):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})",
                param=field,
            )
