"""Vector stores through the official openai SDK, in-process over the real routes, the
real Embedder (all-MiniLM-L6-v2) and a real database: SQLite (sqlite-vec and FTS5) and
PostgreSQL (the exact index and its full-text search) started here."""

import asyncio

import openai
import pytest
from sqlalchemy import update

from deployments.config import AppConfig
from deployments.embeddings import Embedder
from deployments.state.files import Chunk, StoredFile
from tests.local_app import MODEL, http_client, local_app, run
from tests.postgres import postgres_server, unavailable

NO_POSTGRES = unavailable()
POSTGRES = pytest.param(
    "postgresql",
    marks=[pytest.mark.skipif(NO_POSTGRES is not None, reason=str(NO_POSTGRES)), pytest.mark.live],
)
STATIC = {"type": "static", "static": {"max_chunk_size_tokens": 100, "chunk_overlap_tokens": 20}}
DOCS = {
    "bees.md": "# Bees\n\n"
    + "Honey bees live in colonies ruled by a single queen. Worker bees gather nectar "
    "from flowers and turn it into honey inside the hive. A forager tells her sisters "
    "where flowers are with a waggle dance whose angle points at the sun. " * 3,
    "volcano.txt": "Volcanoes form where magma rises through the crust. Basalt lava is "
    "runny and makes shield volcanoes such as Mauna Loa; rhyolite magma is sticky and "
    "erupts explosively, throwing ash and pumice high into the stratosphere. " * 3,
    "bread.html": "<html><head><script>var recipe = 'ignore me';</script></head><body>"
    "<h1>Sourdough</h1><p>A sourdough starter is flour and water fermented by wild yeast "
    "and lactobacilli. Feed it daily, and bake when it doubles within six hours.</p>"
    "<p>Proof the shaped loaf overnight in the fridge, then bake it in a covered pot at "
    "250 degrees.</p></body></html>",
}


@pytest.fixture(scope="module")
def embedder():
    return Embedder(AppConfig().embeddings)


@pytest.fixture(scope="module", params=["sqlite", POSTGRES])
def served(request, smollm2_engine, embedder, tmp_path_factory):
    root = tmp_path_factory.mktemp("vs")

    def app_on(url: str):  # noqa: ANN202
        config = AppConfig.model_validate(
            {
                "database": {"url": url},
                "files": {"data_dir": str(root / "files"), "ingest_lease_s": 1.0},
                "models": [{"name": MODEL}],
            }
        )
        return local_app(config, smollm2_engine, embedder)

    if request.param == "sqlite":
        with app_on(f"sqlite:///{root / 'app.sqlite3'}") as (app, _):
            yield app
        return
    with postgres_server() as url, app_on(url) as (app, _):
        yield app


def scenario(app, body):  # noqa: ANN001, ANN201
    async def go():  # noqa: ANN202
        async with http_client(app) as http:
            client = openai.AsyncOpenAI(
                base_url="http://localhost/v1", api_key="x", http_client=http
            )
            return await body(client)

    return run(go())


async def _indexed(client, **kw):  # noqa: ANN001, ANN202
    store = await client.vector_stores.create(name="notes", chunking_strategy=STATIC, **kw)
    files = [(name, text.encode()) for name, text in DOCS.items()]
    batch = await client.vector_stores.file_batches.upload_and_poll(
        store.id, files=files, poll_interval_ms=100, chunking_strategy=STATIC
    )
    return store, batch


