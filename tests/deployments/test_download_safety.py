"""Downloads that cannot fill the disk, corrupt a model or leave https, and an operator
whose state needs no Assistants database: in-process, through the real routes, against
the local fixture hub over real HTTP (tests/fixture_hub.py)."""

import hashlib
import shutil
import uuid
from pathlib import Path

import pytest

from deployments.config import AppConfig
from deployments.operator.operator import Operator
from deployments.url_guard import HostPolicy, TargetRefusedError, guarded_client
from tests.deployments import test_operator_downloads as downloads
from tests.deployments.test_operator_downloads import REPO, client_for, make_config, wait_for

# The fixtures of the downloads tests: the fixture hub serving a tiny chat model, and
# huggingface_hub's own HTTP client back after each test.
hub, tiny_chat, _hub_client_restored = (
    downloads.hub,
    downloads.tiny_chat,
    downloads._hub_client_restored,
)
BIG = "shoal-test/big"  # one 4096-byte file


def repo_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir())


def unwritable(tmp_path: Path) -> Path:
    """A database path no one can make, root included: its parent is a file."""
    (tmp_path / "not-a-directory").write_text("")
    return tmp_path / "not-a-directory" / "shoal.sqlite3"


# ---- the operator's own state ---------------------------------------------------------


def test_operator_needs_no_app_database_with_assistants_off(hub, tmp_path):
    """KubeRay's read-only root: the app's SQLite file cannot be made. The Operator keeps
    its download list beside its downloads (models_dir), so it starts, downloads, and a
    new Operator finds the list again. (The ingress, another replica, keeps stored
    Responses in the app's database: here it gets one it can write.)"""
    ingress_config = make_config(hub, tmp_path)
    base = ingress_config.model_dump()
    base.update(assistants={"enabled": False}, database={"path": str(unwritable(tmp_path))})
    config = AppConfig.model_validate(base)
    with client_for(ingress_config, Operator(config)) as client:
        params = {"modelRepo": REPO, "filePath": "config.json"}
        assert client.get("/api/downloads/enqueue", params=params).status_code == 200
        wait_for(client, "complete", "config.json")
    with client_for(ingress_config, Operator(config)) as client:
        (item,) = client.get("/api/downloads").json()["DownloadItems"]
        assert item["status"] == "complete" and item["filePath"] == "config.json"
    assert (tmp_path / "models" / ".shoal-operator" / "state.sqlite3").is_file()


# ---- quota and free-space floor ---------------------------------------------------------


def test_total_quota_counts_the_disk_and_the_downloads_under_way(hub, tiny_chat, tmp_path):
    total = repo_bytes(tiny_chat)
    # What is already in models_dir counts, whatever put it there.
    (tmp_path / "models" / "local").mkdir(parents=True)
    (tmp_path / "models" / "local" / "own.gguf").write_bytes(b"\0" * 3000)
    config = make_config(hub, tmp_path, max_total_download_bytes=6000, min_free_disk_fraction=0)
    with client_for(config) as client:
        r = client.get("/api/downloads/enqueue", params={"modelRepo": BIG})
        assert r.status_code == 409 and "quota" in r.json()["error"], r.text
        assert client.get("/api/downloads").json()["DownloadItems"] == []
        r = client.post("/api/pull", json={"model": BIG, "stream": False})
        assert r.status_code == 409 and "quota" in r.json()["error"], r.text
    # A download under way holds the bytes it has still to fetch.
    (tmp_path / "models" / "local" / "own.gguf").unlink()
    hub.rate = 2 << 20
    config = make_config(hub, tmp_path, max_total_download_bytes=total + 2000)
    with client_for(config) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        wait_for(client, "downloading")
        r = client.get("/api/downloads/enqueue", params={"modelRepo": BIG})
        assert r.status_code == 409 and "quota" in r.json()["error"], r.text
        client.get("/api/downloads/cancel", params={"modelRepo": REPO})


