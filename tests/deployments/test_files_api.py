"""OpenAI's Files API in-process, with the official openai SDK: the real routes, request
guard, SQLite database and data folder (tests/local_app.py). Keys a and b upload; each
sees only its own files, the admin key all; each key's total is bounded."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from fastapi import FastAPI
from sqlalchemy import update

from app.protocol.errors import InvalidRequestError
from deployments.api.files import routes as files_routes
from deployments.api.files.store import FilesStore
from deployments.config import AppConfig
from deployments.files_config import FilesConfig
from deployments.retrieval.extract import extract_text
from deployments.state.database import Database
from deployments.state.files import StoredFile
from tests.deployments.test_extract import make_pdf
from tests.local_app import MODEL, http_client, local_app, run

KEYS = {"a": "sk-files-a", "b": "sk-files-b", "admin": "sk-files-admin"}
MIB = 1024 * 1024
MAX_FILE = 3 * MIB  # over the 2 MiB that bounds other bodies: the guard must allow it
MAX_TOTAL = 4 * MIB


@pytest.fixture(scope="module")
def served(smollm2_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("files")
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "database": {"path": str(root / "app.sqlite3")},
            "files": {
                "data_dir": str(root / "bytes"),
                "max_file_bytes": MAX_FILE,
                "max_total_bytes": MAX_TOTAL,
            },
            "models": [{"name": MODEL}],
            "api_keys": [KEYS["a"], KEYS["b"]],
            "admin_api_keys": [KEYS["admin"]],
        }
    )
    with local_app(config, smollm2_engine) as (app, _):
        yield app, root / "bytes"


def as_keys(served, body):  # noqa: ANN001, ANN201
    async def go():  # noqa: ANN202
        async with http_client(served[0]) as http:
            clients = {
                # No retries: the SDK would send a refused upload again (it retries 409s).
                who: openai.AsyncOpenAI(
                    base_url="http://localhost/v1", api_key=k, http_client=http, max_retries=0
                )
                for who, k in KEYS.items()
            }
            return await body(clients)

    return run(go())


def on_disk(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def codes(*calls) -> list[int]:  # noqa: ANN002
    out = []
    for call in calls:
        try:
            await call
            out.append(200)
        except openai.APIStatusError as exc:
            out.append(exc.status_code)
    return out


def test_upload_retrieve_content_list_delete(served):
    text = "# Notes\n\nCafé au lait.\n".encode()

    async def body(c):  # noqa: ANN001, ANN202
        a = c["a"].files
        made = await a.create(file=("docs/sub/notes.md", text), purpose="assistants")
        got = await a.retrieve(made.id)
        content = await a.content(made.id)
        listed = [f.id for f in (await a.list()).data]
        deleted = await a.delete(made.id)
        gone = await codes(a.retrieve(made.id), a.content(made.id), a.delete(made.id))
        return made, got, content, listed, deleted, gone

    made, got, content, listed, deleted, gone = as_keys(served, body)
    assert made.id.startswith("file-") and made.object == "file" and made.bytes == len(text)
    assert made.filename == "notes.md" and made.purpose == "assistants" and made.expires_at is None
    assert got.id == made.id and got.created_at == made.created_at
    assert content.content == text
    assert content.response.headers["content-type"] == "text/markdown; charset=utf-8"
    assert content.response.headers["content-disposition"].startswith("attachment")
    assert content.response.headers["x-content-type-options"] == "nosniff"
    assert made.id in listed
    assert deleted.id == made.id and deleted.deleted and deleted.object == "file"
    assert gone == [404, 404, 404]
    assert made.id not in on_disk(served[1])  # the bytes went with the row


def test_list_pages_by_cursor_and_filters_by_purpose(served):
    async def body(c):  # noqa: ANN001, ANN202
        a = c["a"].files
        made = [await a.create(file=(f"{i}.txt", b"x"), purpose="user_data") for i in range(3)]
        other = await a.create(file=("o.txt", b"x"), purpose="assistants")
        first = await a.list(purpose="user_data", limit=2, order="asc")
        second = await a.list(purpose="user_data", limit=2, order="asc", after=first.data[-1].id)
        every = [f.id async for f in a.list(purpose="user_data", limit=1)]  # the SDK's paging
        for f in [*made, other]:
            await a.delete(f.id)
        return [f.id for f in made], first, second, every

    made, first, second, every = as_keys(served, body)
    assert [f.id for f in first.data] == made[:2] and first.has_more
    assert [f.id for f in second.data] == made[2:] and not second.has_more
    assert every == made[::-1]  # newest first by default


def test_a_key_sees_only_its_files_and_an_admin_all(served):
    async def body(c):  # noqa: ANN001, ANN202
        mine = await c["a"].files.create(file=("a.txt", b"a's"), purpose="assistants")
        b = c["b"].files
        refused = await codes(b.retrieve(mine.id), b.content(mine.id), b.delete(mine.id))
        listed = {w: [f.id for f in (await c[w].files.list()).data] for w in c}
        admin = await codes(c["admin"].files.retrieve(mine.id), c["admin"].files.content(mine.id))
        await c["admin"].files.delete(mine.id)
        return mine, refused, listed, admin

    mine, refused, listed, admin = as_keys(served, body)
    assert refused == [404, 404, 404]
    assert mine.id in listed["a"] and mine.id in listed["admin"] and mine.id not in listed["b"]
    assert admin == [200, 200]


def test_bytes_past_the_limits_are_refused_and_nothing_kept(served):
    big = b"x" * (MAX_FILE - 10)

    async def body(c):  # noqa: ANN001, ANN202
        b = c["b"].files
        kept = await b.create(file=("big.txt", big), purpose="assistants")  # over 2 MiB: taken
        with pytest.raises(openai.ConflictError) as over_total:  # 2 x 3 MiB > 4 MiB
            await b.create(file=("big2.txt", big), purpose="assistants")
        others = await c["a"].files.create(file=("big.txt", big), purpose="assistants")
        with pytest.raises(openai.APIStatusError) as over_file:  # past max_file_bytes
            await b.create(file=("x.txt", b"x" * (MAX_FILE + 1)), purpose="assistants")
        with pytest.raises(openai.APIStatusError) as over_body:  # past the guard's bound
            await b.create(file=("x.txt", b"x" * (MAX_FILE + MIB)), purpose="assistants")
        for made, who in ((kept, "b"), (others, "a")):
            await c[who].files.delete(made.id)
        after = await b.create(file=("big2.txt", big), purpose="assistants")  # room again
        await b.delete(after.id)
        with pytest.raises(openai.APIStatusError) as chat:  # other bodies keep 2 MiB
            await c["a"].chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x" * (3 * MIB)}]
            )
        return over_total.value, over_file.value, over_body.value, chat.value

    over_total, over_file, over_body, chat = as_keys(served, body)
    assert over_total.status_code == 409 and over_total.body["code"] == "files_quota_exceeded"
    assert "4,194,304" in over_total.body["message"]
    assert over_file.status_code == 413 and over_file.body["code"] == "file_too_large"
    assert over_body.status_code == 413 and over_body.body["code"] == "request_too_large"
    assert chat.status_code == 413
    assert on_disk(served[1]) == []  # no part, no refused file: nothing kept


@pytest.mark.parametrize(
    ("name", "data", "words"),
    [
        ("report.docx", b"PK\x03\x04", "files of type .docx are not supported; supported: .c,"),
        ("Makefile", b"all:\n", "files without an extension"),
        ("fake.pdf", b"hello", "does not start as a PDF"),
        ("blob.py", b"\x00\x01binary", "NUL bytes"),
        ("empty.txt", b"", "is empty"),
    ],
)
def test_types_this_server_does_not_read_are_400s(served, name, data, words):
    async def body(c):  # noqa: ANN001, ANN202
        with pytest.raises(openai.BadRequestError) as refused:
            await c["a"].files.create(file=(name, data), purpose="assistants")
        return refused.value

    refused = as_keys(served, body)
    assert words in refused.body["message"] and refused.body["param"] == "file"
    assert on_disk(served[1]) == []


def test_purpose_and_expiry(served):
    async def body(c):  # noqa: ANN001, ANN202
        a = c["a"].files
        hour = {"anchor": "created_at", "seconds": 3600}
        timed = await a.create(file=("t.txt", b"t"), purpose="assistants", expires_after=hour)
        batch = await a.create(file=("b.jsonl", b"{}\n"), purpose="batch")
        refused = await codes(
            a.create(file=("t.txt", b"t"), purpose="nonsense"),
            a.create(
                file=("t.txt", b"t"), purpose="assistants", expires_after={**hour, "seconds": 5}
            ),
        )
        return timed, batch, refused

    timed, batch, refused = as_keys(served, body)
    assert timed.expires_at == timed.created_at + 3600
    assert batch.expires_at == batch.created_at + 30 * 24 * 3600  # OpenAI's default for batch
    assert refused == [400, 400]
    store = served[0].state.files

    async def expire():  # noqa: ANN202
        def work(s):  # noqa: ANN001, ANN202
            s.execute(update(StoredFile).where(StoredFile.id == timed.id).values(expires_at=1))

        await store.db.work(work)

    run(expire())

    async def after(c):  # noqa: ANN001, ANN202
        gone = await codes(c["a"].files.retrieve(timed.id))
        listed = [f.id for f in (await c["a"].files.list()).data]  # the list sweeps it away
        await c["a"].files.delete(batch.id)
        return gone, listed

    gone, listed = as_keys(served, after)
    assert gone == [404] and timed.id not in listed and batch.id in listed
    assert on_disk(served[1]) == []


def test_retrieval_reads_an_uploaded_pdf_through_the_store(served):
    pdf = make_pdf(["Hello from page one", "And page two"])

    async def body(c):  # noqa: ANN001, ANN202
        made = await c["a"].files.create(file=("doc.pdf", pdf), purpose="assistants")
        stored = await served[0].state.files.on_disk(made.id)  # as the vector stores read it
        text = await asyncio.to_thread(extract_text, stored.path, stored.media_type, 10_000)
        await c["a"].files.delete(made.id)
        return stored, text

    stored, text = as_keys(served, body)
    assert stored.media_type == "application/pdf" and stored.bytes == len(pdf)
    assert text == "Hello from page one\n\nAnd page two"


def test_turned_off_the_routes_are_404s(served, monkeypatch):
    app = served[0]
    off = AppConfig.model_validate({"files": {"enabled": False}})
    bare = FastAPI()
    files_routes.install(bare, SimpleNamespace(config=off))
    assert not hasattr(bare.state, "files")  # nothing made, no folder, no database
    monkeypatch.delattr(app.state, "files")

    async def body(c):  # noqa: ANN001, ANN202
        with pytest.raises(openai.NotFoundError) as listed:
            await c["a"].files.list()
        return listed.value

    assert as_keys(served, body).body["message"] == "the Files API is turned off on this server"


def test_without_keys_every_file_counts_toward_the_servers_total_also_in_a_race(tmp_path):
    config = FilesConfig(data_dir=str(tmp_path / "bytes"), max_file_bytes=100, max_total_bytes=250)
    store = FilesStore(Database(f"sqlite:///{tmp_path / 'app.sqlite3'}"), config)

    async def chunks(*parts: bytes):  # noqa: ANN202
        for part in parts:
            yield part

    async def go():  # noqa: ANN202
        first = await store.create_file(chunks(b"a" * 60, b"a" * 40), "one.txt", "assistants")
        racing = [store.create_file(chunks(b"b" * 100), f"{i}.txt", "user_data") for i in range(4)]
        return first, await asyncio.gather(*racing, return_exceptions=True)

    first, racing = run(go())
    store.close()
    kept = [r["id"] for r in racing if isinstance(r, dict)]
    refused = [r for r in racing if not isinstance(r, dict)]
    assert first["bytes"] == 100 and len(kept) == 1  # 100 + 100 fit in 250; a third never
    assert [(r.status_code, "this server's" in r.message) for r in refused] == [(409, True)] * 3
    assert on_disk(tmp_path / "bytes") == sorted([first["id"], *kept])


def test_a_filename_keeps_neither_folders_nor_control_characters():
    assert files_routes._filename("C:\\Users\\me/docs/a\x00b\tc.md ") == "abc.md"
    for bad in (None, "dir/", "\x00", "x" * 513):
        with pytest.raises(InvalidRequestError):
            files_routes._filename(bad)
