"""Persistent contexts: Fill/Generate continue exactly like one request, forks share blocks."""

from pathlib import Path

import pytest

from app.engine.context_files import ContextFiles
from app.protocol import SamplingParams
from app.protocol.errors import ConflictError, InvalidRequestError, NotFoundError
from app.protocol.messages import ContextAction, ContextOp
from tests.helpers import tiny_engine

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(engine, rid: str, op: ContextOp, tokens: list[int], params=GREEDY) -> list[int]:  # noqa: ANN001
    engine.add_request(rid, tokens, params, op)
    out: list[int] = []
    while engine.has_work:
        for d in engine.step():
            if d.request_id == rid:
                out.extend(d.token_ids)
    return out


def fill(cid: str, parent: str | None = None) -> ContextOp:
    return ContextOp(cid, ContextAction.FILL, parent)


def gen(cid: str, parent: str | None = None) -> ContextOp:
    return ContextOp(cid, ContextAction.GENERATE, parent)


@pytest.fixture
def engine(tiny_llama):
    return tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)


def test_fill_generate_fill_generate_equals_one_request(engine):
    a, b = [1, 2, 3, 4, 5, 6, 7], [40, 41, 42]
    run(engine, "f1", fill("c"), a)
    assert engine.context_tokens("c") == a  # the fill's own sample is not kept
    out1 = run(engine, "g1", gen("c"), [])
    run(engine, "f2", fill("c"), b)
    out2 = run(engine, "g2", gen("c"), [])
    assert engine.context_tokens("c") == a + out1 + b + out2
    # The same tokens as one request, from scratch with no cache: same continuation.
    fresh = tiny_engine(Path(engine.config.model))
    expected = fresh.generate([a + out1 + b], GREEDY)[0].outputs[0].token_ids
    assert out2 == list(expected)
    expected1 = fresh.generate([a], GREEDY)[0].outputs[0].token_ids
    assert out1 == list(expected1)


def test_fork_shares_blocks_without_recompute_and_survives_parent_free(engine):
    bm = engine.block_manager
    run(engine, "f", fill("parent"), list(range(1, 18)))  # 17 tokens: 4 full blocks + 1
    used_parent = bm.stats().used
    assert used_parent == 5
    computed_before = engine.stats.num_prompt_tokens
    run(engine, "fork", fill("child", parent="parent"), [60, 61])
    # The child recomputed only its partial last block's token plus its own two tokens.
    assert engine.stats.num_prompt_tokens - computed_before <= 3
    # Shared: 4 full blocks; the child's last block was copied on write.
    assert bm.stats().used == used_parent + 1
    engine.free_context("parent")
    assert bm.stats().used == 5  # the child's references keep the shared blocks
    child_tokens = engine.context_tokens("child")
    assert child_tokens == list(range(1, 18)) + [60, 61]
    out = run(engine, "g", gen("child"), [])
    fresh = engine.generate([child_tokens], GREEDY)[0].outputs[0].token_ids
    assert out == list(fresh)
    engine.free_context("child")
    assert bm.stats().used == 0


def test_generate_with_a_parent_forks_and_leaves_the_parent_alone(engine):
    run(engine, "f", fill("p"), [5, 6, 7, 8, 9])
    out = run(engine, "g", gen("kid", parent="p"), [])
    assert engine.context_tokens("p") == [5, 6, 7, 8, 9]
    assert engine.context_tokens("kid") == [5, 6, 7, 8, 9] + out


def test_errors(engine):
    with pytest.raises(NotFoundError):
        engine.add_request("x", [], GREEDY, gen("nobody"))
    with pytest.raises(NotFoundError):
        engine.add_request("x", [1], GREEDY, fill("new", parent="nobody"))
    with pytest.raises(InvalidRequestError):
        engine.add_request("x", [], GREEDY, fill("new"))
    with pytest.raises(NotFoundError):
        engine.free_context("nobody")
    engine.add_request("busy", [1, 2, 3], GREEDY, fill("c"))
    with pytest.raises(ConflictError):  # one primitive at a time on a context
        engine.add_request("again", [], GREEDY, gen("c"))
    while engine.has_work:
        engine.step()
    assert "nobody" not in engine.contexts.contexts


