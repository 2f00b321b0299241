"""OperatorConfig: the operator API's settings (downloads, models started at run time,
the WebSocket), a part of AppConfig (deployments/config.py)."""

import os

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MODELS_DIR = "~/.shoal/models"
# Where the Hugging Face Hub sends its file downloads (LFS and Xet storage).
HUB_STORAGE_HOSTS = (
    "cdn-lfs.huggingface.co",
    "cdn-lfs.hf.co",
    "cdn-lfs-us-1.hf.co",
    "cdn-lfs-eu-1.hf.co",
    "cas-bridge.xethub.hf.co",
)


class OperatorConfig(BaseModel):
    """The operator API (/api/models, /api/downloads, /api/inference, /api/hardware, the
    WebSocket and the page): models downloaded and started at run time."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = True
    models_dir: str = Field(
        default_factory=lambda: os.environ.get("SHOAL_MODELS_DIR", DEFAULT_MODELS_DIR),
        description="Where downloads go (default: $SHOAL_MODELS_DIR, else ~/.shoal/models).",
    )
    hub_endpoint: str = Field(
        default_factory=lambda: os.environ.get("HF_ENDPOINT", "https://huggingface.co"),
        description="The Hugging Face Hub (or a mirror) downloads come from (default: "
        "$HF_ENDPOINT, else huggingface.co). Downloads reach no other host but storage_hosts.",
    )
    hub_token: str | None = Field(None, description="A Hub token, for gated or private repos.")
    storage_hosts: list[str] = Field(
        default_factory=lambda: list(HUB_STORAGE_HOSTS),
        description="Hosts the hub may redirect a download to (its file storage).",
    )
    private_hosts: list[str] = Field(
        default_factory=list,
        description="Hosts allowed to resolve to private, loopback or link-local addresses (a "
        "hub mirror inside the cluster). Every other target on such an address is refused.",
    )
    max_download_bytes: int = Field(
        64 << 30, ge=1, description="A repo or file larger than this is refused (413)."
    )
    max_total_download_bytes: int | None = Field(
        None,
        ge=1,
        description="What models_dir may hold in all (the bytes on disk plus what queued and "
        "running downloads still have to fetch); a download past it is refused (409). None: "
        "no quota (the free-space floor still applies).",
    )
    min_free_disk_bytes: int = Field(
        5 << 30,
        ge=0,
        description="Free space a download must leave on models_dir's filesystem, checked "
        "before any byte and while fetching; below it: 507 (or the item ends in `error`).",
    )
    min_free_disk_fraction: float = Field(
        0.10,
        ge=0,
        lt=1,
        description="The same floor as a fraction of that filesystem's size (the larger of "
        "the two applies): Ray stops scheduling on a node past 95 % of its disk, and logs "
        "and spilled objects need room above what downloads leave.",
    )
    state_path: str | None = Field(
        None,
        description="The SQLite file of the operator's own state (the download list, the "
        "models started at run time) when `database.url` is not set; None: "
        "<models_dir>/.shoal-operator/state.sqlite3, beside the files it describes. With "
        "`database.url` the state is kept in that database.",
    )
    max_concurrent_downloads: int = Field(2, ge=1)
    model_num_cpus: float = Field(
        1.0, gt=0, description="Ray CPUs for each replica of a model started at run time."
    )
    model_start_timeout_s: float = Field(
        900.0, gt=0, description="A model started at run time that is not serving by then fails."
    )
    max_runtime_models: int = Field(
        4,
        ge=0,
        description="Models started at run time (/api/inference/start, Ollama's pull and "
        "create) that may be starting or serving at once; one more is refused (409).",
    )
    drain_timeout_s: float = Field(
        60.0, gt=0, description="How long /api/shutdown waits for open requests to finish."
    )
    max_websocket_clients: int = Field(
        64, ge=1, description="WebSocket clients at once per ingress replica; more are refused."
    )
