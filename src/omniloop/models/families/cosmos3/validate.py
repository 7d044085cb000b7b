"""Cosmos3 request validation at admission: each bad input is a ValueError naming the field
and what to pass instead, before any work starts (and before any KV is allocated)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from pydantic import ValidationError

from omniloop.models.families.cosmos3 import presets as P
from omniloop.models.families.cosmos3.stages import (
    _pil, video_array, video_processing,
    FORWARD_DYNAMICS, INVERSE_DYNAMICS, Cosmos3Options, action_mode, first_image, geometry, given_actions,
    latent_grid, resolve_geometry,
)
from omniloop.models.families.cosmos3.presets import Cosmos3Defaults
from omniloop.models.families.cosmos3.vision import video_media
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.stages import chat_ids, chat_messages
from omniloop.pipeline.loops.ar import check_context
from omniloop.request import ErrorKind, InvalidRequest, format_validation_error
from omniloop.request import Modality, OmniRequest, TaskType

GENERATION_TASKS = frozenset({TaskType.T2I, TaskType.T2V, TaskType.I2V, TaskType.V2W, TaskType.T2VS, TaskType.A2W})


def make_validator(defaults: GenerationDefaults, components: Mapping[str, Any]) -> Callable[[OmniRequest], OmniRequest]:
    model = components["transformer"]
    config = model.config
    tokenizer = components["tokenizer"]

    def validate(request: OmniRequest) -> OmniRequest:
        try:
            opts = Cosmos3Options.model_validate(request.node_params.get("denoise", {}))
        except ValidationError as e:
            raise format_validation_error(e, prefix="node_params['denoise']").error() from None
        if request.task is TaskType.REASON:
            _reason(request, tokenizer, defaults, components)
            return request
        if not config.generator:
            raise InvalidRequest(f"task {request.task.value!r} needs the generation pathway, which this checkpoint (a "
                                 "reasoner-only unified checkpoint) lacks; pass task 'reason', or load the diffusers "
                                 "Cosmos3OmniPipeline folder", fields=("task",), kind=ErrorKind.UNSUPPORTED_TASK)
        _towers(request, config, components)
        mode = action_mode(request)
        if mode is not None:
            _actions(request, opts, config, mode)
        _inputs(request, mode)
        vae = components["vae"].config
        resolved = resolve_geometry(request, defaults, vae)  # what runs: the checks below are on it
        geo = geometry(resolved, vae)
        _sizes(request, geo, vae, mode)  # ``request``: as asked (which field to name)
        if request.task is TaskType.V2W and mode is None:
            t = latent_grid(geo, vae)[0]
            frames = opts.condition_frames or list(defaults.family_as(Cosmos3Defaults).condition_frames)
            if not frames or min(frames) < 0 or max(frames) >= t:
                raise InvalidRequest(f"node_params['denoise'].condition_frames={frames} must be latent frames in [0, {t}) "
                                     f"for num_frames={geo.num_frames}; pass e.g. [0, 1]",
                                     fields=("node_params['denoise'].condition_frames",))
        components["sampler"].get(request.diffusion.sampler)
        return resolved

    return validate


def _reason(request: OmniRequest, tokenizer, defaults: GenerationDefaults, components: Mapping[str, Any]) -> None:
    if not request.prompt:
        raise InvalidRequest("task 'reason' needs a non-empty text prompt; pass inputs=[TextPart(text=...)]",
                             fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
    media_tokens = _media_tokens(request, components) if request.parts(Modality.VIDEO) or request.images() else 0
    bad = [t for t in request.sampling.stop_token_ids if not 0 <= t < tokenizer.vocab_size + 1024]
    if bad:
        raise InvalidRequest(f"sampling.stop_token_ids {bad} are outside the vocabulary",
                             fields=("sampling.stop_token_ids",))
    if any(not s for s in request.sampling.stop):
        raise InvalidRequest("sampling.stop contains an empty string; pass non-empty stop strings",
                             fields=("sampling.stop",))
    prompt_len = len(chat_ids(tokenizer, chat_messages(request))) + media_tokens
    check_context(prompt_len, request.sampling.max_tokens, defaults.text_or_default().max_context)
    pool = components.get("text_kv")
    if pool is not None:
        pool.check_fits(prompt_len + request.sampling.max_tokens)


def _media_tokens(request: OmniRequest, components: Mapping[str, Any]) -> int:
    """Prompt tokens the request's images and videos add (at least: each pad becomes its
    merged patches; a video's timestamps add a few more)."""
    tower, processor = components.get("vision_tower"), components.get("image_processor")
    if tower is None:
        raise InvalidRequest("image/video prompts need the reasoner's vision tower, and this checkpoint has none (a "
                             "diffusers Cosmos3OmniPipeline folder carries no ViT); pass text-only inputs, or load the "
                             "unified Cosmos3 checkpoint with its ViT weights", fields=("inputs",))
    if request.images() and processor is None:
        raise InvalidRequest("image prompts need the checkpoint's image processor (preprocessor_config.json), which this "
                             "checkpoint lacks; pass text-only inputs or add the processor config", fields=("inputs",))
    merge = tower.spatial_merge_size
    total = 0
    for part in request.images():
        width, height = _pil(part).size
        total += processor.get_number_of_image_patches(height, width, {}) // merge**2 - 1
    for part in request.parts(Modality.VIDEO):
        frames, fps = video_array(part)
        total += video_media(video_processing(components, tower), torch.from_numpy(frames), fps).pixels.shape[0] // merge**2
    return total