def test_abort_leaves_the_context_as_it_was(engine):
    run(engine, "f", fill("c"), [1, 2, 3, 4, 5])
    engine.add_request("g", [], SamplingParams(max_tokens=50, ignore_eos=True), gen("c"))
    engine.step()
    engine.step()
    engine.abort("g")
    while engine.has_work:
        engine.step()
    assert engine.context_tokens("c") == [1, 2, 3, 4, 5]
    assert len(run(engine, "g2", gen("c"), [])) == GREEDY.max_tokens  # not busy any more


def test_save_restore_gives_the_same_continuation(engine, tiny_llama, tmp_path):
    from app.engine import slot_files

    run(engine, "f", fill("s"), list(range(1, 12)))
    run(engine, "g", gen("s"), [])
    path = slot_files.checked_path(tmp_path, "slot-1.bin")
    saved = ContextFiles(engine).save("s", str(path))
    assert saved.num_tokens == len(engine.context_tokens("s"))
    assert saved.num_bytes == path.stat().st_size
    expected = run(engine, "g2", gen("s"), [])
    # Restore into a fresh engine (another replica of the same model): same continuation.
    other = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    restored = ContextFiles(other).restore("s", str(path))
    assert restored == saved  # the same tokens, the same file
    assert run(other, "g3", gen("s"), []) == expected
    assert other.stats.num_prompt_tokens <= 1  # nothing recomputed but the last token
    # Erase: the context is gone and its blocks are free.
    other.free_context("s")
    assert other.block_manager.stats().used == 0


def test_bad_slot_files_are_refused_and_the_engine_stays_well(engine, tiny_llama, tmp_path):
    from app.engine import slot_files

    run(engine, "f", fill("s"), [1, 2, 3, 4, 5, 6])
    good = slot_files.checked_path(tmp_path, "good")
    ContextFiles(engine).save("s", str(good))
    corrupt = tmp_path / "corrupt"
    corrupt.write_bytes(good.read_bytes()[:100])
    other_model = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=8)  # another layout
    for target, path in ((engine, corrupt), (other_model, good), (engine, tmp_path / "none")):
        with pytest.raises(InvalidRequestError):
            ContextFiles(target).restore("x", str(path))
    assert "x" not in engine.contexts.contexts
    assert len(run(engine, "g", gen("s"), [])) == GREEDY.max_tokens


@pytest.mark.parametrize(
    "name",
    [
        "..",
        "../escape",
        "a/b",
        "a\\b",
        ".hidden",
        "",
        "x" * 256,
        "bad\x00name",
        "tab\tname",
        "ｆｕｌｌｗｉｄｔｈ",
        "a\u2215b",  # division slash, looks like '/'
        "a\uff0fb",  # fullwidth solidus
        "caf\u00e9",
        "a..b",
    ],
)
def test_slot_filenames_are_checked(tmp_path, name):
    from app.engine import slot_files

    with pytest.raises(InvalidRequestError):
        slot_files.checked_path(tmp_path, name)


def test_good_slot_filenames(tmp_path):
    from app.engine import slot_files

    for name in ("slot1.bin", "a-b_c.kv", "x" * 255):
        assert slot_files.checked_path(tmp_path, name).parent == tmp_path.resolve()


# ---- bounded state: contexts never wedge a replica ---------------------------------------
def test_idle_contexts_give_up_their_kv_to_ordinary_requests_and_are_rebuilt(tiny_llama):
    engine = tiny_engine(tiny_llama, num_kv_blocks=16, block_size=4)  # 64 tokens of KV
    for cid in ("a", "b", "c"):
        run(engine, f"f{cid}", fill(cid), list(range(10, 30)))  # 5 blocks each
    # 40 tokens need 10 blocks: only the contexts' KV can make room (it used to wait forever).
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    engine.add_request("big", list(range(40, 60)), params)
    out = []
    for _ in range(200):
        if not engine.has_work:
            break
        out += [t for d in engine.step() if d.request_id == "big" for t in d.token_ids]
    assert len(out) == 20 and not engine.has_work
    assert engine.stats_snapshot()["num_context_evictions"] >= 1
    evicted = [c for c in engine.contexts.contexts.values() if not c.is_resident]
    assert evicted, "some context must have given up its KV"
    # An evicted context keeps its tokens and continues exactly as before.
    cid = evicted[0].context_id
    again = run(engine, "g", gen(cid), [])
    fresh = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    want = fresh.generate([list(range(10, 30))], GREEDY)[0].outputs[0].token_ids
    assert again == list(want)


