"""Safe by default on a network, through the real app in-process: a foreign Host header
(DNS rebinding) is refused before any route, in each dialect's shape; the operator's
actions need an admin key, or a client on this machine when none is set; a WebSocket's
key never rides in its URL; clients that are not the operator see no host detail."""

import base64
import logging
from pathlib import Path

import httpx
import pytest
from ray.exceptions import ActorDiedError
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from app.models.source import default_model_path
from deployments.config import AppConfig
from deployments.http.app import create_app
from deployments.http.host_detail import without_host_detail
from deployments.http.hosts import host_allowed
from deployments.ingress import Ingress
from deployments.operator.operator import Operator
from deployments.operator.serve_deployer import ServeDeployer
from deployments.tokenizer import Tokenizer
from tests.fixture_hub import save_tiny_chat_model
from tests.local_app import MODEL, LocalHandle, local_app, run

LAN_CLIENT = ("192.168.1.20", 50000)
LOOPBACK = ("127.0.0.1", 50000)
EVIL = {"Host": "rebind.evil.test:8000", "Origin": "http://rebind.evil.test:8000"}


class NoTeardown(ServeDeployer):
    """Serve's deployer, less its last step (in-process there is no Serve to delete)."""

    def __init__(self) -> None:
        super().__init__("local", None)
        self.torn_down: list = []

    def teardown(self, apps: list[str], own: str) -> None:
        self.torn_down.append(apps)


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def make_config(tiny: Path, state: Path, **fields) -> AppConfig:
    return AppConfig.model_validate(
        {
            "models": [{"name": "tiny", "engine": {"model": str(tiny)}}],
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(state / "shoal.sqlite3")},
            "operator": {"models_dir": str(state / "models")},
            **fields,
        }
    )


def client_for(config: AppConfig, client: tuple[str, int] = LOOPBACK, host: str = "localhost"):
    deployer = NoTeardown()
    ingress = Ingress(
        config,
        LocalHandle(Tokenizer(config.models)),
        {},
        operator=LocalHandle(Operator(config, deployer=deployer)),
    )
    test_client = TestClient(create_app(ingress), base_url=f"http://{host}", client=client)
    test_client.torn_down = deployer.torn_down
    return test_client


def test_host_names_and_addresses():
    default = ["localhost", ".localhost"]
    for ok in ("localhost:8000", "LOCALHOST", "app.localhost:1", "127.0.0.1:8000", "[::1]:80"):
        assert host_allowed(ok, default), ok
    for ok in ("10.1.2.3", "192.168.1.5:8000", "[fe80::1%eth0]:8000", None):
        assert host_allowed(ok, default), ok
    for bad in (
        "rebind.evil.test:8000",
        "localhost.evil.test",
        "evil-localhost",
        "127.0.0.1.nip.io",
    ):
        assert not host_allowed(bad, default), bad
    assert host_allowed("api.example.com", [".example.com"])
    assert host_allowed("example.com:443", ["*.example.com"])
    assert not host_allowed("badexample.com", [".example.com"])
    assert host_allowed("anything.test", ["*"])
    # 0.0.0.0 reaches this machine, and browsers send no fetch-metadata to it.
    for bad in ("0.0.0.0:8000", "[::]:8000", "224.0.0.1"):
        assert not host_allowed(bad, default), bad


def test_a_foreign_host_is_refused_before_any_route(tiny_chat, tmp_path):
    with client_for(make_config(tiny_chat, tmp_path)) as client:
        # What the issue tried: a text/plain chat and the Assistants list from a rebound name.
        chat = client.post(
            "/v1/chat/completions",
            content=b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}',
            headers={**EVIL, "Content-Type": "text/plain"},
        )
        assert chat.status_code == 421
        assert chat.json()["error"]["code"] == "host_not_allowed"
        assert client.get("/v1/assistants", headers=EVIL).status_code == 421
        shutdown = client.get("/api/shutdown", headers=EVIL)
        assert shutdown.status_code == 421 and isinstance(shutdown.json()["error"], str)
        assert client.torn_down == []
        with (
            pytest.raises(WebSocketDisconnect),
            client.websocket_connect("ws://localhost/ws", headers=EVIL),
        ):
            pass
        # The same server by its own names and addresses answers.
        for host in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 200


def test_allowed_hosts_names_more_or_opts_out(tiny_chat, tmp_path):
    config = make_config(tiny_chat, tmp_path, allowed_hosts=["shoal.internal"])
    with client_for(config) as client:
        assert client.get("/v1/models", headers={"Host": "shoal.internal"}).status_code == 200
        assert client.get("/v1/models", headers={"Host": "localhost"}).status_code == 421
    config = make_config(tiny_chat, tmp_path, allowed_hosts=["*"])
    with client_for(config) as client:
        assert client.get("/v1/models", headers=EVIL).status_code == 200


