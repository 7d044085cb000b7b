"""A ComfyUI ``models/`` folder, read only: model names (as ComfyUI's loader nodes and
``GET /models/{folder}`` spell them) resolved to files inside it, never outside.

Layout (ComfyUI's ``folder_paths``; the legacy names ``unet/`` and ``clip/`` are read too)::

    models/
      diffusion_models/  (unet/)    DiT single files: wan2.1_t2v_1.3B_fp16.safetensors, flux1-dev.safetensors
      checkpoints/                  full checkpoints (DiT + VAE + text encoders in one file)
      text_encoders/     (clip/)    text encoders (here also transformers-layout model / tokenizer folders)
      vae/                          wan_2.1_vae.safetensors, ae.safetensors
      loras/  clip_vision/  upscale_models/
      latent_upscale_models/        LTX-2's ltx-2-spatial-upscaler-x2-1.0.safetensors

A name is a path relative to its kind's folder, ``/`` or ``\\`` separated (ComfyUI lists
files in subfolders as ``sub/name.safetensors``). Absolute names, ``..`` components and
symlinks that leave the models folder are refused (:class:`ComfyModelNameRefused`); a name
that is not there raises :class:`ComfyModelNotFound` with the files that are, which the
workflow compiler turns into a ``node_errors`` entry.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

# folder kind -> its directories under the root, in lookup order (ComfyUI's folder_names_and_paths)
FOLDERS: dict[str, tuple[str, ...]] = {
    "diffusion_models": ("diffusion_models", "unet"),
    "unet": ("diffusion_models", "unet"),
    "checkpoints": ("checkpoints",),
    "text_encoders": ("text_encoders", "clip"),
    "clip": ("text_encoders", "clip"),
    "vae": ("vae",),
    "loras": ("loras",),
    "clip_vision": ("clip_vision",),
    "upscale_models": ("upscale_models",),
    "latent_upscale_models": ("latent_upscale_models",),
    "style_models": ("style_models",),  # FLUX.1 Redux's flux1-redux-dev.safetensors (StyleModelLoader)
}
# what a list shows and a name may point at: the weight files our loaders read
WEIGHT_SUFFIXES = (".safetensors", ".sft")
# kinds whose entries may also be a folder in the transformers layout (a model's config.json, or a
# tokenizer's tokenizer_config.json, inside)
FOLDER_ENTRIES = frozenset({"text_encoders", "clip", "clip_vision"})
FOLDER_MARKERS = ("config.json", "tokenizer_config.json")
# configs/<family>/: a diffusers folder's config files (no weights) saying a family's architecture
# facts its single files do not carry (SingleFileSet.configs); ComfyUI's own configs/*.yaml beside them
CONFIGS = "configs"


class ComfyModelNotFound(FileNotFoundError):
    """``name`` is not in the ``folder`` kind's directories; ``available`` is what is."""

    def __init__(self, folder: str, name: str, available: tuple[str, ...]) -> None:
        shown = ", ".join(available[:20]) + (f", ... ({len(available) - 20} more)" if len(available) > 20 else "")
        super().__init__(f"{folder} model {name!r} not found; the {folder} folder holds: "
                         f"{shown or 'no model files'}")
        self.folder, self.name, self.available = folder, name, available


class ComfyModelNameRefused(ValueError):
    """``name`` would leave the models folder (absolute, ``..``, an escaping symlink) or is
    not a model file name; ``reason`` says which."""

    def __init__(self, folder: str, name: str, reason: str) -> None:
        super().__init__(f"{folder} model name {name!r} is refused: {reason}; pass a name as "
                         f"GET /models/{folder} lists it")
        self.folder, self.name, self.reason = folder, name, reason


@dataclass(frozen=True)
class ComfyModels:
    """The models folder at ``root`` (read only)."""

    root: Path

    def __post_init__(self) -> None:
        root = Path(self.root).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"--comfy-models {root}: not a directory; pass ComfyUI's models/ folder "
                                    "(holding diffusion_models/, vae/, text_encoders/, ...)")
        object.__setattr__(self, "root", root.resolve())

    def _dirs(self, folder: str) -> list[Path]:
        if folder not in FOLDERS:
            raise ValueError(f"unknown model folder {folder!r}; pass one of {sorted(FOLDERS)}")
        return [self.root / d for d in FOLDERS[folder] if (self.root / d).is_dir()]

    def _inside(self, path: Path) -> bool:
        return path.resolve().is_relative_to(self.root)

    def _is_entry(self, folder: str, path: Path) -> bool:
        if path.is_file():
            return path.suffix.lower() in WEIGHT_SUFFIXES
        return folder in FOLDER_ENTRIES and path.is_dir() and any((path / m).is_file() for m in FOLDER_MARKERS)

    def list(self, folder: str) -> list[str]:
        """The names in ``folder`` (sorted, ``/``-separated), as ``GET /models/{folder}`` gives.
        Symlinked directories are not walked; a model folder's own files are not listed."""
        names: set[str] = set()
        for base in self._dirs(folder):
            for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
                here = Path(dirpath)
                for sub in list(dirnames):
                    if self._is_entry(folder, here / sub) and self._inside(here / sub):
                        names.add((here / sub).relative_to(base).as_posix())
                        dirnames.remove(sub)  # its files are the model's, not entries
                for file in filenames:
                    path = here / file
                    if self._is_entry(folder, path) and self._inside(path):
                        names.add(path.relative_to(base).as_posix())
        return sorted(names)

    def resolve(self, folder: str, name: str) -> Path:
        """The file (or model folder) ``name`` of kind ``folder``, inside the root."""
        dirs = self._dirs(folder)
        parts = PurePosixPath(name.replace("\\", "/"))
        if not name or "\x00" in name:
            raise ComfyModelNameRefused(folder, name, "empty or not a file name")
        if parts.is_absolute() or (len(name) > 1 and name[1] == ":"):
            raise ComfyModelNameRefused(folder, name, "absolute paths are not model names")
        if ".." in parts.parts:
            raise ComfyModelNameRefused(folder, name, "'..' would leave the models folder")
        for base in dirs:
            path = base.joinpath(*parts.parts)
            if not (path.exists() or path.is_symlink()):
                continue
            if not self._inside(path):
                raise ComfyModelNameRefused(folder, name, "it links outside the models folder")
            if self._is_entry(folder, path):
                return path
        raise ComfyModelNotFound(folder, name, tuple(self.list(folder)))

    def config_folders(self) -> dict[str, Path]:
        """The ``configs/<name>/`` folders by name (a family's architecture configs); a folder
        linking outside the root raises ``ComfyModelNameRefused``. ComfyUI's own files there
        (``*.yaml``) are not folders, not listed."""
        base = self.root / CONFIGS
        if not base.is_dir():
            return {}
        found = {}
        for path in sorted(base.iterdir()):
            if not path.is_dir():
                continue
            if not self._inside(path):
                raise ComfyModelNameRefused(CONFIGS, path.name, "it links outside the models folder")
            found[path.name] = path.resolve()
        return found