@pytest.fixture
def small_disk():
    """A models_dir on tmpfs (/dev/shm), whose free space nothing else here changes."""
    root = Path("/dev/shm") / f"shoal-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def test_free_space_floor_refuses_before_any_byte_and_while_fetching(hub, tiny_chat, small_disk):
    free = shutil.disk_usage(small_disk).free
    config = make_config(hub, small_disk, min_free_disk_bytes=free + 1, min_free_disk_fraction=0)
    with client_for(config) as client:
        r = client.get("/api/downloads/enqueue", params={"modelRepo": BIG})
        assert r.status_code == 507 and "free" in r.json()["error"], r.text
        r = client.post("/api/pull", json={"model": BIG, "stream": False})
        assert r.status_code == 507 and "free" in r.json()["error"], r.text
        assert not list((small_disk / "models").rglob("*.bin*"))
    # Room for it when it starts; something else then takes the margin.
    total = repo_bytes(tiny_chat)
    free = shutil.disk_usage(small_disk).free
    hub.rate = 2 << 20
    config = make_config(
        hub, small_disk, min_free_disk_bytes=free - total - (16 << 20), min_free_disk_fraction=0
    )
    with client_for(config) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        wait_for(client, "downloading")
        (small_disk / "filler").write_bytes(b"\0" * (64 << 20))
        item = wait_for(client, "error")
        assert "free" in item["error"]


# ---- the Hub's digests ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_unlike_its_listed_digest_fails_and_leaves_nothing(hub, tiny_chat, tmp_path, name):
    """Weights are checked against the listing's lfs.sha256, other files against their
    git blob id; a mismatch ends the item in `error` and leaves no file."""
    data = bytearray((tiny_chat / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the digest can tell
    hub.tampered[(REPO, name)] = bytes(data)
    with client_for(make_config(hub, tmp_path)) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO, "filePath": name})
        item = wait_for(client, "error", name)
        assert ("sha256" if name.endswith(".safetensors") else "blob") in item["error"]
    local = tmp_path / "models" / REPO
    assert not (local / name).exists() and not (local / f"{name}.part").exists()
    # The real bytes then download and verify.
    del hub.tampered[(REPO, name)]
    with client_for(make_config(hub, tmp_path)) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO, "filePath": name})
        wait_for(client, "complete", name)
    assert (local / name).read_bytes() == (tiny_chat / name).read_bytes()


def test_a_resumed_file_is_checked_whole(hub, tiny_chat, tmp_path):
    """A `.part` left by an earlier try that does not match is found out at the end."""
    weights = (tiny_chat / "model.safetensors").read_bytes()
    part = tmp_path / "models" / REPO / "model.safetensors.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"\x01" * 4096)  # not the file's first bytes
    assert hashlib.sha256(weights).digest() != hashlib.sha256(b"\x01" * 4096).digest()
    params = {"modelRepo": REPO, "filePath": "model.safetensors"}
    with client_for(make_config(hub, tmp_path)) as client:
        client.get("/api/downloads/enqueue", params=params)
        assert "sha256" in wait_for(client, "error", "model.safetensors")["error"]
    assert not part.exists()


# ---- no plain http past the hub ---------------------------------------------------------


def test_a_redirect_to_plain_http_on_a_storage_host_is_refused(hub, tmp_path):
    port = hub.url.rsplit(":", 1)[1]
    hub.redirects[(REPO, "config.json")] = f"http://localhost:{port}/x"
    config = make_config(
        hub, tmp_path, storage_hosts=["localhost"], private_hosts=["127.0.0.1", "localhost"]
    )
    with client_for(config) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO, "filePath": "config.json"})
        item = wait_for(client, "error", "config.json")
        assert "plain http" in item["error"]
    assert not any(path == "/x" for path in hub.requests)


def test_plain_http_only_to_a_hub_configured_so(hub):
    """An https hub is never reached over http (a downgrade, by redirect or otherwise);
    an http hub (a mirror in the cluster, this fixture) keeps http for its own origin."""
    port = int(hub.url.rsplit(":", 1)[1])

    def loopback(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    https_hub = HostPolicy.for_hub(
        "https://hub.test", [], private_hosts=["hub.test"], resolver=loopback
    )
    with guarded_client(https_hub, timeout_s=5) as client, pytest.raises(TargetRefusedError):
        client.get(f"http://hub.test:{port}/api/models/{REPO}")
    http_hub = HostPolicy.for_hub(
        f"http://hub.test:{port}", [], private_hosts=["hub.test"], resolver=loopback
    )
    with guarded_client(http_hub, timeout_s=5) as client:
        assert client.get(f"http://hub.test:{port}/api/models/{REPO}").status_code == 200
        with pytest.raises(TargetRefusedError, match="plain http"):
            client.get(f"http://hub.test:{port + 1}/api/models/{REPO}")  # another origin
