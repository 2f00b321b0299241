"""The ingestor against what happens around it, on a real SQLite database and the real
Embedder (no app): a first commit that rolls back leaves nothing behind that breaks
the next file or a search; a file cancelled while it was being embedded is not indexed;
a file whose text the model cannot read fails; a failure says what kind, not its SQL."""

import asyncio

import pytest
from sqlalchemy import update

import deployments.retrieval.ingest as ingest
from deployments.config import AppConfig
from deployments.embeddings import Embedder
from deployments.files_config import FilesConfig
from deployments.retrieval.ingest import Lease
from deployments.retrieval.service import Retrieval
from deployments.state.files import Chunk, StoredFile, VectorStore, VectorStoreFile
from tests.local_app import LocalHandle

TEXT = "Honey bees live in colonies ruled by a single queen. Worker bees gather nectar. " * 20
CHUNKING = {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 20}


@pytest.fixture(scope="module")
def embedder():
    return Embedder(AppConfig().embeddings)


@pytest.fixture
def retrieval(tmp_path, embedder):
    config = FilesConfig(data_dir=str(tmp_path / "files"), ingest_lease_s=1.0)
    r = Retrieval(f"sqlite:///{tmp_path / 'x.sqlite3'}", config, LocalHandle(embedder))
    r.data_dir.mkdir(parents=True)
    yield r
    asyncio.run(r.stop())


def _add(r: Retrieval, file_id: str, text: str) -> None:
    """A file and a store holding it, queued, as the routes leave them."""
    (r.data_dir / file_id).write_text(text)

    def work(s):  # noqa: ANN001, ANN202
        s.add(
            StoredFile(
                id=file_id,
                filename=f"{file_id}.txt",
                purpose="assistants",
                bytes=len(text),
                media_type="text/plain; charset=utf-8",
            )
        )
        s.add(VectorStore(id=f"vs-{file_id}", meta={}, last_active_at=0, version=0))
        s.add(
            VectorStoreFile(
                store_id=f"vs-{file_id}",
                file_id=file_id,
                chunking=CHUNKING,
                status="in_progress",
                usage_bytes=0,
                leased_at=0.0,
            )
        )

    asyncio.run(r.db.work(work))


def _index(r: Retrieval) -> Lease:
    async def go() -> Lease:
        lease = await r.db.work(r.ingestor._claim)
        assert lease is not None
        await r.ingestor.index_one(lease)
        return lease

    return asyncio.run(go())


def _row(r: Retrieval, file_id: str) -> VectorStoreFile:
    return asyncio.run(
        r.db.work(lambda s: s.query(VectorStoreFile).filter_by(file_id=file_id).one())
    )


def _chunks(r: Retrieval, file_id: str) -> int:
    return asyncio.run(r.db.work(lambda s: s.query(Chunk).filter_by(file_id=file_id).count()))


def test_a_first_commit_rolled_back_leaves_the_indexes_usable(retrieval, monkeypatch):
    """The first commit makes the vector and full-text tables; when it rolls back they
    go with it, and the next file must make them again (not trust a memory of them)."""
    real = ingest._touch

    def broken(s, store_id):  # noqa: ANN001, ANN202
        raise RuntimeError("the database went away mid-commit")

    monkeypatch.setattr(ingest, "_touch", broken)
    _add(retrieval, "file-a", TEXT)
    _index(retrieval)
    failed = _row(retrieval, "file-a")
    assert failed.status == "failed" and _chunks(retrieval, "file-a") == 0
    assert failed.last_error == {
        "code": "server_error",
        "message": "indexing failed (RuntimeError)",
    }

    monkeypatch.setattr(ingest, "_touch", real)
    _add(retrieval, "file-b", TEXT)
    _index(retrieval)
    assert _row(retrieval, "file-b").status == "completed" and _chunks(retrieval, "file-b") > 1
    found = asyncio.run(retrieval.search(["vs-file-b"], "who rules the colony?", 3))
    assert found and found[0].file_id == "file-b"


def test_a_file_cancelled_while_it_is_embedded_is_not_indexed(retrieval, embedder):
    _add(retrieval, "file-c", TEXT)
    real = embedder.embed_passages

    def cancel_then_embed(passages):  # noqa: ANN001, ANN202
        with retrieval.db.engine.begin() as conn:  # another ingress's cancel, committed
            conn.execute(
                update(VectorStoreFile)
                .where(VectorStoreFile.file_id == "file-c")
                .values(status="cancelled")
            )
        return real(passages)

    retrieval.ingestor.embedder = LocalHandle(
        type(
            "E",
            (),
            {
                "chunk": staticmethod(embedder.chunk),
                "embed_passages": staticmethod(cancel_then_embed),
            },
        )
    )
    _index(retrieval)
    assert _row(retrieval, "file-c").status == "cancelled" and _chunks(retrieval, "file-c") == 0


@pytest.mark.parametrize("text", ["\u200b\u200b\u200b", "\x01\x02\x03 \x04"])
def test_a_file_with_nothing_the_model_reads_fails(retrieval, text):
    _add(retrieval, "file-z", text)
    _index(retrieval)
    row = _row(retrieval, "file-z")
    assert row.status == "failed" and "no text" in row.last_error["message"]