def test_without_admin_keys_only_a_local_client_may_act(tiny_chat, tmp_path, caplog):
    lan = {"Host": "192.168.1.5:8000"}
    with client_for(make_config(tiny_chat, tmp_path), LAN_CLIENT, "192.168.1.5:8000") as client:
        # An <img src="http://192.168.x.y:8000/api/shutdown"> on a LAN page, or any host there.
        refused = [
            client.get("/api/shutdown", headers=lan),
            client.get("/api/downloads/enqueue", params={"modelRepo": "a/b"}, headers=lan),
            client.get("/api/inference/start", params={"alias": "x", "modelRepo": "a/b"}),
            client.get("/api/inference/stop", params={"alias": "x"}),
            client.post("/api/pull", json={"model": "a/b"}),
            client.request("DELETE", "/api/delete", json={"model": "a/b"}),
            client.post("/api/utils/log", json={"message": "forged"}),
        ]
        for r in refused:
            assert r.status_code == 403, r.url
            assert "admin key" in r.json()["error"]
        assert client.torn_down == []
        assert client.get("/api/downloads").status_code == 200  # reading is not acting
        with client.websocket_connect("ws://localhost/ws") as ws:
            ws.send_json({"type": "shutdown"})
            event = ws.receive_json()
            while event["event"] != "error":
                event = ws.receive_json()
            assert "admin key" in event["data"]["message"]
        assert client.get("/v1/models").status_code == 200  # not drained
    with client_for(make_config(tiny_chat, tmp_path)) as client:  # on this machine
        assert client.post("/api/utils/log", json={"message": "local"}).status_code == 200


def test_admin_keys_act_from_anywhere_and_inference_keys_never(tiny_chat, tmp_path):
    config = make_config(tiny_chat, tmp_path, api_keys=["sk-use"], admin_api_keys=["sk-admin"])
    admin = {"Authorization": "Bearer sk-admin"}
    user = {"Authorization": "Bearer sk-use"}
    with client_for(config, LOOPBACK) as client:
        log = {"message": "x"}
        assert client.post("/api/utils/log", json=log).status_code == 401
        # With admin keys set, even a local client needs one.
        assert client.post("/api/utils/log", json=log, headers=user).status_code == 403
        assert client.get("/v1/models", headers=user).status_code == 200
    with client_for(config, LAN_CLIENT) as client:
        assert client.post("/api/utils/log", json=log, headers=admin).status_code == 200
        assert client.get("/v1/models", headers=admin).status_code == 200  # also for inference


def test_the_websocket_key_is_a_subprotocol_never_the_url(tiny_chat, tmp_path):
    config = make_config(tiny_chat, tmp_path, api_keys=["sk-use"])
    with client_for(config) as client:
        with (
            pytest.raises(WebSocketDisconnect),
            client.websocket_connect("ws://localhost/ws?api_key=sk-use"),
        ):
            pass
        key = base64.urlsafe_b64encode(b"sk-use").decode().rstrip("=")
        bad = base64.urlsafe_b64encode(b"sk-other").decode().rstrip("=")
        with (
            pytest.raises(WebSocketDisconnect),
            client.websocket_connect(
                "ws://localhost/ws", subprotocols=["shoal.events", f"shoal.key.{bad}"]
            ),
        ):
            pass
        protocols = ["shoal.events", f"shoal.key.{key}"]
        with client.websocket_connect("ws://localhost/ws", subprotocols=protocols) as ws:
            assert ws.accepted_subprotocol == "shoal.events"  # never the key's


def test_websocket_clients_are_capped(tiny_chat, tmp_path):
    config = make_config(
        tiny_chat, tmp_path, operator={"models_dir": str(tmp_path), "max_websocket_clients": 2}
    )
    with client_for(config) as client:
        with (
            client.websocket_connect("ws://localhost/ws"),
            client.websocket_connect("ws://localhost/ws"),
        ):
            with (
                pytest.raises(WebSocketDisconnect) as full,
                client.websocket_connect("ws://localhost/ws"),
            ):
                pass
            assert full.value.code == 1013
        with client.websocket_connect("ws://localhost/ws"):  # room again once they left
            pass