def test_past_max_contexts_the_least_recently_used_idle_one_is_dropped(tiny_llama):
    from app.protocol.errors import ContextGoneError

    engine = tiny_engine(tiny_llama, max_contexts=2)
    run(engine, "1", fill("a"), [1, 2, 3])
    run(engine, "2", fill("b"), [4, 5, 6])
    run(engine, "3", gen("a"), [])  # a is now the most recently used
    run(engine, "4", fill("c"), [7, 8, 9])
    assert set(engine.contexts.contexts) == {"a", "c"}
    with pytest.raises(ContextGoneError) as info:
        engine.add_request("5", [], GREEDY, gen("b"))
    assert info.value.status_code == 410 and "'b'" in info.value.message
    assert "max_contexts" in info.value.message
    with pytest.raises(NotFoundError):  # said once; then the id is free again
        engine.add_request("6", [], GREEDY, gen("b"))
    assert engine.stats_snapshot()["num_context_drops"] == 1


def test_busy_contexts_are_never_dropped_a_new_one_waits_for_room(tiny_llama):
    from app.protocol.errors import CapacityError

    engine = tiny_engine(tiny_llama, max_contexts=1)
    engine.add_request("f", [1, 2, 3], GREEDY, fill("a"))  # in flight: busy
    with pytest.raises(CapacityError) as info:
        engine.add_request("g", [4, 5], GREEDY, fill("b"))
    assert info.value.status_code == 429
    while engine.has_work:
        engine.step()
    assert engine.context_tokens("a") == [1, 2, 3]
    assert "b" not in engine.contexts.contexts


def test_max_context_tokens_drops_the_least_recently_used(tiny_llama):
    engine = tiny_engine(tiny_llama, max_context_tokens=20)
    run(engine, "1", fill("a"), list(range(1, 11)))
    run(engine, "2", fill("b"), list(range(1, 11)))
    run(engine, "3", fill("c"), [5, 6, 7])
    assert set(engine.contexts.contexts) == {"b", "c"}
    with pytest.raises(InvalidRequestError, match="max_context_tokens"):  # alone too big
        engine.add_request("4", list(range(1, 25)), GREEDY, fill("d"))
    assert "d" not in engine.contexts.contexts


def test_a_busy_context_cannot_be_freed_and_its_result_never_lands_elsewhere(engine):
    run(engine, "f", fill("c"), [1, 2, 3, 4, 5])
    engine.add_request("g", [], SamplingParams(max_tokens=5, ignore_eos=True), gen("c"))
    engine.step()
    with pytest.raises(ConflictError):
        engine.free_context("c")
    while engine.has_work:
        engine.step()
    assert len(engine.context_tokens("c")) == 10
    assert engine.free_context("c") == 10


def test_a_failed_first_primitive_leaves_no_context_behind(engine):
    too_long = SamplingParams(max_tokens=10_000)
    with pytest.raises(InvalidRequestError):
        engine.add_request("g", [1, 2, 3], too_long, gen("new"))
    assert "new" not in engine.contexts.contexts
    assert engine.block_manager.stats().used == 0


def test_slot_files_are_bounded(engine, tmp_path, monkeypatch):
    from app.engine import slot_files
    from app.protocol.errors import NotImplementedByServerError

    run(engine, "f", fill("s"), list(range(1, 30)))
    path = slot_files.checked_path(tmp_path, "s.bin")
    with pytest.raises(ConflictError, match="quota"):
        ContextFiles(engine).save("s", str(path), quota_bytes=100)
    assert not path.exists()
    ContextFiles(engine).save("s", str(path), quota_bytes=10 << 20)
    # Bigger than any slot of this model: refused before torch reads a byte.
    huge = tmp_path / "huge.bin"
    with huge.open("wb") as f:
        f.truncate(64 << 20)

    def no_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("torch.load must not run")

    monkeypatch.setattr(slot_files.torch, "load", no_load)
    with pytest.raises(InvalidRequestError, match="bytes, more than"):
        ContextFiles(engine).restore("x", str(huge))
    monkeypatch.setattr(slot_files, "torch_version", lambda: (2, 5))
    with pytest.raises(NotImplementedByServerError, match="CVE-2025-32434"):
        ContextFiles(engine).restore("x", str(path))


