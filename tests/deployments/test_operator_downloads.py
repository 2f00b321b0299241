"""The operator's downloads through the real routes, in-process, against a local fixture
hub over real HTTP: progress, filters, cancel, resume after a restart, reset, the size
cap, bad names; the SSRF guard; events on the WebSocket in order; client log lines."""

import base64
import logging
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from deployments.config import AppConfig
from deployments.http.app import create_app
from deployments.ingress import Ingress
from deployments.operator.operator import Operator
from deployments.operator.serve_deployer import ServeDeployer
from deployments.tokenizer import Tokenizer
from deployments.url_guard import HostPolicy, TargetRefusedError, guarded_client
from tests.fixture_hub import fixture_hub, save_tiny_chat_model
from tests.local_app import LocalHandle

REPO = "shoal-test/tiny-chat"


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


@pytest.fixture
def hub(tiny_chat):
    with fixture_hub() as hub:
        hub.add_directory(REPO, tiny_chat)
        hub.local_dir = tiny_chat
        hub.add_repo("shoal-test/big", {"weights.bin": b"\0" * 4096})
        yield hub


@pytest.fixture(autouse=True)
def _hub_client_restored():
    """The operator installs its guarded client in huggingface_hub for the process: the
    tests after these get huggingface_hub's own back."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.utils._http import default_client_factory

    xet, chunk = constants.HF_HUB_DISABLE_XET, constants.DOWNLOAD_CHUNK_SIZE
    yield
    huggingface_hub.set_client_factory(default_client_factory)
    constants.HF_HUB_DISABLE_XET, constants.DOWNLOAD_CHUNK_SIZE = xet, chunk


def make_config(hub, state: Path, **operator) -> AppConfig:
    tiny = hub.local_dir  # served by name only: its tokenizer loads fast
    return AppConfig.model_validate(
        {
            "models": [{"name": "tiny", "engine": {"model": str(tiny)}}],
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(state / "shoal.sqlite3")},
            "operator": {
                "hub_endpoint": hub.url,
                "private_hosts": ["127.0.0.1"],
                "models_dir": str(state / "models"),
                "max_download_bytes": 64 << 20,
                **operator,
            },
        }
    )


def client_for(config: AppConfig, operator: Operator | None = None) -> TestClient:
    operator = operator or Operator(config)
    tokenizer = LocalHandle(Tokenizer(config.models))
    ingress = Ingress(config, tokenizer, {}, operator=LocalHandle(operator))
    # A client on this machine, as the operator's actions need without admin keys.
    app = create_app(ingress)
    return TestClient(app, base_url="http://localhost", client=("127.0.0.1", 50000))


def crash(operator: Operator) -> None:
    """Stop the operator's downloads as a dying process would: mid-file, their items
    still saying `downloading`."""
    for progress in list(operator.downloads.running.values()):
        progress.cancel.set()
    deadline = time.time() + 10
    while operator.downloads.running:
        assert time.time() < deadline
        time.sleep(0.05)


def wait_for(client: TestClient, status: str, file_path: str | None = None, timeout_s=60) -> dict:
    params = {"modelRepo": REPO, **({"filePath": file_path} if file_path else {})}
    deadline = time.time() + timeout_s
    while True:
        items = client.get("/api/downloads", params=params).json()["DownloadItems"]
        if items and items[0]["status"] == status:
            return items[0]
        assert time.time() < deadline, f"no {status}: {items}"
        time.sleep(0.1)


def test_download_progress_filter_and_reset(hub, tiny_chat, tmp_path):
    with client_for(make_config(hub, tmp_path)) as client:
        item = client.get("/api/downloads/enqueue", params={"modelRepo": REPO}).json()
        assert item["isa"] == "DownloadItem" and item["status"] in ("queued", "downloading")
        total = sum(p.stat().st_size for p in tiny_chat.iterdir())
        assert item["totalBytes"] == total
        done = wait_for(client, "complete")
        assert done["downloadedBytes"] == total and done["progress"] == 1.0
        local = tmp_path / "models" / REPO
        for p in tiny_chat.iterdir():
            assert (local / p.name).read_bytes() == p.read_bytes()
        # Enqueue again: nothing new to fetch. Filters select.
        again = client.get("/api/downloads/enqueue", params={"modelRepo": REPO}).json()
        assert again["status"] == "complete"
        one = client.get(
            "/api/downloads/enqueue", params={"modelRepo": REPO, "filePath": "config.json"}
        ).json()
        assert one["totalBytes"] == (tiny_chat / "config.json").stat().st_size
        wait_for(client, "complete", "config.json")
        listed = client.get("/api/downloads", params={"filePath": "config.json"}).json()
        assert [d["filePath"] for d in listed["DownloadItems"]] == ["config.json"]
        assert len(client.get("/api/downloads").json()["DownloadItems"]) == 2
        # The catalog lists the downloaded repo, inferable, with a memory estimate.
        models = client.get("/api/models").json()["models"]
        entry = next(m for m in models if m["id"] == REPO)
        assert entry["isa"] == "AIModel" and entry["normalizedQuantizedMemRequired"] > 0
        assert any(i["isDownloaded"] for i in entry["items"])
        # Reset deletes the files and the item.
        gone = client.get("/api/downloads/reset", params={"modelRepo": REPO}).json()
        assert gone["modelRepo"] == REPO
        assert not local.exists()
        assert client.get("/api/downloads", params={"filePath": ""}).json()["DownloadItems"] == []


def assert_resumed_whole(hub, tiny_chat: Path, state: Path) -> None:
    """The weights were fetched again from a byte past 0 (Range), and are whole."""
    assert [start for path, start in hub.ranges if path == "model.safetensors"][0] > 0
    weights = (tiny_chat / "model.safetensors").read_bytes()
    assert (state / "models" / REPO / "model.safetensors").read_bytes() == weights


def test_cancel_then_resume_after_restart(hub, tiny_chat, tmp_path):
    config = make_config(hub, tmp_path)
    hub.rate = 2 << 20  # 2 MB/s: a ~13 MB repo takes seconds
    with client_for(config) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        item = wait_for(client, "downloading")
        deadline = time.time() + 30
        while item["downloadedBytes"] < 1 << 20:
            assert time.time() < deadline
            time.sleep(0.2)
            item = client.get("/api/downloads").json()["DownloadItems"][0]
        cancelled = client.get("/api/downloads/cancel", params={"modelRepo": REPO}).json()
        assert cancelled["status"] == "cancelled"
        kept = cancelled["downloadedBytes"]
        assert 0 < kept < cancelled["totalBytes"]
    # A new operator on the same database: the truth is reported, and enqueue resumes
    # from the bytes on disk (a Range request), not from the start.
    hub.rate = None
    hub.ranges.clear()
    with client_for(config) as client:
        listed = client.get("/api/downloads").json()["DownloadItems"]
        assert listed[0]["status"] == "cancelled"
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        wait_for(client, "complete")
    assert_resumed_whole(hub, tiny_chat, tmp_path)


def test_interrupted_download_resumes_when_the_operator_starts(hub, tiny_chat, tmp_path):
    config = make_config(hub, tmp_path)
    hub.rate = 2 << 20
    first = Operator(config)
    with client_for(config, first) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        wait_for(client, "downloading")
        time.sleep(1.5)
        crash(first)
        assert client.get("/api/downloads").json()["DownloadItems"][0]["status"] == "downloading"
    # The operator stopped while downloading (its item still says so): it resumes alone,
    # from where it was.
    hub.rate = None
    hub.ranges.clear()
    with client_for(config) as client:
        client.get("/api/downloads")  # the first call starts the operator's work
        assert wait_for(client, "complete")["progress"] == 1.0
    assert_resumed_whole(hub, tiny_chat, tmp_path)


def test_a_hub_that_ignores_range_still_gives_a_whole_file(hub, tiny_chat, tmp_path):
    config = make_config(hub, tmp_path)
    hub.rate = 2 << 20
    with client_for(config) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        wait_for(client, "downloading")
        time.sleep(1.0)
        client.get("/api/downloads/cancel", params={"modelRepo": REPO})
    hub.rate, hub.ignore_range = None, True
    with client_for(config) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        assert wait_for(client, "complete")["downloadedBytes"] == sum(
            p.stat().st_size for p in tiny_chat.iterdir()
        )
    weights = (tiny_chat / "model.safetensors").read_bytes()
    assert (tmp_path / "models" / REPO / "model.safetensors").read_bytes() == weights


def test_refusals(hub, tmp_path):
    with client_for(make_config(hub, tmp_path, max_download_bytes=1024)) as client:
        r = client.get("/api/downloads/enqueue", params={"modelRepo": "shoal-test/big"})
        assert r.status_code == 413 and "limit" in r.json()["error"]
        r = client.get("/api/downloads/enqueue", params={"modelRepo": "shoal-test/missing"})
        assert r.status_code == 404
        for repo, path in [("../etc", None), ("a/b/c", None), (REPO, "../x"), (REPO, "/abs")]:
            params = {"modelRepo": repo, **({"filePath": path} if path else {})}
            r = client.get("/api/downloads/enqueue", params=params)
            assert r.status_code == 400, (repo, path, r.text)
        assert client.get("/api/downloads/cancel", params={"modelRepo": REPO}).status_code == 404


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("http://169.254.169.254/latest/meta-data", "not the configured hub"),
        # An allowed storage host that resolves to loopback: refused for its address (over
        # https: plain http to a storage host is refused first, test_download_safety.py).
        ("https://localhost:{port}/x", "non-public"),
    ],
)
def test_a_redirect_off_the_hub_or_to_a_private_address_is_refused(hub, tmp_path, target, reason):
    port = hub.url.rsplit(":", 1)[1]
    hub.redirects[(REPO, "config.json")] = target.format(port=port)
    config = make_config(hub, tmp_path, storage_hosts=["localhost"])
    with client_for(config) as client:
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO, "filePath": "config.json"})
        item = wait_for(client, "error", "config.json")
        assert reason in item["error"]
    assert not any(path == "/x" for path in hub.requests)


def test_the_hub_itself_is_refused_on_loopback_unless_trusted(hub, tmp_path):
    config = make_config(hub, tmp_path, private_hosts=[])
    with client_for(config) as client:
        r = client.get("/api/downloads/enqueue", params={"modelRepo": REPO})
        assert r.status_code == 403 and "non-public" in r.json()["error"]


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fc00::1",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
    ],
)
def test_ssrf_matrix_refuses_non_public_addresses(address):
    policy = HostPolicy(["hub.example"], resolver=lambda host, port: [address])
    with pytest.raises(TargetRefusedError):
        policy.address("hub.example", 443)


def test_ssrf_public_hosts_and_the_allow_list():
    policy = HostPolicy(["hub.example"], resolver=lambda host, port: ["93.184.216.34"])
    assert policy.address("HUB.example.", 443) == "93.184.216.34"
    with pytest.raises(TargetRefusedError, match="not the configured hub"):
        policy.address("evil.example", 443)


def test_the_connection_goes_to_the_address_checked_never_a_second_lookup(hub):
    """DNS rebinding needs a second lookup between the check and the connect. The guard
    resolves once and connects to that address: `rebind.test` (which no DNS server
    knows) reaches the hub through the one answer the guard checked, and the resolver
    was asked once."""
    asked = []

    def resolver(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]

    port = hub.url.rsplit(":", 1)[1]
    trusted = HostPolicy(
        ["rebind.test"],
        private_hosts=["rebind.test"],
        resolver=resolver,
        plain_http=[f"rebind.test:{port}"],  # an http:// hub's origin, as for_hub allows it
    )
    with guarded_client(trusted, timeout_s=5) as client:
        assert client.get(f"http://rebind.test:{port}/api/models/{REPO}").status_code == 200
    assert asked == ["rebind.test"]
    # Untrusted, the same answer is refused before any connection is made.
    hub.requests.clear()
    policy = HostPolicy(["rebind.test"], resolver=resolver)
    with guarded_client(policy, timeout_s=5) as client, pytest.raises(TargetRefusedError):
        client.get(f"http://rebind.test:{port}/api/models/{REPO}")
    assert hub.requests == []


def test_requests_from_another_sites_page_are_refused(hub, tmp_path):
    with client_for(make_config(hub, tmp_path)) as client:
        for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Origin": "https://evil.example"}):
            r = client.get("/api/shutdown", headers=headers)
            assert r.status_code == 403 and "another site" in r.json()["error"]
            with (
                pytest.raises(WebSocketDisconnect),
                client.websocket_connect("ws://localhost/ws", headers=headers),
            ):
                pass
        same = {"Sec-Fetch-Site": "same-origin", "Origin": "http://localhost"}
        ok = client.post("/api/utils/log", json={"message": "same site"}, headers=same)
        assert ok.status_code == 200


def test_websocket_gets_download_events_in_order(hub, tmp_path):
    with (
        client_for(make_config(hub, tmp_path)) as client,
        client.websocket_connect("ws://localhost/ws") as ws,
    ):
        client.get("/api/downloads/enqueue", params={"modelRepo": REPO, "filePath": "config.json"})
        seen = []
        while not seen or seen[-1] != "complete":
            event = ws.receive_json()
            if event["event"] == "download_status" and event["data"]["filePath"] == "config.json":
                seen.append(event["data"]["status"])
        statuses = [s for i, s in enumerate(seen) if i == 0 or s != seen[i - 1]]
        assert statuses == ["queued", "downloading", "complete"]


def test_websocket_and_api_need_the_key(hub, tmp_path):
    config = make_config(hub, tmp_path).model_copy(update={"api_keys": ["sk-ops"]})
    with client_for(config) as client:
        assert client.get("/api/downloads").status_code == 401
        ok = client.get("/api/downloads", headers={"Authorization": "Bearer sk-ops"})
        assert ok.status_code == 200
        with (
            pytest.raises(WebSocketDisconnect) as refused,
            client.websocket_connect("ws://localhost/ws"),
        ):
            pass
        assert refused.value.code == 1008
        with (
            pytest.raises(WebSocketDisconnect),
            client.websocket_connect("ws://localhost/ws?api_key=sk-ops"),
        ):
            pass  # never in the URL
        key = base64.urlsafe_b64encode(b"sk-ops").decode().rstrip("=")
        protocols = ["shoal.events", f"shoal.key.{key}"]
        with client.websocket_connect("ws://localhost/ws", subprotocols=protocols) as ws:
            assert ws.accepted_subprotocol == "shoal.events"
            ws.send_text("ping")  # an unknown message is ignored


def test_client_log_lines(hub, tmp_path, caplog):
    with client_for(make_config(hub, tmp_path)) as client:
        with caplog.at_level(logging.INFO, logger="ray.serve.client"):
            r = client.post("/api/utils/log", json={"level": "warn", "message": "a\nforged"})
        assert r.status_code == 200 and r.json()["isa"] == "WingmanLogItem"
        line = next(rec for rec in caplog.records if rec.name == "ray.serve.client")
        assert line.levelno == logging.WARNING and "a\\nforged" in line.getMessage()
        bad = client.post("/api/utils/log", json={"level": "loud", "message": "x"})
        assert bad.status_code == 400
        big = client.post("/api/utils/log", json={"level": "info", "message": "x" * 9000})
        assert big.status_code == 400


class TeardownRecorder(ServeDeployer):
    """Serve's deployer whose last step, deleting the applications, is recorded instead
    (in-process there is no Serve to delete them from)."""

    def __init__(self) -> None:
        super().__init__("local", None)
        self.torn_down: list[tuple[list[str], str]] = []

    def teardown(self, apps: list[str], own: str) -> None:
        self.torn_down.append((apps, own))


def test_shutdown_over_the_websocket_drains(hub, tmp_path):
    deployer = TeardownRecorder()
    operator = Operator(make_config(hub, tmp_path), deployer=deployer)
    with client_for(make_config(hub, tmp_path), operator) as client:
        with client.websocket_connect("ws://localhost/ws") as ws:
            ws.send_json({"type": "shutdown"})
            states = []
            while "stopping" not in states:
                event = ws.receive_json()
                if event["event"] == "status":
                    states.append(event["data"]["state"])
            assert states == ["draining", "stopping"]
        r = client.get("/v1/models")
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert client.get("/health").status_code == 503
        deadline = time.time() + 10
        while not deployer.torn_down:  # after the drain, the apps are deleted
            assert time.time() < deadline
            time.sleep(0.1)
    assert deployer.torn_down == [([], "local")]
