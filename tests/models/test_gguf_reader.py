"""QuickGGUFReader reads what gguf's own reader reads: every field (its parts, their
dtypes and byte order, its value) and every tensor."""

import gguf
import numpy as np
import pytest
from gguf.gguf_reader import GGUFReader as GgufOwnReader

from app.models.gguf_reader import QuickGGUFReader, quick_gguf_reads
from app.models.source import default_model_path
from tests.models.family_checkpoints import save_family_checkpoint
from tests.models.gguf_writer import write_gguf


def assert_same_reading(path: str) -> None:
    theirs, ours = GgufOwnReader(path), QuickGGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data)
        assert len(mine.parts) == len(field.parts)
        for a, b in zip(mine.parts, field.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        if len(field.data) < 100:  # the vocabulary's contents are the parts above
            assert repr(mine.contents()) == repr(field.contents())
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_elements) == (
            tensor.name,
            tensor.tensor_type,
            tensor.n_elements,
        )
        assert list(mine.shape) == list(tensor.shape) and mine.data_offset == tensor.data_offset
        assert mine.data.dtype == tensor.data.dtype and np.array_equal(mine.data, tensor.data)


def test_the_default_model_reads_the_same():
    assert_same_reading(str(default_model_path()))


def test_a_quantized_family_file_reads_the_same(tmp_path):
    directory = save_family_checkpoint(tmp_path / "qwen3", "qwen3")
    path = write_gguf(directory, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    assert_same_reading(str(path))


def test_a_big_endian_file_reads_the_same(tmp_path):
    path = tmp_path / "big.gguf"
    writer = gguf.GGUFWriter(str(path), "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_uint32("test.count", 7)
    writer.add_array("test.tokens", ["a", "bc", "déf"])
    writer.add_array("test.scores", [0.5, -1.25])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_reading(str(path))
    assert QuickGGUFReader(str(path)).fields["test.tokens"].contents() == ["a", "bc", "déf"]


def test_transformers_reads_through_it():
    quick_gguf_reads()
    assert gguf.GGUFReader is QuickGGUFReader
    assert quick_gguf_reads() is QuickGGUFReader  # idempotent


def test_a_file_that_is_not_gguf_still_fails(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="magic"):
        QuickGGUFReader(str(path))