def test_contexts_whose_primitives_all_wait_cannot_hold_every_block(tiny_llama):
    """Three contexts fill the cache, then a Generate on each arrives at once: before the
    waiting primitives could give up their contexts' KV, they held every block and none
    could ever run."""
    engine = tiny_engine(tiny_llama, num_kv_blocks=16, block_size=4)  # 64 tokens of KV
    prompts = {c: [10 + 20 * i + t for t in range(18)] for i, c in enumerate("abc")}
    for c, tokens in prompts.items():
        run(engine, f"f{c}", fill(c), tokens)
    assert engine.block_manager.stats().free <= 1
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for c in prompts:
        engine.add_request(f"g{c}", [], params, gen(c))
    out: dict[str, list[int]] = {c: [] for c in prompts}
    for _ in range(300):
        if not engine.has_work:
            break
        for d in engine.step():
            out[d.request_id[1:]] += d.token_ids
    assert not engine.has_work, "the primitives never ran"
    fresh = tiny_engine(tiny_llama, num_kv_blocks=64, block_size=4)
    for c, tokens in prompts.items():
        assert out[c] == list(fresh.generate([tokens], params)[0].outputs[0].token_ids)
        assert engine.context_tokens(c) == tokens + out[c]


def test_a_context_as_large_as_the_cache_can_still_grow(tiny_llama):
    """Its holder lets go of its partly filled last block for its own next primitive,
    which otherwise needed one block more than the cache had, for ever."""
    engine = tiny_engine(tiny_llama, num_kv_blocks=12, block_size=4)  # 48 tokens of KV
    run(engine, "f1", fill("e"), list(range(1, 46)))  # 45 tokens: all 12 blocks
    assert engine.block_manager.num_free_blocks == 0
    run(engine, "f2", fill("e"), [7])
    assert engine.context_tokens("e") == [*range(1, 46), 7]
    engine.add_request("other", [1, 2, 3], SamplingParams(max_tokens=2))
    for _ in range(100):
        if not engine.has_work:
            break
        engine.step()
    assert not engine.has_work


def test_a_busy_context_cannot_be_saved(engine, tmp_path):
    from app.engine import slot_files

    engine.add_request("f", [1, 2, 3], GREEDY, fill("c"))  # in flight: busy
    with pytest.raises(ConflictError) as info:
        ContextFiles(engine).save("c", str(slot_files.checked_path(tmp_path, "c.bin")))
    assert info.value.param is None and "busy" in info.value.message


def test_an_append_names_the_length_it_extends(engine):
    """`expected_tokens`: an append to a context that is not as long as the caller read
    (lost, re-made, grown) fails with 410 and changes nothing; 0 means it must not exist."""
    from app.protocol.errors import ContextGoneError

    def append(cid: str, expected: int) -> ContextOp:
        return ContextOp(cid, ContextAction.GENERATE, expected_tokens=expected)

    with pytest.raises(ContextGoneError):
        engine.add_request("a0", [1, 2, 3], GREEDY, append("t", 3))  # not there at all
    assert "t" not in engine.contexts.contexts
    out = run(engine, "a1", append("t", 0), [1, 2, 3])  # made, as 0 says it must be
    held = engine.context_tokens("t")
    assert held == [1, 2, 3] + out
    with pytest.raises(ContextGoneError):
        engine.add_request("a2", [9], GREEDY, append("t", 0))  # exists: not a fresh one
    with pytest.raises(ContextGoneError):
        engine.add_request("a3", [9], GREEDY, append("t", len(held) - 1))
    assert engine.context_tokens("t") == held  # unchanged by the refusals
    more = run(engine, "a4", append("t", len(held)), [9])
    assert engine.context_tokens("t") == held + [9] + more
