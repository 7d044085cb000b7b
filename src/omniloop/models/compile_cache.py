"""Compile warm-up paid once: ``torch.compile``'s artifacts kept on disk across processes.

Two of PyTorch's own caches, both under one folder (``DeployConfig.compile_cache_dir``,
default ``~/.cache/omniloop/compile``):

- ``inductor/``: Inductor's local cache directory (``TORCHINDUCTOR_CACHE_DIR``): the FX graph
  cache, the AOTAutograd cache and the compiled kernels (C++ ``.so`` files on a CPU, Triton
  kernels on a GPU). Inductor keys every entry itself (graph, shapes, versions, device), so
  a restarted process on this machine finds its kernels instead of rebuilding them; the
  default (``/tmp/torchinductor_$USER``) does not survive a container restart.
- ``<model key>/<versions key>/<bucket>.artifacts``: PyTorch's "mega-cache"
  (``torch.compiler.save_cache_artifacts``) written after the server's warmup compiled its
  shape buckets, and loaded into Inductor's caches (``load_cache_artifacts``) before the
  blocks are compiled. It carries the FX graph and AOTAutograd entries in one portable file:
  a fresh machine or container with only this folder reaches its first step without
  re-running Inductor's passes. The folder names are our key: model identity (resolved path
  + a hash of the checkpoint's JSON configs + dtype and kernels), then versions (torch,
  triton if present, omniloop, device name); a bucket names the shapes compiled.

Dynamo still traces each block once per process (cheap next to Inductor and the kernel
compile). An entry that cannot be read, or that was written under another key (a copied
folder, another torch), is ignored with a log line: a cache never stops a model loading.

NOTE: torch's compile caches are process-wide, so the artifacts a process saves hold every
graph it compiled; the key only decides which files a process loads.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_DIR = Path("~/.cache/omniloop/compile")
MAGIC = b"OMNILOOP-COMPILE-CACHE 1\n"  # then one JSON line (the key), then torch's serialized artifacts
SUFFIX = ".artifacts"
_OPENED: list[CompileCache] = []  # the caches this process loaded from; saved after warmup (save_opened)


def resolve_dir(option: str | None) -> Path | None:
    """``DeployConfig.compile_cache_dir`` -> a folder, or None (``"none"``: no cache)."""
    if option is None or option.strip().lower() in ("none", ""):
        return None
    return (DEFAULT_DIR if option == "auto" else Path(option)).expanduser().resolve()


def _digest(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _configs_hash(root: Path) -> str:
    """A hash of the checkpoint's JSON files (model_index.json, each component's config):
    the architecture, not the weights (a compiled block depends on shapes, not values)."""
    h = hashlib.sha256()
    for path in sorted([*root.glob("*.json"), *root.glob("*/*.json")]):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}-{platform.machine()}"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class CompileCacheKey:
    """What a cached artifact was compiled for; a file under another key is never loaded."""

    model: str  # the resolved checkpoint path
    configs: str  # hash of its JSON configs
    kernels: str  # dtype, attention backend, quantization, cfg mode: what changes the traced graph
    torch_version: str
    triton: str | None
    omniloop: str
    device: str

    @classmethod
    def of(cls, root: Path, *, device: torch.device, kernels: str) -> CompileCacheKey:
        from omniloop import __version__

        root = root.resolve()
        return cls(model=str(root), configs=_configs_hash(root), kernels=kernels, torch_version=torch.__version__,
                   triton=_version("triton") or _version("pytorch-triton"), omniloop=__version__,
                   device=device_name(device))

    def folder(self, root: Path) -> Path:
        """``root/<model key>/<versions key>``: one model's entries for this software and device."""
        model = _digest(self.model, self.configs, self.kernels)
        versions = _digest(self.torch_version, str(self.triton), self.omniloop, self.device)
        return root / f"{Path(self.model).name}-{model}" / versions


