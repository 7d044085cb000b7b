"""The CLI's checks that need no weights and no torch, run before anything loads.

Loading a model takes seconds (importing torch alone takes several on a busy machine), so
every flag that can be judged from the flags themselves and from what a model declares on
disk (an omniloop manifest: its tasks, limits and shape rules) is judged first. Each refusal
is one line naming the flag and what to pass instead, spelled as admission spells the same
mistake after loading (``--height=30 must be a multiple of 16; pass 16 or 32``), so a user
meets one message whichever check catches it. What needs the loaded model (a diffusers
checkpoint's tasks and rules, the sampler names) is still admission's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omniloop.deploy import Limits
from omniloop.models.catalog import resolve_model_path
from omniloop.models.manifest import MANIFEST_FILE, ModelLimits, read_manifest
from omniloop.pipeline.geometry_checks import nearest_multiples
from omniloop.request import DiffusionParams, LoraRef, OmniRequest, TaskType


@dataclass(frozen=True)
class DeclaredModel:
    """What a manifest-layout model declares about the requests it serves, read from its
    ``omniloop_model.json`` without loading it."""

    name: str  # as the user named it (--model)
    tasks: tuple[str, ...]
    defaults: Mapping[str, Any]  # generation defaults (height, width, num_frames, ...)
    limits: ModelLimits


def check_model_exists(model: str) -> None:
    """--model names a directory or a built-in model: a typo is refused in a fraction of a
    second, naming the closest built-in name, instead of after torch and a family import."""
    try:
        resolve_model_path(model)
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"--model {model}: {e}") from None


def declared_model(model: str) -> DeclaredModel | None:
    """The manifest of ``model``; None when it is not a manifest-layout directory or built-in
    name (a diffusers checkpoint declares its tasks through classes only its family knows; a
    path that does not exist is the loader's to report, after the flag checks)."""
    try:
        root = resolve_model_path(model)
    except (FileNotFoundError, ValueError):
        return None
    if not (root / MANIFEST_FILE).is_file():
        return None
    m = read_manifest(root)
    return DeclaredModel(name=model, tasks=tuple(m.tasks), defaults=m.defaults, limits=m.limits)


def check_task(model: DeclaredModel, task: str | None) -> None:
    """--task against the tasks the manifest declares."""
    check_task_in(list(model.tasks), model.name, task)


def check_task_in(tasks: list[str], name: str, task: str | None) -> None:
    if task is None or task in tasks:
        return
    raise ValueError(f"--task {task}: task {task!r} is not served by {name!r} (its tasks: {tasks}); pass "
                     f"--task {tasks[0]}, or a --model that serves {task} (omniloop models lists them)")


def check_checkpoint_task(model: str, task: str | None) -> None:
    """--task against the tasks a diffusers / transformers checkpoint's variant serves, from its
    ``model_index.json`` (or ``config.json``) and its family's spec: no weight is read. Imports
    the family (torch), so it runs after the torch-free checks."""
    if task is None:
        return
    from omniloop.models.catalog import resolve_model_path
    from omniloop.models.loader import read_model_index
    from omniloop.models.model_spec import spec_for_class

    root = resolve_model_path(model)
    index = read_model_index(root)
    variant = spec_for_class(index["_class_name"]).variant(index)
    check_task_in(sorted(t.value for t in variant.tasks), model, task)


def check_shape(model: DeclaredModel, task: str | None, params: Mapping[str, Any]) -> None:
    """--height / --width / --num-frames (or the manifest's defaults for those not given)
    against its limits and shape rules, in the order the family's validator checks them."""
    limits = model.limits
    frames_apply = task != TaskType.T2I.value  # an image is one frame (admission checks --num-frames then)
    values = {name: params.get(name, model.defaults.get(name)) for name in ("height", "width", "num_frames")}
    caps = {"height": limits.max_height, "width": limits.max_width, "num_frames": limits.max_frames if frames_apply else None}
    for name, cap in caps.items():
        value = values[name]
        if cap is not None and value is not None and value > cap:
            limit = {"num_frames": "max_frames"}.get(name, f"max_{name}")
            raise ValueError(f"{_flag(name)}={value} is more than this model serves (at most {cap}: the "
                             f"limits.{limit} of its manifest); pass {cap} or less")
    step = limits.size_multiple
    for name in ("height", "width"):
        value = values[name]
        if step is not None and value is not None and value % step:
            raise ValueError(f"{_flag(name)}={value} must be a multiple of {step}; pass {nearest_multiples(value, step)}")
    frames, t = values["num_frames"], limits.frame_step
    if frames_apply and t is not None and frames is not None and (frames - 1) % t:
        k = (frames - 1) // t
        raise ValueError(f"--num-frames={frames} must be {t}k+1; pass {t * k + 1} or {t * (k + 1) + 1}")


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def check_lora_files(files: Mapping[str, str], where: str = "--lora-files") -> None:
    """Each ``{name: path}`` LoRA file a deployment loads at startup exists and is safetensors."""
    for name, path in files.items():
        _check_lora_file(Path(path).expanduser(), f"{where} {name}")


def check_lora_refs(loras: Sequence[Any], registered: Mapping[str, str]) -> None:
    """--loras (as given: names, (name, strength) pairs or mappings, each a ``LoraRef``):
    offline, a LoRA is a --lora-files name or a .safetensors file path; one spelled as a path
    must exist (the generator loads it by its path on first use)."""
    for ref in loras:
        name = LoraRef.model_validate(ref).name
        path = Path(name).expanduser()
        if name in registered or not (path.suffix or os.sep in name):
            continue  # a registered name (a deploy config's lora_files: admission knows them all)
        _check_lora_file(path, f"--loras {name}")


def _check_lora_file(path: Path, where: str) -> None:
    if not path.is_file():
        raise ValueError(f"{where}: LoRA file {path} does not exist; pass the path of a .safetensors LoRA")
    if path.suffix != ".safetensors":
        raise ValueError(f"{where}: LoRA file {path} is not a .safetensors file (pickled weights are not loaded); "
                         "convert it")


def check_writable(target: Path, flag: str, given: str) -> None:
    """The folder ``target`` would be written into exists or can be made, and is writable:
    its nearest existing ancestor is a writable directory."""
    folder = target.parent.resolve()
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {given!r}: {folder} is a file, not a directory; pass a path in a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {given!r}: the directory {folder} is not writable; pass a path you may write")


def check_deploy_limits(limits: Limits, task: str | None, params: Mapping[str, Any],
                        model: DeclaredModel | None) -> None:
    """The deployment's ceilings (``--limits``, a deploy config's ``limits``) on the flags and,
    for a manifest model, its defaults: the engine's own check (engine/limits.py), run before
    loading. A diffusers checkpoint's defaults are known once it loads: its unset fields are
    checked then. Not for text out (--task reason: no frames, pixels or steps)."""
    from omniloop.engine.limits import check_as_asked  # imports torch (the engine): the deployment already did
    from omniloop.pipeline.defaults import GenerationDefaults

    if task == TaskType.REASON.value:
        return
    request = OmniRequest(task=TaskType(task or (model.tasks[0] if model else TaskType.T2V.value)),
                          diffusion=DiffusionParams(**params))
    # a manifest's defaults, typed; unknown ones (a diffusers checkpoint before it loads) count as
    # the least they can be (no frames, no pixels, one step): the engine checks them once known
    least = GenerationDefaults(steps=1)
    check_as_asked(request, limits, least if model is None else least.with_json(model.defaults, model.name))
