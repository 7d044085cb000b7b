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
    latent_grid,
)
from omniloop.models.families.cosmos3.presets import Cosmos3Defaults
from omniloop.models.families.cosmos3.vision import video_media
from omniloop.pipeline.defaults import GenerationDefaults
from omniloop.pipeline.stages import chat_ids, chat_messages
from omniloop.pipeline.loops.ar import check_context
from omniloop.pipeline.pipeline import format_validation_error
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
            raise ValueError(format_validation_error(e, prefix="node_params['denoise']")) from None
        if request.task is TaskType.REASON:
            _reason(request, tokenizer, defaults, components)
            return request
        if not config.generator:
            raise ValueError(f"task {request.task.value!r} needs the generation pathway, which this checkpoint (a "
                             "reasoner-only unified checkpoint) lacks; pass task 'reason', or load the diffusers "
                             "Cosmos3OmniPipeline folder")
        _towers(request, config, components)
        mode = action_mode(request)
        if mode is not None:
            _actions(request, opts, config, mode)
        _inputs(request, mode)
        vae = components["vae"].config
        geo = geometry(request, defaults, vae)
        _sizes(request, geo, vae, mode)
        if request.task is TaskType.V2W and mode is None:
            t = latent_grid(geo, vae)[0]
            frames = opts.condition_frames or list(defaults.family_as(Cosmos3Defaults).condition_frames)
            if not frames or min(frames) < 0 or max(frames) >= t:
                raise ValueError(f"node_params['denoise'].condition_frames={frames} must be latent frames in [0, {t}) "
                                 f"for num_frames={geo.num_frames}; pass e.g. [0, 1]")
        components["sampler"].get(request.diffusion.sampler)
        return request

    return validate


def _reason(request: OmniRequest, tokenizer, defaults: GenerationDefaults, components: Mapping[str, Any]) -> None:
    if not request.prompt:
        raise ValueError("task 'reason' needs a non-empty text prompt; pass inputs=[TextPart(text=...)]")
    media_tokens = _media_tokens(request, components) if request.parts(Modality.VIDEO) or request.images() else 0
    bad = [t for t in request.sampling.stop_token_ids if not 0 <= t < tokenizer.vocab_size + 1024]
    if bad:
        raise ValueError(f"sampling.stop_token_ids {bad} are outside the vocabulary")
    if any(not s for s in request.sampling.stop):
        raise ValueError("sampling.stop contains an empty string; pass non-empty stop strings")
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
        raise ValueError("image/video prompts need the reasoner's vision tower, and this checkpoint has none (a "
                         "diffusers Cosmos3OmniPipeline folder carries no ViT); pass text-only inputs, or load the "
                         "unified Cosmos3 checkpoint with its ViT weights")
    if request.images() and processor is None:
        raise ValueError("image prompts need the checkpoint's image processor (preprocessor_config.json), which this "
                         "checkpoint lacks; pass text-only inputs or add the processor config")
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
        raise ValueError(f"task 't2vs' needs a sound tower, but this checkpoint has no {missing}; pass task 't2v'")
    wanted = request.outputs.modalities or ()
    if Modality.AUDIO in wanted and request.task is not TaskType.T2VS:
        raise ValueError(f"outputs.modalities names 'audio' but task {request.task.value!r} makes no sound; pass task 't2vs'")
    if (request.task is TaskType.A2W or Modality.ACTION in wanted) and not config.action_gen:
        raise ValueError(f"task {request.task.value!r} with actions needs an action tower (transformer action_gen=true), "
                         "which this checkpoint lacks; drop 'action' from outputs.modalities / use task 'i2v'")
    if Modality.ACTION in wanted and request.task not in (TaskType.V2W, TaskType.A2W):
        raise ValueError(f"outputs.modalities names 'action': predicted actions come from task 'v2w' (policy / inverse "
                         f"dynamics), not {request.task.value!r}")


def _actions(request: OmniRequest, opts: Cosmos3Options, config, mode: str) -> None:
    if opts.domain is None:
        raise ValueError(f"task {request.task.value!r} ({mode}) needs an embodiment: pass node_params['denoise'].domain, "
                         f"one of {sorted(P.EMBODIMENT_ACTION_DIMS)}")
    if opts.domain not in P.EMBODIMENT_ACTION_DIMS:
        raise ValueError(f"node_params['denoise'].domain={opts.domain!r} is not a known embodiment domain; pass one of "
                         f"{sorted(P.EMBODIMENT_ACTION_DIMS)}")
    raw = P.EMBODIMENT_ACTION_DIMS[opts.domain]
    if raw > config.action_dim:
        raise ValueError(f"domain {opts.domain!r} has {raw}-wide actions but this checkpoint's action_dim is "
                         f"{config.action_dim}; pass a narrower embodiment")
    if mode == FORWARD_DYNAMICS:
        actions = given_actions(request)
        if actions is None or actions.ndim != 2 or actions.shape[0] < 1:
            raise ValueError("task 'a2w' (forward dynamics) needs actions: add ActionPart(values=[[...], ...]) with one "
                             f"row of {raw} values per step")
        if actions.shape[1] != raw:
            raise ValueError(f"ActionPart.values rows have {actions.shape[1]} values but domain {opts.domain!r} "
                             f"takes {raw}; pass [T, {raw}] actions")


def _inputs(request: OmniRequest, mode: str | None) -> None:
    images, videos = request.images("first_frame"), request.parts(Modality.VIDEO)
    task = request.task
    if task is TaskType.I2V and not images:
        raise ValueError("task 'i2v' needs an image: add ImagePart(role='first_frame', path=... | b64=... | data=...)")
    if mode is not None:
        if images and videos:
            raise ValueError(f"task {task.value!r} takes either a first_frame image or a video, not both")
        if mode == INVERSE_DYNAMICS and not videos:
            raise ValueError("inverse dynamics (task 'v2w' with outputs.modalities=['action']) needs the video: add a "
                             "VideoPart")
        if not images and not videos:
            raise ValueError(f"task {task.value!r} ({mode}) needs a first_frame ImagePart or a VideoPart")
    elif task is TaskType.V2W and not videos:
        raise ValueError("task 'v2w' continues a video: add VideoPart(path=... | b64=... | data=frames)")
    if images or (videos and task in (TaskType.V2W, TaskType.A2W)):
        first_image(request)  # unreadable -> ValueError naming the source


def _sizes(request: OmniRequest, geo, vae: Any, mode: str | None) -> None:
    """``vae``: the VAE's config (sizes are multiples of its scale factors)."""
    s, t = int(vae.scale_factor_spatial), int(vae.scale_factor_temporal)
    if mode is None:
        for name, value in (("height", geo.height), ("width", geo.width)):
            if value % s:
                lo = max(s, value // s * s)
                raise ValueError(f"diffusion.{name}={value} must be a multiple of {s}; pass {lo} or {lo + s}")
    if request.task is TaskType.T2I and geo.num_frames != 1:
        raise ValueError(f"task 't2i' makes one image; diffusion.num_frames must be 1 (got {geo.num_frames})")
    if request.task is not TaskType.T2I and (geo.num_frames < 2 or (geo.num_frames - 1) % t):
        k = max((geo.num_frames - 1) // t, 1)
        field = "diffusion.num_frames" if mode is None or request.diffusion.num_frames else "the ActionPart's rows + 1"
        raise ValueError(f"{field}={geo.num_frames} must be {t}k+1 frames; pass {t * k + 1} or {t * (k + 1) + 1}")