def test_upload_index_search_and_delete(served):
    async def body(client):  # noqa: ANN001, ANN202
        store, batch = await _indexed(client)
        got = await client.vector_stores.retrieve(store.id)
        stores = {v.id: v async for v in client.vector_stores.list()}
        assert stores[store.id].file_counts.completed == 3 and stores[store.id].usage_bytes
        listed = [f async for f in client.vector_stores.files.list(store.id)]
        q = "How do bees tell each other where the flowers are?"
        hits = (await client.vector_stores.search(store.id, query=q, max_num_results=3)).data
        lava = await client.vector_stores.search(store.id, query="explosive eruptions of ash")
        bread = await client.vector_stores.search(store.id, query="what to feed a starter")
        names = {f.id: f.filename async for f in client.files.list()}
        bees_id = next(i for i, n in names.items() if n == "bees.md")
        content = await client.vector_stores.files.content(bees_id, vector_store_id=store.id)
        await client.vector_stores.files.delete(bees_id, vector_store_id=store.id)
        after = await client.vector_stores.search(store.id, query=q, max_num_results=10)
        volcano_id = next(i for i, n in names.items() if n == "volcano.txt")
        await client.files.delete(volcano_id)  # the file itself: it leaves every store
        counted = await client.vector_stores.retrieve(store.id)
        gone = await client.vector_stores.search(store.id, query="explosive eruptions of ash")
        assert all(h.file_id != volcano_id for h in gone.data) and gone.data
        return batch, got, listed, hits, lava, bread, content, after, counted, bees_id

    batch, got, listed, hits, lava, bread, content, after, counted, bees_id = scenario(served, body)
    assert batch.status == "completed" and batch.file_counts.completed == 3
    assert got.status == "completed" and got.file_counts.total == 3 and got.usage_bytes > 0
    assert {f.status for f in listed} == {"completed"} and len(listed) == 3
    assert listed[0].chunking_strategy.static.max_chunk_size_tokens == 100
    assert hits[0].filename == "bees.md" and "waggle dance" in "".join(
        h.content[0].text for h in hits if h.filename == "bees.md"
    )
    assert 0 < hits[0].score <= 1 and len(hits) == 3
    assert lava.data[0].filename == "volcano.txt"
    assert bread.data[0].filename == "bread.html"
    assert not any("ignore me" in h.content[0].text for h in bread.data)  # script dropped
    assert len(content.data) >= 2 and "queen" in content.data[0].text
    assert all(h.file_id != bees_id for h in after.data) and after.data
    assert counted.file_counts.total == 1


def test_bad_files_fail_and_bounds_are_400s(served):
    async def body(client):  # noqa: ANN001, ANN202
        store = await client.vector_stores.create(name="bad")
        broken = await client.files.create(
            file=("x.pdf", b"%PDF-1.4 not a pdf"), purpose="assistants"
        )
        added = await client.vector_stores.files.create_and_poll(
            file_id=broken.id, vector_store_id=store.id, poll_interval_ms=100
        )
        blank = await client.files.create(file=("blank.md", b"  \n\n "), purpose="assistants")
        empty = await client.vector_stores.files.create_and_poll(
            file_id=blank.id, vector_store_id=store.id, poll_interval_ms=100
        )
        errors = []
        for bad in (
            {"max_num_results": 51},
            {"max_num_results": 0},
            {"filters": {"type": "near", "key": "a", "value": 1}},
            {"filters": {"type": ["eq"], "key": "a", "value": 1}},
            {"filters": {"type": "and", "filters": [{"type": {"x": 1}}]}},
            {"filters": {"type": "eq", "key": "a", "value": {"deep": 1}}},
        ):
            with pytest.raises(openai.BadRequestError) as exc:
                await client.vector_stores.search(store.id, query="x", **bad)
            errors.append(exc.value)
        with pytest.raises(openai.BadRequestError):
            await client.vector_stores.search(store.id, query="x" * 5000)
        with pytest.raises(openai.NotFoundError):
            await client.vector_stores.files.create(vector_store_id=store.id, file_id="file-nope")
        with pytest.raises(openai.NotFoundError):
            await client.vector_stores.search("vs_nope", query="x")
        return added, empty, errors

    added, empty, errors = scenario(served, body)
    assert added.status == "failed" and added.last_error.code == "invalid_file"
    assert empty.status == "failed" and "no text" in empty.last_error.message
    assert all(e.status_code == 400 for e in errors)


