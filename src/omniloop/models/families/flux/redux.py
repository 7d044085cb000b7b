"""FLUX.1 Redux (image variation): a SigLIP vision tower's last hidden state, mapped by the
Redux embedder (``redux_down(silu(redux_up(x)))``, 1152 -> 3 x 4096 -> 4096) to T5-width
tokens appended after the prompt's T5 tokens (diffusers ``FluxPriorReduxPipeline``).

Optional components of a Flux folder: ``image_encoder/`` (transformers ``SiglipVisionModel``),
``feature_extractor/`` (``SiglipImageProcessor``) and ``image_embedder/`` (diffusers
``ReduxImageEncoder``): FLUX.1-Redux-dev's three folders beside FLUX.1-dev's (or schnell's).

A Redux request is a text-to-image request with one or more ``ImagePart(role="reference")``.
The ``redux`` node sits between the text encoder (whose output it reads as ``prompt_text``)
and the denoise loop (which reads its ``text``): requests without a reference pass through
unchanged. Two ways of combining several images (``ReduxParams.combine``):

- ``sum`` (diffusers): per image i, ``cat([T5(prompt), tokens_i]) * prompt_embeds_scale[i]``
  and ``pooled * pooled_prompt_embeds_scale[i]``, summed over the images. Without a prompt
  (no TextPart: the text encoders do not run) the prompt is zeros ``[512, joint_dim]`` and the
  pooled vector zeros, as diffusers' prior loaded without text encoders (its documented use).
- ``concat`` (ComfyUI's chained ``StyleModelApply``, strength_type "multiply"): the prompt's
  tokens, then each image's tokens times ``strength[i]``; the pooled vector unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Mapping, Sequence

import torch
from pydantic import Field, field_validator

from omniloop.io.image import open_image_part
from omniloop.models.model_spec import LoadOptions, WeightSpec
from omniloop.models.text.base import WrappedModel
from omniloop.pipeline.edges import TextEmbeddings
from omniloop.pipeline.predicates import opt
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ImagePart, InvalidRequest, LoopParams, OmniRequest, TaskType

REFERENCE_ROLE = "reference"
REDUX_COMPONENTS = ("image_encoder", "image_embedder")
REDUX_HINT = ("load a Flux folder with FLUX.1-Redux-dev's image_encoder/ (SiglipVisionModel), feature_extractor/ "
              "(SiglipImageProcessor) and image_embedder/ (ReduxImageEncoder) folders beside its own, each named in "
              "model_index.json")


# -- components ------------------------------------------------------------------------


class ReduxImageEmbedder(torch.nn.Module):
    """The Redux projector: ``[N, L, redux_dim] -> [N, L, txt_in_features]`` (BFL's and
    diffusers' ``ReduxImageEncoder``; the same ``redux_up`` / ``redux_down`` keys in both)."""

    def __init__(self, redux_dim: int = 1152, txt_in_features: int = 4096) -> None:
        super().__init__()
        self.redux_up = torch.nn.Linear(redux_dim, txt_in_features * 3)
        self.redux_down = torch.nn.Linear(txt_in_features * 3, txt_in_features)

    @property
    def txt_in_features(self) -> int:
        return self.redux_down.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.redux_down(torch.nn.functional.silu(self.redux_up(x)))


def redux_embedder_from_state(state: Mapping[str, torch.Tensor], *, name: str, device: torch.device | str,
                              dtype: torch.dtype) -> ReduxImageEmbedder:
    """A Redux embedder from its four tensors (widths read off ``redux_up.weight``)."""
    want = {"redux_up.weight", "redux_up.bias", "redux_down.weight", "redux_down.bias"}
    if set(state) != want:
        raise ValueError(f"{name}: not a FLUX.1 Redux embedder; it needs exactly the keys {sorted(want)}, got "
                         f"{sorted(state)[:6]}")
    up = state["redux_up.weight"]  # [3 * txt, redux_dim]
    model = ReduxImageEmbedder(redux_dim=int(up.shape[1]), txt_in_features=int(up.shape[0]) // 3)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_redux_embedder(folder: Path, *, device: torch.device | str, dtype: torch.dtype) -> ReduxImageEmbedder:
    """diffusers' ``image_embedder/`` (config.json + diffusion_pytorch_model.safetensors)."""
    from safetensors.torch import load_file

    weights = folder / "diffusion_pytorch_model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} not found; FLUX.1-Redux-dev keeps its embedder there")
    config = json.loads((folder / "config.json").read_text())
    model = redux_embedder_from_state(load_file(str(weights)), name=str(weights), device=device, dtype=dtype)
    if model.txt_in_features != config.get("txt_in_features", model.txt_in_features):
        raise ValueError(f"{folder}/config.json says txt_in_features={config['txt_in_features']} but the weights "
                         f"have {model.txt_in_features}")
    return model


class SiglipImageEncoder(WrappedModel):
    """``encode(images) -> [N, patches, hidden]``: the SigLIP tower's last hidden state
    (729 x 1152 for so400m-patch14-384), the images prepared by its processor as diffusers'
    ``FluxPriorReduxPipeline.encode_image`` does (resized to the tower's square, rescaled,
    normalized with mean = std = 0.5)."""

    def __init__(self, model: torch.nn.Module, processor: Any) -> None:
        self.model = model.eval().requires_grad_(False)
        self.processor = processor
        self.config: Any = model.config

    @torch.inference_mode()
    def encode(self, images: Sequence[Any]) -> torch.Tensor:
        pixels = self.processor.preprocess(images=list(images), do_resize=True, return_tensors="pt",
                                           do_convert_rgb=True)
        pixels = pixels.to(device=self.device, dtype=self.dtype)
        return self.model(**pixels).last_hidden_state


def load_siglip_encoder(encoder_dir: Path, processor_dir: Path, *, device: torch.device | str,
                        dtype: torch.dtype) -> SiglipImageEncoder:
    from transformers import SiglipImageProcessor, SiglipVisionModel

    for folder in (encoder_dir, processor_dir):
        if not Path(folder).is_dir():
            raise FileNotFoundError(f"missing folder {folder}")
    model: torch.nn.Module = SiglipVisionModel.from_pretrained(encoder_dir, dtype=dtype)
    return SiglipImageEncoder(model.to(device), SiglipImageProcessor.from_pretrained(processor_dir))


def _load_image_encoder(root: Path, index: Mapping[str, Any], options: LoadOptions) -> SiglipImageEncoder:
    return load_siglip_encoder(root / "image_encoder", root / "feature_extractor", device=options.device,
                               dtype=options.dtype)


def _load_image_embedder(root: Path, index: Mapping[str, Any], options: LoadOptions) -> ReduxImageEmbedder:
    return load_redux_embedder(root / "image_embedder", device=options.device, dtype=options.dtype)


def redux_weights(index: Mapping[str, Any]) -> tuple[WeightSpec, ...]:
    """The Redux components' weights when model_index.json names them, else none."""
    if not has_redux(index):
        return ()
    return (WeightSpec(component="image_encoder", kind="SigLIP vision tower + processor",
                       subfolder=("image_encoder", "feature_extractor"), load=_load_image_encoder),
            WeightSpec(component="image_embedder", kind="FLUX.1 Redux embedder", subfolder="image_embedder",
                       load=_load_image_embedder))


# -- ComfyUI single files: clip_vision/sigclip_vision_patch14_384.safetensors + style_models/flux1-redux-dev ------

SIGLIP_PREFIX = "vision_model."
RELEASED_SIGLIP_HEADS = 16  # so400m-patch14-384 (not in the file)
# so400m-patch14-384: 27 x 27 patches of 14 px read off a 384 px square (the conv drops the last 6 px)
RELEASED_SIGLIP_SIZES = {(27, 14): 384}


def siglip_config(state: Mapping[str, torch.Tensor], num_attention_heads: int | None = None) -> Any:
    """The ``SiglipVisionConfig`` of a transformers-layout SigLIP tower state (ComfyUI's
    ``sigclip_vision_patch14_384.safetensors``: ``vision_model.*``): widths, depth, patch and
    image size read off the tensors; the head count is the released 16 unless given."""
    from transformers import SiglipVisionConfig

    patch = state[f"{SIGLIP_PREFIX}embeddings.patch_embedding.weight"]  # [hidden, 3, p, p]
    positions = int(state[f"{SIGLIP_PREFIX}embeddings.position_embedding.weight"].shape[0])  # (image // p)^2
    side, p = round(positions ** 0.5), int(patch.shape[-1])
    if side * side != positions:
        raise ValueError(f"position_embedding has {positions} rows, not a square number of patches")
    layers = 1 + max(int(k[len(f"{SIGLIP_PREFIX}encoder.layers."):].split(".", 1)[0]) for k in state
                     if k.startswith(f"{SIGLIP_PREFIX}encoder.layers."))
    hidden, heads = int(patch.shape[0]), num_attention_heads or RELEASED_SIGLIP_HEADS
    if hidden % heads:
        raise ValueError(f"width {hidden} does not split into {heads} heads; pass the encoder's head count")
    return SiglipVisionConfig(
        hidden_size=hidden, intermediate_size=int(state[f"{SIGLIP_PREFIX}encoder.layers.0.mlp.fc1.weight"].shape[0]),
        num_hidden_layers=layers, num_attention_heads=heads, patch_size=p,
        image_size=RELEASED_SIGLIP_SIZES.get((side, p), side * p), hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
        vision_use_head=f"{SIGLIP_PREFIX}head.probe" in state,
    )


def load_siglip_single_file(path: Path, *, device: torch.device | str, dtype: torch.dtype,
                            num_attention_heads: int | None = None) -> SiglipImageEncoder:
    """ComfyUI's SigLIP ``clip_vision/`` file (a transformers ``SiglipVisionModel`` state under
    ``vision_model.``); the processor is SigLIP's (resize to the square, mean = std = 0.5)."""
    from safetensors.torch import load_file
    from transformers import SiglipImageProcessor, SiglipVisionModel

    state = load_file(str(path))
    name = Path(path).name
    if f"{SIGLIP_PREFIX}embeddings.patch_embedding.weight" not in state:
        raise ValueError(f"{name}: not a SigLIP vision tower (no {SIGLIP_PREFIX}embeddings.patch_embedding.weight)")
    if f"{SIGLIP_PREFIX}encoder.layers.0.layer_norm1.weight" in state and "visual_projection.weight" in state:
        raise ValueError(f"{name}: a CLIP vision tower (visual_projection); FLUX.1 Redux reads SigLIP: pass "
                         "sigclip_vision_patch14_384.safetensors")
    try:
        config = siglip_config(state, num_attention_heads)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    model = SiglipVisionModel(config).eval()
    unknown = sorted(k for k in state if not k.startswith(SIGLIP_PREFIX))
    if unknown:
        raise ValueError(f"{name}: keys no SigLIP vision tower has: {unknown[:5]}")
    keep = next(iter(model.state_dict())).startswith(SIGLIP_PREFIX)  # transformers 5 drops the prefix
    model.load_state_dict({(k if keep else k[len(SIGLIP_PREFIX):]): v.to(dtype) for k, v in state.items()}, strict=True)
    size = config.image_size
    processor = SiglipImageProcessor(size={"height": size, "width": size})
    return SiglipImageEncoder(model.to(device=device, dtype=dtype), processor)


def load_redux_single_file(path: Path, *, device: torch.device | str, dtype: torch.dtype) -> ReduxImageEmbedder:
    """ComfyUI's ``style_models/flux1-redux-dev.safetensors`` (``redux_up.*`` / ``redux_down.*``)."""
    from safetensors.torch import load_file

    return redux_embedder_from_state(load_file(str(path)), name=Path(path).name, device=device, dtype=dtype)


REDUX_INDEX = {"image_encoder": ["transformers", "SiglipVisionModel"],
               "feature_extractor": ["transformers", "SiglipImageProcessor"],
               "image_embedder": ["diffusers", "ReduxImageEncoder"]}


def redux_single_files(clip_vision: Path | None, style_model: Path | None, *, device: torch.device | str,
                       dtype: torch.dtype, heads: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model_index entries and components of a style model + SigLIP pair (both or neither)."""
    if style_model is None and clip_vision is None:
        return {}, {}
    if style_model is None or clip_vision is None:
        given, missing = ("clip_vision", "style_models") if style_model is None else ("style_models", "clip_vision")
        raise ValueError(f"FLUX.1 Redux needs its style model (style_models/flux1-redux-dev.safetensors, "
                         f"StyleModelLoader) and its SigLIP tower (clip_vision/sigclip_vision_patch14_384.safetensors, "
                         f"CLIPVisionLoader); {given} is given, {missing} is not")
    encoder = load_siglip_single_file(clip_vision, device=device, dtype=dtype, num_attention_heads=heads)
    embedder = load_redux_single_file(style_model, device=device, dtype=dtype)
    width = int(encoder.config.hidden_size)
    if embedder.redux_up.in_features != width:
        raise ValueError(f"style_models: {style_model.name} reads {embedder.redux_up.in_features}-wide SigLIP tokens "
                         f"but {clip_vision.name} makes {width}-wide ones; pass the SigLIP it was trained with "
                         "(sigclip_vision_patch14_384)")
    components: dict[str, Any] = {"image_encoder": encoder, "image_embedder": embedder}
    return dict(REDUX_INDEX), components


def has_redux(index: Mapping[str, Any]) -> bool:
    """model_index.json names the Redux embedder (an image encoder alone is an IP-Adapter's)."""
    entry = index.get("image_embedder")
    return isinstance(entry, (list, tuple)) and bool(entry) and entry[0] is not None


# -- request knobs -------------------------------------------------------------------------


class ReduxParams(LoopParams):
    """``node_params["redux"]``: how the reference images' tokens join the prompt."""

    combine: Literal["sum", "concat"] = Field(
        default="sum", description="sum: diffusers FluxPriorReduxPipeline (each image's [prompt; image tokens] "
                                   "scaled, summed over images); concat: ComfyUI StyleModelApply chained (prompt "
                                   "tokens then every image's tokens times its strength)")
    prompt_embeds_scale: float | list[float] = Field(default=1.0, description="sum: per image (or one for all)")
    pooled_prompt_embeds_scale: float | list[float] = Field(default=1.0, description="sum: per image (or one)")
    strength: float | list[float] = Field(default=1.0, description="concat: per image (or one for all)")

    flat: ClassVar[Mapping[str, str]] = {"prompt_embeds_scale": "prompt_embeds_scale",
                                         "pooled_prompt_embeds_scale": "pooled_prompt_embeds_scale"}

    @field_validator("prompt_embeds_scale", "pooled_prompt_embeds_scale", "strength")
    @classmethod
    def _nonempty(cls, v: float | list[float]) -> float | list[float]:
        if isinstance(v, list) and not v:
            raise ValueError("pass a number, or one number per reference image")
        return v

    def per_image(self, name: str, count: int) -> list[float]:
        value = getattr(self, name)
        if isinstance(value, list):
            if len(value) != count:
                raise InvalidRequest(f"node_params['redux'].{name} has {len(value)} values for {count} reference "
                                     "images", hint="pass one number, or one per reference image",
                                     fields=(f"node_params['redux'].{name}",))
            return [float(v) for v in value]
        return [float(value)] * count


# -- the pipeline node ---------------------------------------------------------------------


def references(request: OmniRequest) -> list[ImagePart]:
    """A text-to-image request's Redux images (an i2i request's 'reference' is the image it edits)."""
    return request.images(REFERENCE_ROLE) if request.task == TaskType.T2I else []


def _encodes_text(request: OmniRequest) -> bool:
    # a Redux request without a TextPart takes zeros for the prompt (diffusers' prior without text encoders)
    return request.prompt is not None or not references(request)


TEXT_WANTED = opt("a prompt, or no Redux reference image", _encodes_text)


@dataclass
class FluxReduxPrior(StageBase):
    """``prompt_text`` (the text encoder's output, absent for a prompt-less Redux request) ->
    ``text``: with the reference images' Redux tokens appended (module docstring), or
    unchanged for a request without any."""

    optional_inputs = {"prompt_text": TextEmbeddings}
    outputs = {"text": TextEmbeddings}
    params_schema = ReduxParams
    components: Sequence[str] = ("image_encoder", "image_embedder", "transformer")

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        knobs = state.node_params.get(ctx.node) or ReduxParams()
        count = len(references(state.request))
        defaults = ReduxParams()
        unused = ("strength",) if knobs.combine == "sum" else ("prompt_embeds_scale", "pooled_prompt_embeds_scale")
        for name in unused:
            if getattr(knobs, name) != getattr(defaults, name):
                raise InvalidRequest(f"node_params['redux'].{name} does not apply to combine={knobs.combine!r}",
                                     hint="omit it, or pick the other combine", fields=(f"node_params['redux'].{name}",))
        for name in ("prompt_embeds_scale", "pooled_prompt_embeds_scale", "strength"):
            knobs.per_image(name, max(count, 1))

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        text = ctx.read_optional(state, "prompt_text", TextEmbeddings)
        refs = references(state.request)
        if not refs:
            assert text is not None, "the text encoder runs for every request without a reference image"
            ctx.write(state, "text", text)
            return
        knobs: ReduxParams = state.node_params.get(ctx.node) or ReduxParams()
        tokens = redux_tokens(ctx, refs)  # [N, L_img, D]
        prompt, pooled = self._prompt(ctx, text, tokens.dtype)  # [1, L, D], [1, D_pool]
        n = tokens.shape[0]
        if knobs.combine == "sum":
            scale = torch.tensor(knobs.per_image("prompt_embeds_scale", n), device=tokens.device, dtype=tokens.dtype)
            pooled_scale = torch.tensor(knobs.per_image("pooled_prompt_embeds_scale", n), device=tokens.device,
                                        dtype=tokens.dtype)
            joint = torch.cat([prompt.to(tokens.dtype).expand(n, -1, -1), tokens], dim=1) * scale[:, None, None]
            seq = joint.sum(dim=0, keepdim=True)  # [1, L + L_img, D]
            pooled = (pooled.to(tokens.dtype).expand(n, -1) * pooled_scale[:, None]).sum(dim=0, keepdim=True)
        else:
            strength = knobs.per_image("strength", n)
            seq = torch.cat([prompt.to(tokens.dtype), *(tokens[i:i + 1] * s for i, s in enumerate(strength))], dim=1)
        ctx.write(state, "text", TextEmbeddings(prompt=seq, pooled=pooled, prompt_lengths=[seq.shape[1]]))

    def _prompt(self, ctx: StageContext, text: TextEmbeddings | None,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if text is not None:
            assert text.pooled is not None, "Flux's TextEncode fills the pooled field (CLIP)"
            return text.prompt, text.pooled
        cfg = ctx.component("transformer").config
        length = ctx.defaults.max_sequence_length or 512
        return (torch.zeros(1, length, cfg.joint_attention_dim, device=ctx.device, dtype=dtype),
                torch.zeros(1, cfg.pooled_projection_dim, device=ctx.device, dtype=dtype))


def redux_tokens(ctx: StageContext, refs: Sequence[ImagePart]) -> torch.Tensor:
    """The reference images' Redux tokens ``[N, L_img, joint_dim]`` (one SigLIP call)."""
    hidden = ctx.component("image_encoder").encode([open_image_part(p) for p in refs])  # [N, L_img, hidden]
    embedder = ctx.component("image_embedder")
    return embedder(hidden.to(ctx.device)).to(ctx.device)


# -- admission -----------------------------------------------------------------------------


def redux_validator(base: Callable[[OmniRequest], OmniRequest], *, redux: bool) -> Callable[[OmniRequest], OmniRequest]:
    """A reference image (role 'reference') on a Flux text-to-image request asks for Redux:
    refused naming what to load when the model has no Redux components; otherwise checked
    (readable) and set aside while the base Flux checks run."""

    def validate(request: OmniRequest) -> OmniRequest:
        refs = references(request)
        if not refs:
            return base(request)
        if not redux:
            raise InvalidRequest("a reference image (ImagePart role 'reference'; over HTTP /v1/images/variations) "
                                 "asks for FLUX.1 Redux image variation, and this model has no Redux components",
                                 hint=REDUX_HINT + " (or pass task i2i to start from the image)", fields=("image",))
        for part in refs:
            open_image_part(part)  # unreadable -> ValueError naming the source
        rest = [p for p in request.inputs if not (isinstance(p, ImagePart) and p.role == REFERENCE_ROLE)]
        checked = base(request.model_copy(update={"inputs": rest}))
        return checked.model_copy(update={"inputs": request.inputs})

    return validate


def check_redux_components(components: Mapping[str, Any], joint_dim: int) -> bool:
    """Whether the Redux components are loaded (both or neither), their width the DiT's."""
    present = [c for c in REDUX_COMPONENTS if c in components]
    if not present:
        return False
    if len(present) != len(REDUX_COMPONENTS):
        raise ValueError(f"FLUX.1 Redux needs both {list(REDUX_COMPONENTS)}; only {present} loaded. " + REDUX_HINT)
    width = components["image_embedder"].txt_in_features
    if width != joint_dim:
        raise ValueError(f"image_embedder makes {width}-wide tokens but the transformer's joint_attention_dim is "
                         f"{joint_dim}; load the Redux embedder made for this Flux model")
    return True
