"""The model folder a workflow's file names are resolved in (``--comfy-models DIR``).

ComfyUI's layout: ``diffusion_models/``, ``checkpoints/``, ``text_encoders/`` (or ``clip/``),
``vae/``, ``loras/``, ``clip_vision/``, ``latent_upscale_models/``, ``style_models/``. A name resolves to a map
entry of ``DIR/omniloop-models.json`` (optional: file names -> the diffusers-layout checkpoints
we serve), else to the file of that name in the folder (a ``ServedCheckpoint`` with
``single_file``: the server builds the pipeline from the workflow's single files)::

    {"served": {"wan": {"path": "Wan2.1-T2V-1.3B-Diffusers"},
                "flux": {"path": "FLUX.1-dev", "embedded_guidance": true}},
     "files": {"diffusion_models/wan2.1_t2v_1.3B_fp16.safetensors": "wan",
               "vae/wan_2.1_vae.safetensors": "wan", ...}}

A name that is neither, or that tries to leave the folder, is a node error naming the node,
the input and the names that exist. A served checkpoint holds all of its components, so a VAE
or text encoder name only has to map to the same served model as the diffusion model it works with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from omniloop.workflows.errors import node_error

MAP_FILE = "omniloop-models.json"
FOLDERS = ("diffusion_models", "checkpoints", "text_encoders", "clip", "vae", "loras", "clip_vision",
           "latent_upscale_models", "upscale_models", "style_models")
FOLDER_ALIASES = {"clip": "text_encoders", "unet": "diffusion_models"}


@dataclass(frozen=True)
class ServedCheckpoint:
    """One checkpoint we serve: ``name`` (the served model's name, ``OmniRequest.model``),
    ``path`` (its diffusers folder), whether its guidance is embedded (FLUX.1-dev: the
    distilled guidance is an input of the network, ComfyUI's ``FluxGuidance``, and its
    ``cfg`` stays 1)."""

    name: str
    path: Path | None = None
    embedded_guidance: bool = False
    # a single file of the folder no map entry names: (its folder, its name there); the server
    # builds the pipeline from the workflow's loader files (serve/comfy.py)
    single_file: tuple[str, str] | None = None
    # no file says (a coverage report's any-name folder): the workflow's FluxGuidance says it is embedded
    guidance_unknown: bool = False


# the key of a guidance-distilled DiT's guidance embedder (BFL's FLUX.1 dev / Kontext / Fill layout;
# in a full checkpoint under model.diffusion_model.)
GUIDANCE_KEY = "guidance_in.in_layer.weight"


def embeds_guidance(path: Path) -> bool:
    """Whether the DiT single file (or full checkpoint) at ``path`` takes an embedded guidance
    (ComfyUI's ``FluxGuidance``): it has a guidance embedder. Reads the safetensors header only;
    a file that is no safetensors says no (the load reports it)."""
    from safetensors import safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(str(path), framework="pt") as f:
            return any(key == GUIDANCE_KEY or key.endswith(f".{GUIDANCE_KEY}") for key in f.keys())
    except Exception:  # noqa: BLE001 - any unreadable file: not one this check can read
        return False


@dataclass
class ModelFolder:
    """Names -> served checkpoints; ``root`` (optional): the folder on disk (LoRA files)."""

    served: dict[str, ServedCheckpoint] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # "<folder>/<name>" -> served name
    root: Path | None = None
    accept_any: str | None = None  # every name resolves to this served model (coverage reports)

    @classmethod
    def load(cls, root: str | Path) -> "ModelFolder":
        root = Path(root)
        path = root / MAP_FILE
        if not root.is_dir():
            raise FileNotFoundError(f"--comfy-models {root}: not a directory; pass ComfyUI's models/ folder")
        if not path.is_file():  # single files only: every loader name is a file of the folder
            return cls({}, {}, root)
        return cls.from_mapping(json.loads(path.read_text()), root)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], root: Path | None = None) -> "ModelFolder":
        served = {}
        for name, entry in (data.get("served") or {}).items():
            entry = {"path": entry} if isinstance(entry, str) else dict(entry)
            path = Path(entry["path"]) if entry.get("path") else None
            if path is not None and root is not None and not path.is_absolute():
                path = root / path
            served[name] = ServedCheckpoint(name, path, bool(entry.get("embedded_guidance", False)))
        files = {}
        for key, target in (data.get("files") or {}).items():
            folder, _, name = key.partition("/")
            if target not in served:
                raise ValueError(f"{MAP_FILE}: files[{key!r}] names {target!r}, which is not under \"served\" "
                                 f"({sorted(served)})")
            files[f"{FOLDER_ALIASES.get(folder, folder)}/{name}"] = target
        return cls(served, files, root)

    @classmethod
    def any_name(cls, served: str = "served") -> "ModelFolder":
        """A folder where every name resolves to one served model: for coverage reports
        that check the nodes, not the files."""
        return cls({served: ServedCheckpoint(served, guidance_unknown=True)}, {}, None, accept_any=served)

    def names(self, folder: str) -> list[str]:
        """The file names of one ComfyUI folder (``GET /models/{folder}``)."""
        folder = FOLDER_ALIASES.get(folder, folder)
        listed = {key.split("/", 1)[1] for key in self.files if key.split("/", 1)[0] == folder}
        for base in (folder, *(legacy for legacy, kind in FOLDER_ALIASES.items() if kind == folder)):
            if self.root is not None and (self.root / base).is_dir():
                listed |= {p.name for p in (self.root / base).iterdir()
                           if p.is_file() or (p / "config.json").is_file() or (p / "tokenizer_config.json").is_file()}
        return sorted(listed)

    def resolve(self, folders: tuple[str, ...], name: Any, node_id: str, class_type: str,
                input_name: str) -> ServedCheckpoint:
        """The served checkpoint ``name`` (a file in one of ``folders``) maps to."""
        name = self._checked_name(name, folders, node_id, class_type, input_name)
        if self.accept_any is not None:
            return self.served[self.accept_any]
        for folder in folders:
            target = self.files.get(f"{FOLDER_ALIASES.get(folder, folder)}/{name}")
            if target is not None:
                return self.served[target]
        for folder in folders:
            path = self._single_file(folder, name)
            if path is not None:
                return ServedCheckpoint(f"{folder}/{name}", path, embedded_guidance=embeds_guidance(path),
                                        single_file=(folder, name))
        raise self._missing(folders, name, node_id, class_type, input_name)

    def _single_file(self, folder: str, name: str) -> Path | None:
        """``name``'s file (or transformers folder) in ``folder`` (or its legacy alias), inside
        the root; None when there is none (a link leaving the root is none either)."""
        if self.root is None:
            return None
        root = self.root.resolve()
        folder = FOLDER_ALIASES.get(folder, folder)
        for base in (folder, *(legacy for legacy, kind in FOLDER_ALIASES.items() if kind == folder)):
            path = self.root / base / PurePosixPath(name.replace("\\", "/"))
            if path.exists() and path.resolve().is_relative_to(root):
                return path
        return None

    def lora(self, name: Any, node_id: str, class_type: str, input_name: str) -> str:
        """A LoRA: its mapped adapter name, else the file's path in ``loras/``."""
        name = self._checked_name(name, ("loras",), node_id, class_type, input_name)
        if self.accept_any is not None:
            return name
        mapped = self.files.get(f"loras/{name}")
        if mapped is not None:
            return mapped
        if self.root is not None and (self.root / "loras" / name).is_file():
            return str(self.root / "loras" / name)
        raise self._missing(("loras",), name, node_id, class_type, input_name)

    def _checked_name(self, name: Any, folders: tuple[str, ...], node_id: str, class_type: str,
                      input_name: str) -> str:
        if not isinstance(name, str) or not name:
            raise node_error(node_id, class_type, "value_not_in_list", f"{input_name}: pass a file name from "
                             f"{'/'.join(folders)}/", f"got {name!r}", input_name)
        parts = PurePosixPath(name.replace("\\", "/")).parts
        if name.startswith(("/", "\\")) or ".." in parts or ":" in name:
            raise node_error(node_id, class_type, "value_not_in_list", f"{input_name}: {name!r} leaves the model "
                             "folder; pass a name inside it", input_name=input_name)
        return name

    def _missing(self, folders: tuple[str, ...], name: str, node_id: str, class_type: str, input_name: str):
        existing = sorted({n for f in folders for n in self.names(f)})
        return node_error(node_id, class_type, "value_not_in_list", f"{input_name}: {name!r} not in "
                          f"{' or '.join(f + '/' for f in folders)}", f"files there: {existing}", input_name)
