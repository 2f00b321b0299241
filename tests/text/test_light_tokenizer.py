"""The ingress's torch-free tokenizer (also the Tokenizer deployment's for a GGUF, through
`load_tokenizer`) encodes, decodes and renders as transformers' own does, and loads
without torch once its GGUF was converted (by a child process when the caller has none)."""

import random
import subprocess
import sys
from pathlib import Path

import pytest

from app.models.source import ModelSource, resolve_model
from app.text.light_tokenizer import load_light_tokenizer
from app.text.tokenizer import load_tokenizer
from app.text.transformers_tokenizer import load_transformers_tokenizer
from tests.helpers import save_tiny_checkpoint
from tests.models.gguf_writer import write_gguf

ROOT = Path(__file__).resolve().parents[2]
TEXT = "Héllo wörld, 你好!\n\n  code: `x = 1`"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SHOAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def default_full():  # noqa: ANN201
    """transformers' own tokenizer of the default GGUF (read once: it parses the file)."""
    return load_transformers_tokenizer(resolve_model("default"))


def assert_same_tokenizer(light, full) -> None:
    assert light.chat_template == full.chat_template
    assert (light.bos_token, light.eos_token, light.eos_token_id) == (
        full.bos_token,
        full.eos_token,
        full.eos_token_id,
    )
    assert light.get_vocab() == full.get_vocab()
    rng = random.Random(0)
    size = len(full.get_vocab())
    specials = [i for i in full.all_special_ids if i is not None]
    for _ in range(50):
        ids = [rng.randrange(size) for _ in range(rng.randrange(1, 40))] + specials[:2]
        for skip in (False, True):
            assert light.decode(ids, skip_special_tokens=skip) == full.decode(
                ids, skip_special_tokens=skip
            )
    ids = full(TEXT, add_special_tokens=False).input_ids
    assert light.decode(ids) == full.decode(ids)
    words = sorted(set(full.get_vocab()) - set(full.all_special_tokens))
    texts = [TEXT, "", " lead", "\t\ttabs  and   spaces ", "émoji 🤖"]
    texts += ["".join(rng.choice(words) for _ in range(rng.randrange(1, 12))) for _ in range(60)]
    for text in texts:
        for special in (True, False):
            assert (
                light(text, add_special_tokens=special).input_ids
                == full(text, add_special_tokens=special).input_ids
            )
    if full.chat_template is not None:
        chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
        for prompt in (True, False):
            assert light.apply_chat_template(
                chat, tokenize=True, add_generation_prompt=prompt
            ) == full.apply_chat_template(chat, tokenize=True, add_generation_prompt=prompt)


def test_the_default_gguf_decodes_as_transformers_does(cache, default_full):
    light, full = load_light_tokenizer(resolve_model("default")), default_full
    assert_same_tokenizer(light, full)
    assert light.decode(full(TEXT, add_special_tokens=False).input_ids) == TEXT
    assert len(list((cache / "tokenizers").iterdir())) == 1  # converted once, kept
    kept = load_tokenizer(resolve_model("default"))  # the Tokenizer deployment's
    assert type(kept) is type(full) and kept.name_or_path == light.name_or_path


def test_a_sentencepiece_gguf_decodes_as_transformers_does(cache, tmp_path):
    checkpoint = save_tiny_checkpoint(tmp_path / "llama")
    gguf = write_gguf(checkpoint, tmp_path / "llama.gguf")
    source = ModelSource("llama", gguf.parent, gguf.name)
    assert_same_tokenizer(load_light_tokenizer(source), load_transformers_tokenizer(source))


def test_a_checkpoint_directory_loads_its_tokenizer_json(cache, tmp_path, default_full):
    default_full.save_pretrained(tmp_path / "hf")
    source = ModelSource("hf", tmp_path / "hf")
    assert_same_tokenizer(load_light_tokenizer(source), load_tokenizer(source))


def test_a_checkpoint_whose_tokenizer_class_rebuilds_it_is_converted(cache, tmp_path):
    """A sentencepiece-style tokenizer.json under a tokenizer_config naming LlamaTokenizer:
    transformers rebuilds the pipeline from the vocabulary (its own pre-tokenizer and
    decoder) rather than load the file as written; the light tokenizer is that one too."""
    import json

    checkpoint = save_tiny_checkpoint(tmp_path / "llama")
    gguf = write_gguf(checkpoint, tmp_path / "llama.gguf")
    source = ModelSource("llama", gguf.parent, gguf.name)
    load_transformers_tokenizer(source).save_pretrained(tmp_path / "hf")
    config_file = tmp_path / "hf" / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    source = ModelSource("llama-class", tmp_path / "hf")
    light, full = load_light_tokenizer(source), load_tokenizer(source)
    assert type(full).__name__ == "LlamaTokenizer"  # the case this is about
    assert_same_tokenizer(light, full)
    assert len(list((cache / "tokenizers").iterdir())) == 1  # converted, kept


def test_the_configured_template_replaces_the_models_own(cache, tmp_path, default_full):
    default_full.save_pretrained(tmp_path / "hf")  # no conversion needed for this one
    light = load_light_tokenizer(ModelSource("hf", tmp_path / "hf"), "{{ messages[0].content }}")
    assert light.chat_template == "{{ messages[0].content }}"


def test_a_process_without_torch_converts_in_a_child_and_stays_without_torch(cache):
    """The first load converts in a child process, the second reads the cache; neither
    imports torch into the caller."""
    code = (
        "import sys; from app.models.source import resolve_model; "
        "from app.text.light_tokenizer import load_light_tokenizer; "
        "ts = [load_light_tokenizer(resolve_model('default')) for _ in range(2)]; "
        "assert all(t.decode([1, 9690, 2]) == '<|im_start|>system<|im_end|>' for t in ts); "
        "assert 'torch' not in sys.modules and 'transformers.integrations.gguf.reader' "
        "not in sys.modules"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(list((cache / "tokenizers").iterdir())) == 1


def test_a_corrupt_gguf_is_a_model_load_error(cache, tmp_path):
    from app.protocol.errors import ModelLoadError

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    code = (
        "import sys\nfrom pathlib import Path\nfrom app.models.source import ModelSource\n"
        "from app.protocol.errors import ModelLoadError\n"
        "from app.text.light_tokenizer import load_light_tokenizer\n"
        f"p = Path({str(bad)!r})\n"
        "try:\n    load_light_tokenizer(ModelSource('bad', p.parent, p.name))\n"
        "except ModelLoadError as e:\n    print('refused', e)\nelse:\n    sys.exit(3)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and "refused" in result.stdout, result.stderr[-2000:]
    with pytest.raises(ModelLoadError):  # in a process with torch: the same refusal
        load_light_tokenizer(ModelSource("bad", bad.parent, bad.name))
    assert [p.name for p in (cache / "tokenizers").iterdir()] == []  # no half conversion


def test_a_conversion_killed_midway_leaves_nothing_for_long(cache):
    """The next conversion removes staging directories older than any live conversion
    and keeps a younger one (a conversion that may still be running)."""
    import os
    import time

    from app.text.light_tokenizer import STALE_STAGING_S

    parent = cache / "tokenizers"
    old, young = parent / ".convert-killed", parent / ".convert-running"
    for staging in (old, young):
        staging.mkdir(parents=True)
        (staging / "tokenizer.json").write_text("{")
    long_ago = time.time() - STALE_STAGING_S - 60
    os.utime(old, (long_ago, long_ago))
    load_light_tokenizer(resolve_model("default"))  # a fresh cache: converts it
    assert not old.exists() and young.is_dir()
