"""``DeployConfig``: how a model is deployed (device, dtype, kernels, limits).

One owner per config layer (ARCHITECTURE.md): per-call knobs live on ``OmniRequest``,
model structure on ``ArchConfig``/``ModelSpec``; this object is everything about *where
and how* a deployment runs. Loadable from YAML, accepted as keyword options by
``VideoGenerator.from_pretrained`` (and later ``AsyncEngine`` / ``omniloop serve``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omniloop.models.layers.cuda_graph_defaults import DEFAULT_MAX_GRAPHS, DEFAULT_MAX_TOKENS
from omniloop.parallel.spec import ParallelSpec

if TYPE_CHECKING:  # torch loads where a device or dtype is made, not with the config (the CLI's --help reads it)
    import torch

# dtype spellings -> the torch.dtype attribute name
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def _torch_dtypes() -> dict[str, torch.dtype]:
    """``_DTYPES``' names -> the torch dtypes (imports torch)."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_frames: int = Field(default=257, ge=1)
    max_pixels: int = Field(default=2**21, ge=256, description="max height * width (default 2,097,152: 1920x1088 video, 1024x1024 or 1440x1440 images)")
    max_steps: int = Field(default=100, ge=1)
    max_images: int = Field(default=8, ge=1, description="images one call may ask for (OpenAI's n); "
                            "DeployConfig.max_batch is the requests one batched step holds")

    @model_validator(mode="before")
    @classmethod
    def _old_spelling(cls, data: Any) -> Any:
        """``limits.max_batch`` was this field's name until 2026-12 (it read as the scheduler's
        batch size, which is ``DeployConfig.max_batch``); accepted for a round, with a warning."""
        if isinstance(data, dict) and "max_batch" in data:
            import warnings

            warnings.warn("limits.max_batch is deprecated: it is limits.max_images (images one call may ask for); "
                          "DeployConfig.max_batch is the scheduler's batch size", DeprecationWarning, stacklevel=2)
            data = {**data}
            given = data.pop("max_batch")
            data.setdefault("max_images", given)
        return data