def _towers(request: OmniRequest, config, components: Mapping[str, Any]) -> None:
    if request.task is TaskType.T2VS and not (config.sound_gen and components.get("sound_tokenizer") is not None):
        missing = "sound tower (transformer sound_gen=false)" if not config.sound_gen else "sound_tokenizer/ folder"
        raise InvalidRequest(f"task 't2vs' needs a sound tower, but this checkpoint has no {missing}; pass task 't2v'",
                             fields=("task",), kind=ErrorKind.UNSUPPORTED_TASK)
    wanted = request.outputs.modalities or ()
    if Modality.AUDIO in wanted and request.task is not TaskType.T2VS:
        raise InvalidRequest(f"outputs.modalities names 'audio' but task {request.task.value!r} makes no sound; pass task 't2vs'",
                             fields=("outputs.modalities", "task"))
    if (request.task is TaskType.A2W or Modality.ACTION in wanted) and not config.action_gen:
        raise InvalidRequest(f"task {request.task.value!r} with actions needs an action tower (transformer action_gen=true), "
                             "which this checkpoint lacks; drop 'action' from outputs.modalities / use task 'i2v'",
                             fields=("task", "outputs.modalities"), kind=ErrorKind.UNSUPPORTED_TASK)
    if Modality.ACTION in wanted and request.task not in (TaskType.V2W, TaskType.A2W):
        raise InvalidRequest(f"outputs.modalities names 'action': predicted actions come from task 'v2w' (policy / inverse "
                             f"dynamics), not {request.task.value!r}", fields=("outputs.modalities", "task"))


def _actions(request: OmniRequest, opts: Cosmos3Options, config, mode: str) -> None:
    if opts.domain is None:
        raise InvalidRequest(f"task {request.task.value!r} ({mode}) needs an embodiment: pass node_params['denoise'].domain, "
                             f"one of {sorted(P.EMBODIMENT_ACTION_DIMS)}",
                             fields=("node_params['denoise'].domain",), kind=ErrorKind.MISSING_INPUT)
    if opts.domain not in P.EMBODIMENT_ACTION_DIMS:
        raise InvalidRequest(f"node_params['denoise'].domain={opts.domain!r} is not a known embodiment domain; pass one of "
                             f"{sorted(P.EMBODIMENT_ACTION_DIMS)}", fields=("node_params['denoise'].domain",))
    raw = P.EMBODIMENT_ACTION_DIMS[opts.domain]
    if raw > config.action_dim:
        raise InvalidRequest(f"domain {opts.domain!r} has {raw}-wide actions but this checkpoint's action_dim is "
                             f"{config.action_dim}; pass a narrower embodiment",
                             fields=("node_params['denoise'].domain",))
    if mode == FORWARD_DYNAMICS:
        actions = given_actions(request)
        if actions is None or actions.ndim != 2 or actions.shape[0] < 1:
            raise InvalidRequest("task 'a2w' (forward dynamics) needs actions: add ActionPart(values=[[...], ...]) with one "
                                 f"row of {raw} values per step", fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
        if actions.shape[1] != raw:
            raise InvalidRequest(f"ActionPart.values rows have {actions.shape[1]} values but domain {opts.domain!r} "
                                 f"takes {raw}; pass [T, {raw}] actions", fields=("inputs",))


def _inputs(request: OmniRequest, mode: str | None) -> None:
    images, videos = request.images("first_frame"), request.parts(Modality.VIDEO)
    task = request.task
    if task is TaskType.I2V and not images:
        raise InvalidRequest("task 'i2v' needs an image: add ImagePart(role='first_frame', path=... | b64=... | data=...)",
                             fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
    if mode is not None:
        if images and videos:
            raise InvalidRequest(f"task {task.value!r} takes either a first_frame image or a video, not both",
                                 fields=("inputs",))
        if mode == INVERSE_DYNAMICS and not videos:
            raise InvalidRequest("inverse dynamics (task 'v2w' with outputs.modalities=['action']) needs the video: add a "
                                 "VideoPart", fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
        if not images and not videos:
            raise InvalidRequest(f"task {task.value!r} ({mode}) needs a first_frame ImagePart or a VideoPart",
                                 fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
    elif task is TaskType.V2W and not videos:
        raise InvalidRequest("task 'v2w' continues a video: add VideoPart(path=... | b64=... | data=frames)",
                             fields=("inputs",), kind=ErrorKind.MISSING_INPUT)
    if images or (videos and task in (TaskType.V2W, TaskType.A2W)):
        first_image(request)  # unreadable -> ValueError naming the source


def _sizes(request: OmniRequest, geo, vae: Any, mode: str | None) -> None:
    """``vae``: the VAE's config (sizes are multiples of its scale factors)."""
    s, t = int(vae.scale_factor_spatial), int(vae.scale_factor_temporal)
    if mode is None:
        for name, value in (("height", geo.height), ("width", geo.width)):
            if value % s:
                lo = max(s, value // s * s)
                raise InvalidRequest(f"diffusion.{name}={value} must be a multiple of {s}; pass {lo} or {lo + s}",
                                     fields=(f"diffusion.{name}",))
    if request.task is TaskType.T2I and geo.num_frames != 1:
        raise InvalidRequest(f"task 't2i' makes one image; diffusion.num_frames must be 1 (got {geo.num_frames})",
                             fields=("diffusion.num_frames",))
    if request.task is not TaskType.T2I and (geo.num_frames < 2 or (geo.num_frames - 1) % t):
        k = max((geo.num_frames - 1) // t, 1)
        from_frames = mode is None or request.diffusion.num_frames
        field = "diffusion.num_frames" if from_frames else "the ActionPart's rows + 1"
        path = "diffusion.num_frames" if from_frames else "inputs"  # the field at fault
        raise InvalidRequest(f"{field}={geo.num_frames} must be {t}k+1 frames; pass {t * k + 1} or {t * (k + 1) + 1}",
                             fields=(path,))
