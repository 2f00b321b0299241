"""Fill-in-the-middle prompt layout."""

import copy

from app.text.fim import fim_prompt


def test_fim_prompt_layout(smollm2_tokenizer):
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens(
        {"additional_special_tokens": ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"]}
    )
    ids = fim_prompt(tok, "def add(a, b):", "\n    return c", "", "m")
    vocab = tok.get_vocab()
    assert ids[0] == vocab["<fim_prefix>"] and ids[-1] == vocab["<fim_middle>"]
    assert vocab["<fim_suffix>"] in ids