class PoolSpec(BaseModel):
    """A role pool (design §6.3.4): a worker process with its own device that runs the graph
    nodes ``DeployConfig.placement`` puts on it; rank 0's scheduler still decides every step."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(default="cpu", description="the pool's device: 'cpu', 'cuda', 'cuda:1', ...")
    connector: Literal["shared_memory", "nccl", "nixl"] = Field(
        default="shared_memory", description="how edge artifacts reach and leave the pool: shared memory between "
        "processes (implemented); nccl / nixl are named extension points, refused until implemented")

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        import torch

        try:
            torch.device(v)
        except RuntimeError:
            raise ValueError(f"unknown pool device {v!r}; pass 'cpu', 'cuda' or 'cuda:N'") from None
        return v


class DeployConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field(default="auto", description="'auto', 'cpu', 'cuda', 'cuda:1', ...")
    dtype: str = Field(default="auto", description="'auto' (bf16 on GPU, fp32 on CPU), 'float32', 'bfloat16', 'float16'")
    attention_backend: str = Field(default="auto", description="attention kernel: auto (the family's fastest exact "
                                   "kernel on this GPU; sdpa on a CPU), sdpa, sdpa_cudnn, sdpa_flash, math; or, changing "
                                   "the numbers, triton_8bit (INT8 QK + FP8 PV, Ada/Hopper) or cudnn_fp8 (cuDNN FP8 flash "
                                   "attention, Hopper)")
    cfg_mode: Literal["auto", "sequential", "batched"] = Field(
        default="auto", description="CFG dispatch: two forwards (sequential), or cond+uncond stacked in one (batched); "
        "auto: the family's faster one on a GPU, sequential on a CPU"
    )
    compile: bool | Literal["auto"] = Field(
        default="auto", description="torch.compile each repeated transformer block; auto: on CUDA for the families "
        "whose compiled step is measured faster (models/fast_path.py), never on a CPU; --no-compile turns it off")
    compile_dynamic: bool = Field(
        default=False, description="compiled blocks take their input sizes (tokens, batch) as dynamic "
        "(torch.compile dynamic=True): one compiled graph serves every size, no recompile when a request of another "
        "resolution or length arrives; off: static kernels, a recompile when a new size arrives")
    compile_cache_dir: str = Field(
        default="auto", description="where compiled blocks are kept across restarts (Inductor's cache and torch's "
        "cache artifacts, keyed by model, shape bucket and versions: models/compile_cache.py); auto: "
        "~/.cache/omniloop/compile; 'none': no cache (each process compiles again)")
    quantization: Literal["none", "fp8", "fp8_tensor"] = Field(
        default="none",
        description="'fp8': e4m3 weights (per channel) and activations (per token) in the transformer blocks' "
        "GEMMs; 'fp8_tensor': the same with one scale per tensor (cuBLASLt's per-tensor FP8 kernel); both "
        "Ada/Hopper GPUs and change the numbers (see benchmarks/results); 'none': the model dtype",
    )
    cpu_threads: int | Literal["auto"] = Field(
        default="auto",
        description="torch intra-op threads on a CPU device: 'auto' (the cores this process may use and the machine's "
        "load leaves idle, never more than torch's current count: omniloop/cpu_threads.py) or a number",
    )
    plugins: dict[str, dict[str, Any]] = Field(default_factory=dict, description="enabled plugins and their config")
    parallel: ParallelSpec = Field(
        default_factory=ParallelSpec,
        description="parallel axes of an SPMD pool, one process per rank (gloo on CPU, NCCL on GPUs): e.g. "
        "'sp=2,cfg=2'; keys dp, cfg, sp (= ulysses x ring), ulysses, ring, tp, vae=tiles, check_plans",
    )
    text_cache_mb: float = Field(default=256, ge=0, description="text-embedding cache budget in MiB (0: no cache)")
    lora_files: dict[str, str] = Field(default_factory=dict,
                                       description="LoRA files loaded at startup, by the name requests use: {name: path}")
    lora_device_mb: float = Field(default=2048, ge=0, description="adapter cache: device-resident LoRA budget (MiB)")
    lora_host_mb: float = Field(default=8192, ge=0, description="adapter cache: host-memory LoRA budget (MiB)")
    model_device_gb: float | None = Field(
        default=None, gt=0, description="several models on one server: device budget for their weights (GiB; "
        "idle models beyond it wait in host memory, least recently used first); None: all stay on the device")
    model_host_gb: float | None = Field(
        default=None, gt=0, description="several models: host-memory budget for offloaded weights (GiB; beyond it "
        "the least recently used idle model is dropped and reloaded from disk when asked for); None: unbounded")
    limits: Limits = Field(default_factory=Limits)
    # -- engine -------------------------------------------------------------------------
    scheduling: Literal["srpt", "fifo", "fifo_batch"] = Field(
        default="srpt", description="step scheduling: shortest remaining cost first (with aging), request-level FIFO "
        "(batch 1), or fifo_batch (request-level batching of same-shape requests, run together to the end)"
    )
    max_queue: int = Field(default=64, ge=1, description="waiting requests before new ones are rejected (429)")
    max_running: int = Field(default=8, ge=1, description="requests holding state at once")
    max_batch: int = Field(default=8, ge=1, description="requests per batched step")
    max_batch_tokens: int | None = Field(
        default=None, ge=1,
        description="token budget of a batched step (image + text tokens of every request in it; packed image "
        "models batch requests of different sizes under it); None: max_batch alone bounds a batch",
    )
    resolution_buckets: list[str] | None = Field(
        default=None, min_length=1,
        description="image models: the only sizes served, as 'WIDTHxHEIGHT' (fixed shapes for kernels that need "
        "them: compiled or CUDA-graphed steps); requests of one bucket batch unpacked",
    )
    cuda_graphs: bool = Field(
        default=False, description="image models (Flux): the transformer forward of a small step (no LoRA, at most "
        "cuda_graph_max_tokens tokens) replays a CUDA graph captured per batch shape (the same kernels: outputs "
        "equal eager); AR decode steps (the Cosmos3 reasoner, the Qwen2.5-Omni / Qwen3-Omni thinker and talker) "
        "replay a graph per batch / context bucket (tokens equal eager); CUDA only, refused on a CPU")
    cuda_graph_max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1, description="cuda_graphs: steps carrying more tokens "
                                       "(image + text, every request) stay eager")
    cuda_graph_max_graphs: int = Field(default=DEFAULT_MAX_GRAPHS, ge=1, description="cuda_graphs: captured graphs kept, least "
                                       "recently used dropped first (each holds its forward's activation memory)")
    memory_budget_gb: float | None = Field(default=None, gt=0, description="admission memory budget; default: free memory")
    chunk_kv_budget_gb: float | None = Field(
        default=None, gt=0, description="chunk-KV slab pool of causal video models, fixed at start and charged by "
        "admission; default: a quarter of free device memory (1 GiB on a CPU)")
    kv_cache_gb: float | None = Field(default=None, gt=0, description="paged text-KV pool of AR loops; default: 8 full "
                                      "contexts, at most 1 GiB on a CPU / a quarter of the free GPU memory")
    max_audio_tokens: int | None = Field(
        default=None, ge=1, description="spoken answers (Qwen2.5-Omni): the talker's codec tokens at most, after which "
        "the answer ends with finish_reason 'length'; default: transformers' 4096, clamped to what token2wav decodes")
    nan_check: bool = Field(default=True, description="fail a request whose loop state turns NaN/Inf")
    on_pool_failure: Literal["requeue", "fail"] = Field(default="requeue", description="what a pool restart does to in-flight requests")
    # -- placement (design §6.3.4) ------------------------------------------------------------
    pools: dict[str, PoolSpec] = Field(
        default_factory=dict, description="role pools by name (e.g. encode / denoise / decode, or thinker / talker / "
        "vocoder), each a worker process with its own device; nodes run on them per placement")
    placement: dict[str, str] = Field(
        default_factory=dict, description="graph node -> the pool it runs on (a node not listed runs in the engine's "
        "own process)")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        if v != "auto" and v not in _DTYPES:
            raise ValueError(f"unknown dtype {v!r}; pass one of {['auto', *_DTYPES]}")
        return v

    @field_validator("resolution_buckets")
    @classmethod
    def _bucket_sizes(cls, v: list[str] | None) -> list[str] | None:
        for size in v or []:
            parts = size.lower().split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"resolution bucket {size!r} is not WIDTHxHEIGHT; pass e.g. '1024x1024'")
        return v

    def bucket_sizes(self) -> tuple[tuple[int, int], ...]:
        """``resolution_buckets`` as (height, width) pairs."""
        out = []
        for size in self.resolution_buckets or []:
            w, h = (int(p) for p in size.lower().split("x"))
            out.append((h, w))
        return tuple(out)

    @field_validator("cpu_threads", mode="before")
    @classmethod
    def _thread_count(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().isdigit():
            v = int(v)
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if v != "auto" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"cpu_threads={v!r}: pass 'auto' or a thread count >= 1")
        return v

    @field_validator("attention_backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        from omniloop.models.layers.attention import get_attention_backend

        if v != "auto":
            get_attention_backend(v)
        return v

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str) -> str:
        if v != "auto":
            import torch

            try:
                torch.device(v)
            except RuntimeError:
                raise ValueError(f"unknown device {v!r}; pass 'auto', 'cpu', 'cuda' or 'cuda:N'") from None
        return v

    @field_validator("parallel", mode="before")
    @classmethod
    def _parallel_text(cls, v: Any) -> Any:
        return ParallelSpec.from_flag(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _parallel_fits_the_deployment(self) -> DeployConfig:
        # the checks that need no model; the model's own (heads, plans) run before its weights load
        from omniloop.parallel.preflight import check_deploy

        check_deploy(self.parallel, cfg_mode=self.cfg_mode, attention_backend=self.attention_backend,
                     quantization=self.quantization, device=self.torch_device(), cuda_graphs=self.cuda_graphs)
        return self

    @model_validator(mode="after")
    def _placement_names_pools(self) -> DeployConfig:
        for node, pool in self.placement.items():
            if pool not in self.pools:
                raise ValueError(f"placement[{node!r}] names pool {pool!r}, which is not declared; pools: "
                                 f"{sorted(self.pools)} (declare it under pools, or place the node on one of them)")
        if self.placement and self.plugins:
            raise ValueError(f"plugins {sorted(self.plugins)} with placement: plugins do not run on role pools in this "
                             "build; drop the plugins or the placement")
        if self.pools and self.parallel.world > 1:
            raise ValueError(f"pools with parallel={self.parallel.compact()!r}: role pools run one process each in "
                             "this build; drop parallel (or the pools)")
        return self

    @model_validator(mode="after")
    def _gpu_only_options_on_a_gpu(self) -> DeployConfig:
        # at deploy time, not at the first request: these kernels exist only on CUDA GPUs
        if self.attention_backend in ("triton_8bit", "cudnn_fp8") and self.torch_device().type != "cuda":
            raise ValueError(f"attention_backend={self.attention_backend!r} needs a CUDA GPU (Ada/Hopper); "
                             f"device {self.device!r} is not one: use attention_backend='sdpa'")
        if self.cuda_graphs and self.torch_device().type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA GPU; device {self.device!r} is "
                             f"{str(self.torch_device())!r}: leave out --cuda-graphs (cuda_graphs=False) or pass device='cuda'")
        if self.attention_backend == "cudnn_fp8" and importlib.util.find_spec("cudnn") is None:
            raise ValueError("attention_backend='cudnn_fp8' needs the nvidia-cudnn-frontend package "
                             "(pip install nvidia-cudnn-frontend); or use attention_backend='sdpa'")
        return self

    def check_device(self) -> None:
        """A CUDA device that this torch cannot use is a one-line ValueError, before loading."""
        import torch

        device = self.torch_device()
        if device.type != "cuda":
            return
        if not torch.backends.cuda.is_built():
            raise ValueError(f"device={self.device!r}: this torch ({torch.__version__}) is a CPU-only build, without "
                             "CUDA; pass device='cpu' (--device cpu), or install a CUDA build of torch")
        count = torch.cuda.device_count()
        if count == 0 or (device.index or 0) >= count:
            raise ValueError(f"device={self.device!r}: {count} CUDA device(s) visible to this process; "
                             "pass device='cpu' (--device cpu) or a visible device ('cuda:0')")

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        dtypes = _torch_dtypes()
        if self.dtype == "auto":
            return dtypes["bfloat16" if self.torch_device().type == "cuda" else "float32"]
        return dtypes[_DTYPES[self.dtype]]

    @classmethod
    def from_yaml(cls, path: str | Path) -> "DeployConfig":
        import yaml

        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a deploy config must be a mapping of options")
        data.pop("serve", None)  # the HTTP server's section of the same file (omniloop.serve.config)
        return cls.model_validate(data)

    @classmethod
    def from_options(cls, config: "DeployConfig | None" = None, **options: Any) -> "DeployConfig":
        """Merge keyword options (as passed to ``from_pretrained``) over ``config``."""
        import torch

        if isinstance(options.get("dtype"), torch.dtype):
            options["dtype"] = {v: k for k, v in _torch_dtypes().items()}[options["dtype"]]
        if isinstance(options.get("device"), torch.device):
            options["device"] = str(options["device"])
        base = config.model_dump() if config is not None else {}
        return cls.model_validate({**base, **options})
