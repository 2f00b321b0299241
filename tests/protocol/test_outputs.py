"""TokenDelta's wire form (what crosses the model replica -> ingress hop) gives back the
same delta, and holds only what Ray serializes with msgpack."""

from app.protocol.outputs import FinishReason, TokenDelta, TokenLogprob


def plain(value: object) -> bool:
    if isinstance(value, tuple):
        return all(plain(v) for v in value)
    return value is None or type(value) in (int, float, str)


def test_wire_round_trip():
    lps = (TokenLogprob(5, -0.5, ((5, -0.5), (7, -1.25))), TokenLogprob(9, -2.0, ()))
    deltas = [
        TokenDelta("r.1", 0, (5, 9), lps, None, 12, 4),
        TokenDelta("r.1", 2, (3,), None, FinishReason.LENGTH, 12, 0),
    ]
    for delta in deltas:
        wire = delta.wire()
        assert plain(wire)
        back = TokenDelta.from_wire("r.1", wire)
        assert back == delta and type(back.finish_reason) is type(delta.finish_reason)