def test_attribute_filters_and_threshold(served):
    async def body(client):  # noqa: ANN001, ANN202
        store = await client.vector_stores.create(name="filtered", chunking_strategy=STATIC)
        ids = {}
        for name, text in DOCS.items():
            f = await client.files.create(file=(name, text.encode()), purpose="assistants")
            ids[name] = f.id
            await client.vector_stores.files.create_and_poll(
                file_id=f.id,
                vector_store_id=store.id,
                attributes={"topic": name.split(".")[0], "year": 2020 + len(name)},
                poll_interval_ms=100,
            )
        only = await client.vector_stores.search(
            store.id,
            query="bees and flowers",
            filters={"type": "eq", "key": "topic", "value": "volcano"},
        )
        none = await client.vector_stores.search(
            store.id, query="bees and flowers", ranking_options={"score_threshold": 0.99}
        )
        return only, none

    only, none = scenario(served, body)
    assert only.data and {h.filename for h in only.data} == {"volcano.txt"}
    assert only.data[0].attributes["topic"] == "volcano"
    assert none.data == []


def test_an_ingestion_cut_short_is_taken_up_whole(served, embedder):
    """An ingestor stopped mid-file (its ingress killed) leaves the file in_progress with
    no chunks; after its lease runs out, an ingestor takes it up again and the store
    holds every chunk once."""
    retrieval = served.state.retrieval

    async def body(client):  # noqa: ANN001, ANN202
        store = await client.vector_stores.create(name="cut", chunking_strategy=STATIC)
        text = (DOCS["volcano.txt"] + DOCS["bees.md"]) * 6
        f = await client.files.create(file=("long.md", text.encode()), purpose="assistants")
        real = retrieval.embedder
        started = asyncio.Event()

        class Slow:  # the Embedder as seen through a handle, slowed to be cut mid-file
            chunk = real.chunk

            class embed_passages:  # noqa: N801
                @staticmethod
                async def remote(ids):  # noqa: ANN001, ANN205
                    started.set()
                    await asyncio.sleep(30)

        retrieval.ingestor.embedder = Slow
        await client.vector_stores.files.create(
            vector_store_id=store.id, file_id=f.id, chunking_strategy=STATIC
        )
        await asyncio.wait_for(started.wait(), 30)
        await retrieval.ingestor.stop()  # the kill: nothing written
        cut = await client.vector_stores.files.retrieve(f.id, vector_store_id=store.id)
        chunks_then = await retrieval.db.work(
            lambda s: s.query(Chunk).filter_by(file_id=f.id).count()
        )
        retrieval.ingestor.embedder = real
        done = await client.vector_stores.files.poll(
            f.id, vector_store_id=store.id, poll_interval_ms=200
        )
        rows = await retrieval.db.work(
            lambda s: [c.position for c in s.query(Chunk).filter_by(file_id=f.id)]
        )
        return cut, chunks_then, done, rows, len(embedder.chunk(text, 100, 20))

    cut, chunks_then, done, rows, expected = scenario(served, body)
    assert cut.status == "in_progress" and chunks_then == 0
    assert done.status == "completed"
    assert sorted(rows) == list(range(expected)) and expected > 2


def test_an_expired_file_leaves_its_stores(served):
    """A file past its expires_after is swept by the next upload or list, with its
    chunks in every store (as a deleted one is)."""
    retrieval = served.state.retrieval

    async def body(client):  # noqa: ANN001, ANN202
        store = await client.vector_stores.create(name="expiring", chunking_strategy=STATIC)
        f = await client.files.create(
            file=("bees.md", DOCS["bees.md"].encode()),
            purpose="assistants",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
        await client.vector_stores.files.create_and_poll(
            file_id=f.id, vector_store_id=store.id, poll_interval_ms=100
        )
        found = await client.vector_stores.search(store.id, query="waggle dance")

        def expire(s):  # noqa: ANN001, ANN202
            s.execute(update(StoredFile).where(StoredFile.id == f.id).values(expires_at=1))

        await retrieval.db.work(expire)
        [x async for x in client.files.list()]  # the sweep
        after = await client.vector_stores.search(store.id, query="waggle dance")
        counted = await client.vector_stores.retrieve(store.id)
        return found, after, counted

    found, after, counted = scenario(served, body)
    assert found.data and not after.data
    assert counted.file_counts.total == 0 and counted.usage_bytes == 0