def test_host_detail_is_the_operators_alone(tiny_chat, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    config = make_config(tiny_chat, tmp_path, api_keys=["sk-use"], admin_api_keys=["sk-admin"])
    with client_for(config, LAN_CLIENT) as client:
        user = {"Authorization": "Bearer sk-use"}
        admin = {"Authorization": "Bearer sk-admin"}
        hidden = client.get("/api/hardware", headers=user).json()
        shown = client.get("/api/hardware", headers=admin).json()
        assert "hostname" in shown["nodes"][0] and "hostname" not in hidden["nodes"][0]
        assert str(tiny_chat) not in client.get("/api/models", headers=user).text
        assert str(tiny_chat) in client.get("/api/models", headers=admin).text


def test_props_hide_the_model_path_from_other_hosts(smollm2_engine, tmp_path):
    path = str(default_model_path())  # the model named by its absolute path
    config = AppConfig.model_validate(
        {
            "embeddings": {"enabled": False},
            "assistants": {"database_path": str(tmp_path / "shoal.sqlite3")},
            "models": [{"name": MODEL, "engine": {"model": path}}],
        }
    )

    async def model_path(app, client: tuple[str, int]) -> str:
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as http:
            props = await http.get("/props")
        assert props.status_code == 200
        return props.json()["model_path"]

    with local_app(config, smollm2_engine) as (app, _):
        assert run(model_path(app, LAN_CLIENT)) == Path(path).name
        assert run(model_path(app, LOOPBACK)) == path


def test_blank_keys_are_refused():
    # An unset ${ADMIN_KEY} in a config template: every keyless client would be the admin.
    for field in ("api_keys", "admin_api_keys"):
        with pytest.raises(ValueError, match="blank"):
            AppConfig.model_validate({field: ["sk-real", " "]})


def test_loopback_operator_off_behind_a_local_proxy(tiny_chat, tmp_path):
    config = make_config(tiny_chat, tmp_path, loopback_operator=False)
    with client_for(config, LOOPBACK) as client:  # every client, through a sidecar
        r = client.post("/api/utils/log", json={"message": "x"})
        assert r.status_code == 403 and "admin key" in r.json()["error"]


def test_keyless_callers_never_see_the_admins_objects(tiny_chat, tmp_path):
    """With admin keys alone (inference open), a caller without a key is not the admin."""
    config = make_config(tiny_chat, tmp_path, admin_api_keys=["sk-admin"])
    admin = {"Authorization": "Bearer sk-admin"}
    with client_for(config, LAN_CLIENT) as client:
        made = client.post("/v1/assistants", json={"model": "tiny"}, headers=admin)
        assert made.status_code == 200, made.text
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
            assert client.get("/v1/assistants", headers=headers).json()["data"] == []
            mine = client.get(f"/v1/assistants/{made.json()['id']}", headers=headers)
            assert mine.status_code == 404
        listed = client.get("/v1/assistants", headers=admin).json()["data"]
        assert [a["id"] for a in listed] == [made.json()["id"]]


def test_host_detail_leaves_urls_and_names():
    shown = without_host_detail(
        {
            "location": "/home/ann/models/x.gguf",
            "modelfile": "FROM /home/ann/models/x.gguf",
            "metadata": '{"location": "/srv/m/y"}',
            "resources": {"CPU": 2.0, "node:10.1.2.3": 1.0},
            "url": "https://huggingface.co/owner/repo",
            "repo": "owner/repo",
        }
    )
    assert shown == {
        "location": "x.gguf",
        "modelfile": "FROM x.gguf",
        "metadata": '{"location": "y"}',
        "resources": {"CPU": 2.0},
        "url": "https://huggingface.co/owner/repo",
        "repo": "owner/repo",
    }


def test_deeply_nested_arguments_are_a_400(tiny_chat, tmp_path):
    with client_for(make_config(tiny_chat, tmp_path)) as client:
        nested = "[" * 100_000 + "]" * 100_000
        call = {"type": "function_call", "call_id": "c", "name": "f", "arguments": nested}
        r = client.post("/v1/responses", json={"model": "tiny", "input": [call]})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


class DeadReplica:
    """A model replica whose actor died under every call (what `ray.kill` does)."""

    def __getattr__(self, method: str):  # noqa: ANN204
        def dead(*args):  # noqa: ANN002, ANN202
            raise ActorDiedError()

        return dead


def test_a_call_on_a_replica_that_died_is_a_503(tiny_chat, tmp_path):
    config = make_config(tiny_chat, tmp_path)
    tokenizer = LocalHandle(Tokenizer(config.models))
    ingress = Ingress(config, tokenizer, {"tiny": LocalHandle(DeadReplica())})
    with TestClient(create_app(ingress), base_url="http://localhost") as client:
        r = client.get("/props")
        assert r.status_code == 503 and "retry" in r.json()["error"]["message"]