@dataclass
class CompileCache:
    """One model's compile-cache folder: ``load`` before the blocks compile, ``save`` after
    the shape buckets ran (the server's warmup). Counters are what /metrics and tests read."""

    root: Path
    key: CompileCacheKey
    loaded: int = 0  # artifacts handed to torch's caches from our files
    ignored: list[str] = field(default_factory=list)  # files skipped (corrupt, foreign), with why
    saved: list[Path] = field(default_factory=list)

    @property
    def folder(self) -> Path:
        return self.key.folder(self.root)

    def load(self) -> int:
        """Hand every bucket file of this key to torch's caches; return the artifacts loaded."""
        for path in sorted(self.folder.glob(f"*{SUFFIX}")):
            try:
                count = self._load_file(path)
            except Exception as e:  # a cache never stops a model loading: log, skip, compile as usual
                self.ignored.append(f"{path.name}: {e}")
                logger.warning("compile cache: ignored %s (%s); its graphs compile again", path, e)
                continue
            self.loaded += count
            logger.info("compile cache: loaded %d artifact(s) from %s", count, path)
        return self.loaded

    def _load_file(self, path: Path) -> int:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("not an omniloop compile-cache file")
        header, _, payload = data[len(MAGIC):].partition(b"\n")
        try:
            written_for = json.loads(header)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError("unreadable key header") from None
        if written_for != asdict(self.key):
            raise ValueError(f"written for another model or versions ({_differences(written_for, asdict(self.key))})")
        info = torch.compiler.load_cache_artifacts(payload)
        if info is None:  # torch logs its own reason (bad checksum, truncated) and loads nothing
            raise ValueError("torch could not read the artifacts (corrupt or truncated)")
        return sum(len(v) for v in info.artifacts.values())

    def save(self, bucket: str) -> Path | None:
        """Write what this process compiled as ``<bucket>.artifacts`` (atomic); None if
        nothing was compiled (e.g. every graph came from the cache and torch kept no new one)."""
        from omniloop.models.manifest import atomic_write

        result = torch.compiler.save_cache_artifacts()
        if result is None:
            return None
        payload, info = result
        if not any(info.artifacts.values()):
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{_bucket_name(bucket)}{SUFFIX}"
        atomic_write(path, MAGIC + json.dumps(asdict(self.key), sort_keys=True).encode() + b"\n" + payload)
        self.saved.append(path)
        logger.info("compile cache: saved %d artifact(s) for %s to %s", sum(len(v) for v in info.artifacts.values()),
                    bucket, path)
        return path

    def summary(self) -> dict[str, object]:
        return {"folder": str(self.folder), "loaded": self.loaded, "ignored": len(self.ignored),
                "saved": len(self.saved)}


def _differences(a: dict, b: dict) -> str:
    return ", ".join(f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(b) if a.get(k) != b.get(k)) or "key fields"


def _bucket_name(bucket: str) -> str:
    """A file name for a bucket description ('height=480 width=832 num_frames=81')."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", bucket).strip("_") or "default"
    return name if len(name) <= 100 else f"{name[:80]}-{_digest(name)}"


def use_inductor_dir(root: Path) -> Path:
    """Point Inductor's local cache at ``root/inductor`` (process-wide), unless the user set
    ``TORCHINDUCTOR_CACHE_DIR`` to a folder of their own (theirs wins). Returns the folder in use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # Inductor writes its default into the environment once it has used it: that one is not a user's choice
    chosen = configured and Path(configured).resolve() not in (Path(default_cache_dir()).resolve(),
                                                               (root / "inductor").resolve())
    if configured and chosen:
        logger.info("compile cache: TORCHINDUCTOR_CACHE_DIR=%s is set and kept", configured)
        return Path(configured)
    folder = root / "inductor"
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return folder


def open_compile_cache(option: str | None, model_root: Path, *, device: torch.device,
                       kernels: str) -> CompileCache | None:
    """The compile cache of a model about to be compiled, with its entries already loaded
    into torch's caches; None when ``option`` is "none". Remembered for ``save_opened``."""
    root = resolve_dir(option)
    if root is None:
        return None
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: compile as usual, say so once
        logger.warning("compile cache: cannot use %s (%s); compiling without a cache "
                       "(pass compile_cache_dir=<a writable folder> or 'none')", root, e)
        return None
    use_inductor_dir(root)
    cache = CompileCache(root, CompileCacheKey.of(model_root, device=device, kernels=kernels))
    cache.load()
    _OPENED.append(cache)
    return cache


def save_opened(bucket: str) -> list[Path]:
    """Save the artifacts of every compile cache this process opened (after a warmup)."""
    return [path for cache in _OPENED if (path := cache.save(bucket)) is not None]


def opened() -> tuple[CompileCache, ...]:
    return tuple(_OPENED)


@dataclass(frozen=True)
class CompileCounts:
    """torch's process-wide compile counters at one moment; subtract two to see what a piece
    of work compiled (``graphs``: Dynamo graphs built, recompiles included)."""

    graphs: int
    fxgraph_hits: int
    fxgraph_misses: int
    autograd_hits: int
    autograd_misses: int

    @classmethod
    def now(cls) -> CompileCounts:
        from torch._dynamo.utils import counters

        return cls(graphs=counters["stats"]["unique_graphs"], fxgraph_hits=counters["inductor"]["fxgraph_cache_hit"],
                   fxgraph_misses=counters["inductor"]["fxgraph_cache_miss"],
                   autograd_hits=counters["aot_autograd"]["autograd_cache_hit"],
                   autograd_misses=counters["aot_autograd"]["autograd_cache_miss"])

    def __sub__(self, other: CompileCounts) -> CompileCounts:
        return CompileCounts(*(a - b for a, b in zip(asdict(self).values(), asdict(other).values())))

    def describe(self) -> str:
        return (f"{self.graphs} graph(s) compiled, Inductor cache {self.fxgraph_hits} hit(s) / "
                f"{self.fxgraph_misses} miss(es)")
