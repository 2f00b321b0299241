"""The app's files and vector stores (`files` in AppConfig): where uploaded files' bytes
live, how large they may be, and the bounds of retrieval. Its own file so that config.py
stays a page."""

import os

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_DATA_DIR = "~/.shoal/files"


class FilesConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    data_dir: str = Field(
        default_factory=lambda: os.environ.get("SHOAL_DATA_DIR", DEFAULT_DATA_DIR),
        description="Where uploaded files' bytes live (their rows are in `database`). Every "
        "ingress replica must see the same folder: on KubeRay a shared volume.",
    )
    max_file_bytes: int = Field(64 * 1024 * 1024, ge=1, description="One upload; past it 413.")
    max_total_bytes: int = Field(
        4 * 1024 * 1024 * 1024,
        ge=1,
        description="All the files of one key (of everyone when keys are off); past it 409.",
    )
    max_text_chars: int = Field(
        16 * 1024 * 1024,
        ge=1,
        description="The text extracted from one file; a file that would give more (a PDF "
        "or HTML bomb) fails to index with an error that says so.",
    )
    max_files_per_store: int = Field(10_000, ge=1, description="Past it 409.")
    max_chunks_per_file: int = Field(20_000, ge=1, description="Past it the file fails.")
    max_query_chars: int = Field(4096, ge=1, description="A search's query; past it 400.")
    embed_batch: int = Field(64, ge=1, description="Chunks embedded in one Embedder call.")
    ingest_lease_s: float = Field(
        30.0,
        gt=0,
        description="A file being indexed whose ingress has not touched it for this long (a "
        "crash, a restart) is taken up again by any ingress.",
    )
