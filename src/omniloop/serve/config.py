"""``ServeConfig``: how the HTTP server runs (address, job store and retention, warmup,
drain policy).

Request ceilings are not here: frames, resolution, steps and ``n`` live in the deploy
config's ``limits`` and the queue length in its ``max_queue`` (one owner per knob). The
server reads its own options from a ``serve:`` section of the same YAML file:

```yaml
device: cuda
max_queue: 32
limits: {max_frames: 121, max_pixels: 921600, max_steps: 50, max_batch: 4}
serve:
  port: 8000
  warmup: [{height: 480, width: 832, num_frames: 81, steps: 2}]
  drain: finish
  drain_timeout_s: 120
```
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from omniloop.deploy import DeployConfig
from omniloop.request import DiffusionParams

if TYPE_CHECKING:  # omniloop.engine imports torch; this config is read by the CLI's --help (torch-free)
    from omniloop.engine.checkpoints import CheckpointCadence


DEFAULT_DRAIN_TIMEOUT_S = 25.0  # below Kubernetes' default 30 s termination grace period


class ServeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="address to bind")
    port: int = Field(default=8000, ge=0, le=65535, description="TCP port (0: any free port)")
    served_model_name: str | None = Field(
        default=None, description="the model id clients pass as 'model' (default: the checkpoint folder's name)"
    )
    api_key: str | None = Field(
        default_factory=lambda: os.environ.get("OMNILOOP_API_KEY") or None,
        description="if set, /v1 (and /metrics) require 'Authorization: Bearer <api_key>' (default: the "
        "OMNILOOP_API_KEY environment variable; unset: no key)")
    metrics_public: bool = Field(default=False, description="serve /metrics without the API key (for a scraper "
                                 "that cannot send one)")
    browser_token_s: float = Field(default=3600.0, gt=0, description="lifetime of the cookie a browser page (/play) "
                                   "gets for presenting the API key once (POST /v1/browser-token)")
    allowed_hosts: list[str] = Field(
        default_factory=list, description="Host names served besides IP literals, localhost and the bound address "
        "(DNS-rebinding guard; '*': any); e.g. a proxy's or a DNS name's")
    allowed_origins: list[str] = Field(
        default_factory=list, description="web origins (scheme://host:port) whose pages may call this server: CORS "
        "is answered for them and their POSTs and WebSockets are accepted ('*': any); default: only pages this "
        "server serves")
    max_jobs: int = Field(
        default=256, ge=1, description="jobs (videos and images) kept; the oldest finished one is evicted first"
    )
    job_store: Path | None = Field(
        default=None, description="SQLite file keeping job records across restarts (outputs go to output_dir); "
        "default: jobs live in memory and end with the process",
    )
    output_dir: Path | None = Field(
        default=None, description="directory of the durable jobs' output files (default: <job_store>-outputs/ "
        "next to the job store)",
    )
    requeue_on_restart: bool = Field(
        default=True, description="with job_store: jobs queued or running when the server died run again after a "
        "restart, resuming from their last checkpoint (see checkpoint_every_s) or else from the start; "
        "--no-requeue-on-restart reports them failed instead, saying so",
    )
    checkpoint_every_s: float = Field(
        default=30.0, ge=0, description="with requeue_on_restart: a running job's loop state (latents, sampler "
        "state, step) is checkpointed beside the job store every this many seconds, so a job interrupted by a crash "
        "resumes from there; a job shorter than this writes none (0: not by time)")
    checkpoint_every_steps: int = Field(
        default=0, ge=0, description="with requeue_on_restart: also checkpoint every this many steps (0: not by steps)")
    checkpoint_max_bytes: int = Field(
        default=8 * 2**30, ge=0, description="disk the checkpoints of running jobs may take together; a checkpoint "
        "beyond it is not written (the job keeps its previous one)")
    max_job_restarts: int = Field(
        default=3, ge=1, description="with requeue_on_restart: times one job runs again after the server died; "
        "interrupted once more, it is failed saying so (a job that takes the server down cannot do it forever)")
    retention_max_bytes: int | None = Field(
        default=None, ge=0, description="finished jobs' outputs kept, in bytes; beyond, the oldest completed "
        "job is deleted first (default: no size limit)",
    )
    retention_max_age_s: float | None = Field(
        default=None, gt=0, description="seconds a finished job is kept after it ends (default: no age limit)",
    )
    max_upload_bytes: int = Field(default=16 * 2**20, ge=1024, description="largest request body on every route, "
                                  "counted while it streams in (413 beyond, the rest never read)")
    max_json_depth: int = Field(default=64, ge=2, description="deepest nesting of a JSON body (400 beyond, checked "
                                "before it is parsed)")
    max_ws_message_bytes: int = Field(default=64 * 2**10, ge=1024, description="largest WebSocket message a client "
                                      "may send (the socket closes with 4413 beyond)")
    max_image_pixels: int | None = Field(
        default=None, ge=64 * 64, description="largest uploaded image or video frame, width x height, checked in the "
        "file's header before anything is decoded (400 beyond); default: 16x the limits' max_pixels, at least 4 MP",
    )
    max_loras: int = Field(default=16, ge=0, description="LoRA adapters registered per model through /v1/loras "
                           "(409 beyond: delete one first)")
    max_lora_bytes: int = Field(default=4 * 2**30, ge=0, description="bytes of the LoRA adapters registered per model "
                                "(409 beyond)")
    weights_dir: Path | None = Field(
        default=None, description="the directory POST /v1/weights may read weight files from (a 'path' outside it is "
        "a 403); default: none, weights come only as uploads")
    while_asleep: Literal["wait", "reject"] = Field(
        default="wait", description="requests arriving while the engine sleeps (POST /v1/sleep): wait for the wake, "
        "or get a 503 with Retry-After")
    warmup: list[DiffusionParams] | None = Field(
        default=None,
        description="shapes run once at start before /ready turns 200 (a failure exits the process); "
        "default: one 2-step request at the model's default size, clamped to what it and the limits allow; "
        "[] skips warmup",
    )
    drain: Literal["finish", "cancel"] = Field(
        default="finish", description="on SIGTERM or Ctrl-C: let in-flight jobs finish (up to drain_timeout_s), "
        "or cancel them (a second signal stops at once)"
    )
    drain_timeout_s: float = Field(default=DEFAULT_DRAIN_TIMEOUT_S, ge=0,
                                   description="'finish' drains cancel what is left after this many seconds")
    cancel_wait_s: float = Field(default=30.0, gt=0, description="how long a refused multi-image call waits for "
                                 "its already started images to stop (DELETE never waits: it answers 'cancelling')")
    sse_keepalive_s: float = Field(default=15.0, gt=0, description="comment lines on idle event streams")
    max_sessions: int = Field(default=4, ge=1, description="live sessions (POST /v1/sessions) at once; 429 beyond")
    session_idle_s: float = Field(default=60.0, gt=0, description="a session whose clients all left is paused "
                                  "(no chunks made) and ends after this unless a client reconnects")
    session_connect_grace_s: float = Field(default=10.0, gt=0, description="a session no client ever connects "
                                           "to (it makes no chunks meanwhile) ends after this")
    comfy_models: Path | None = Field(
        default=None, description="a ComfyUI models folder (diffusion_models/, checkpoints/, vae/, loras/...) with "
        "omniloop-models.json mapping its file names to the served checkpoints: serves ComfyUI's HTTP/WebSocket API "
        "(/prompt, /history, /view, /ws...) beside the OpenAI API (docs/comfyui.md)")
    comfy_workdir: Path | None = Field(
        default=None, description="where the ComfyUI API keeps its input/, output/ and temp/ folders (default: a "
        "temporary folder removed at exit)")
    session_model: str | None = Field(
        default=None, description="an interactive model (a built-in name or a folder) that serves /v1/sessions and "
        "/play beside the served model; `omniloop serve` without --model uses the built-in shapes-interactive")

    @model_validator(mode="after")
    def _durable_options_need_a_store(self) -> "ServeConfig":
        # (requeue_on_restart is on by default and means nothing without a store: not refused)
        for name in ("output_dir",):
            if getattr(self, name) and self.job_store is None:
                raise ValueError(f"{name} needs job_store: only a durable job store (--job-store PATH) keeps "
                                 "outputs on disk and jobs across restarts")
        return self

    def checkpoints_dir(self) -> Path:
        """Where a durable store's crash checkpoints live (beside it)."""
        assert self.job_store is not None, "checkpoints_dir() is for a durable job store"
        return self.job_store.with_name(f"{self.job_store.stem}-checkpoints")

    def checkpoint_cadence(self) -> CheckpointCadence:
        from omniloop.engine.checkpoints import CheckpointCadence

        return CheckpointCadence(every_steps=self.checkpoint_every_steps or None,
                                 every_s=self.checkpoint_every_s or None)

    def outputs_dir(self) -> Path:
        """Where a durable store's output files live."""
        assert self.job_store is not None, "outputs_dir() is for a durable job store"
        return self.output_dir or self.job_store.with_name(f"{self.job_store.stem}-outputs")


def load_config_file(path: str | Path) -> tuple[DeployConfig, ServeConfig]:
    """A deploy YAML file with an optional ``serve:`` section."""
    import yaml

    data: Any = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a deploy config must be a mapping of options")
    serve = data.pop("serve", None) or {}
    if not isinstance(serve, dict):
        raise ValueError(f"{path}: 'serve' must be a mapping of server options")
    return DeployConfig.model_validate(data), ServeConfig.model_validate(serve)
