"""FLUX.2 pipeline pieces: the DenoiseLoop adapter, the schedule's empirical ``mu``, and the
reference-image encoder of edits.

Latents: the DiT reads the VAE's latents 2x2-patchified and BN-normalized,
``[B, 4C, H/16, W/16]`` (``Flux2Autoencoder.normalize_latents``); the loop keeps them in that
shape (the seed draws diffusers' noise of that shape, the sampler step is elementwise) and
the adapter turns each cell into a token (``[B, h*w, 4C]``, row-major: diffusers'
``_pack_latents``). Reference images (klein's ``image`` list) ride as extra tokens after the
noisy ones, the i-th at time coordinate ``10 + 10 i`` (diffusers ``_prepare_image_ids``);
only the noisy tokens' prediction is kept.

Reference KV cache (``Flux2KleinKVPipeline`` folders, or ``node_params['denoise']
.reference_kv``: ComfyUI's FluxKVCache): the references' keys/values are computed once when
the loop starts (``Flux2Transformer.reference_kv``: timestep 0, references attending only to
each other) and kept in the request's loop state as a forward kwarg; every step then runs the
noisy tokens alone against them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping

import numpy as np
import torch
from pydantic import Field

from omniloop.io.image import image_part_size, image_to_tensor, open_image_part
from omniloop.models.families.flux2.model import Flux2Inputs, Flux2Transformer, ReferenceKV
from omniloop.models.layers.lora import LoraPlan, lora_rows
from omniloop.pipeline.adapters import request_adapters
from omniloop.pipeline.defaults import admitted_image
from omniloop.pipeline.edges import ConditionLatents, TextEmbeddings
from omniloop.pipeline.loops.denoise import DenoiseLoop, DenoiseParams, DenoiserBase
from omniloop.pipeline.policies.cfg import COND, UNCOND, Prediction
from omniloop.pipeline.policies.shift import DynamicallyShifted, Shapes
from omniloop.pipeline.stage import ComponentStage, WorkEstimate
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import (DiffusionParams, ImagePart, InvalidRequest, LatentPart, Modality, OmniRequest,
                              TaskType)

IMAGE = "image"
REFERENCE_TIME_STEP = 10  # the i-th reference's t coordinate is 10 + 10 i
MAX_REFERENCE_AREA = 1024 * 1024  # larger references are scaled down to this area first
# How a model treats its references' keys/values: "always" cached (a Flux2KleinKVPipeline
# folder), "per_request" (klein: recomputed every step unless the request asks for the cache),
# "never" (dev: its guidance-embedding DiT has no reference cache).
ReferenceCache = Literal["always", "per_request", "never"]


# -- tokens and position ids ----------------------------------------------------------------


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[B, C, h, w] -> [B, h*w, C]: one token per latent cell (diffusers ``_pack_latents``)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h * w).permute(0, 2, 1)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[B, h*w, C] -> [B, C, h, w] (what diffusers' ``_unpack_latents_with_ids`` scatters to)."""
    b, _, c = tokens.shape
    return tokens.permute(0, 2, 1).reshape(b, c, h, w)


def grid_ids(h: int, w: int, t: int, device: torch.device) -> torch.Tensor:
    """[h*w, 4] position ids (t, row, col, 0) of a latent grid's tokens (``_prepare_latent_ids``)."""
    ids = torch.zeros(h, w, 4, dtype=torch.long, device=device)
    ids[..., 0] = t
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None, :]
    return ids.reshape(-1, 4)


def text_ids(length: int, device: torch.device) -> torch.Tensor:
    """[L, 4] position ids (0, 0, 0, l) of the text tokens (``_prepare_text_ids``)."""
    ids = torch.zeros(length, 4, dtype=torch.long, device=device)
    ids[:, 3] = torch.arange(length, device=device)
    return ids


def reference_ids(grids: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """[sum h_i w_i, 4] ids of the reference tokens, reference i at t = 10 + 10 i."""
    return torch.cat([grid_ids(h, w, REFERENCE_TIME_STEP * (i + 1), device) for i, (h, w) in enumerate(grids)])


# -- the schedule ---------------------------------------------------------------------------


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's schedule shift: fitted lines in the token count at 10 and 200 steps,
    interpolated in the step count (one line past 4300 tokens; diffusers ``compute_empirical_mu``)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    m_200 = a2 * image_seq_len + b2
    m_10 = a1 * image_seq_len + b1
    a = (m_200 - m_10) / 190.0
    b = m_200 - 200.0 * a
    return float(a * num_steps + b)


@dataclass(frozen=True)
class EmpiricalShift:
    """The loop's ``shift`` slot for FLUX.2: ``mu = empirical_mu(tokens, steps)`` over
    diffusers' sigmas ``linspace(1, 1/n, n)`` (or the request's), for a sampler configured
    with dynamic shifting; a static config takes the request's shift instead."""

    name: str = "shift"

    def sampler_kwargs(self, params: DiffusionParams, shapes: Shapes, num_steps: int, sampler: Any) -> dict[str, Any]:
        sigmas = params.sigmas if params.sigmas is not None else np.linspace(1.0, 1 / num_steps, num_steps).tolist()
        if not (isinstance(sampler, DynamicallyShifted) and sampler.use_dynamic_shifting):
            return {"shift": params.shift, "sigmas": sigmas}
        _, _, h, w = shapes[IMAGE]
        return {"mu": empirical_mu(h * w, num_steps), "sigmas": sigmas}


# -- the loop adapter -----------------------------------------------------------------------


@dataclass(frozen=True)
class Flux2Denoiser(DenoiserBase):
    """Adapts ``Flux2Transformer`` to the DenoiseLoop: one ``image`` latent modality, kept
    ``[1, 4C, h, w]`` in the loop and turned into tokens per forward. Forward kwargs:
    ``encoder_hidden_states`` [B, L_txt, D_txt]; with references, ``reference`` [B, L_ref, 4C]
    and ``reference_grids`` (each reference's (h, w): requests batch when theirs are equal,
    since a batched forward shares its position ids); with the reference cache
    (``reference_cache``), ``reference_kv`` instead (a ``ReferenceKV``: requests batch at equal
    reference token counts, whatever their grids)."""

    modalities: tuple[str, ...] = (IMAGE,)
    reference_cache: ReferenceCache = "per_request"

    def caches_references(self, knobs: Any) -> bool:
        """Whether a request's references ride as cached keys/values (else as tokens)."""
        return self.reference_cache == "always" or (self.reference_cache == "per_request"
                                                    and bool(asked_reference_kv(knobs)))

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        g = admitted_image(request, ctx.node)
        space = ctx.component("vae").latent_config
        s = space.scale_factor_spatial  # 16: the VAE's 8x, then 2x2 patches
        return {IMAGE: (1, space.latent_channels, g.height // s, g.width // s)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        text = ctx.read(state, "text", TextEmbeddings)
        out: dict[str, dict[str, Any]] = {COND: {"encoder_hidden_states": text.prompt}}
        if UNCOND in branches:
            assert text.negative is not None, "guidance is on but no negative embeddings were encoded"
            out[UNCOND] = {"encoder_hidden_states": text.negative}
        refs = ctx.read_optional(state, "condition", ReferenceLatents)
        if refs is not None:
            tokens = torch.cat([pack_latents(r) for r in refs.references], dim=1)  # [1, L_ref, 4C]
            if self.caches_references(state.node_params.get(ctx.node)):
                adapters = request_adapters(ctx, state).get("transformer")  # the request's LoRAs apply too
                with lora_rows(LoraPlan([adapters]) if adapters is not None else None):
                    cache = reference_cache(ctx.component("transformer"), tokens, refs.grids, ctx.device)
                for kwargs in out.values():  # one cache for every branch: it does not depend on the text
                    kwargs.update(reference_kv=cache)
                return out
            for kwargs in out.values():
                kwargs.update(reference=tokens, reference_grids=refs.grids)
        return out

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        x = inputs[IMAGE]  # [B, 4C, h, w]
        b, _, h, w = x.shape
        device, dtype = x.device, x.dtype
        image, ids = pack_latents(x), grid_ids(h, w, 0, device)
        grids = kwargs.get("reference_grids")
        if grids is not None:  # noisy tokens first, then every reference's (diffusers' cat order)
            image = torch.cat([image, kwargs["reference"].to(device, dtype)], dim=1)
            ids = torch.cat([ids, reference_ids(grids, device)])
        text = kwargs["encoder_hidden_states"].to(dtype)  # [B, L_txt, D_txt]
        guidance = kwargs.get("guidance")
        cache: ReferenceKV | None = kwargs.get("reference_kv")
        out = model(Flux2Inputs(
            image=image, text=text, timestep=timestep.expand(b) / 1000,  # diffusers passes t / 1000
            image_ids=ids, text_ids=text_ids(text.shape[1], device),
            guidance=guidance.to(device) if guidance is not None else None,
            reference_kv=cache.to(dtype) if cache is not None else None,
        ))  # [B, L_img, 4C]
        return {IMAGE: unpack_latents(out[:, :h * w], h, w)}

    # -- analytic costs (the engine's cost model and token budget) ---------------------
    def _dims(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, Any]:
        _, _, h, w = shapes[IMAGE]
        return h * w, ctx.defaults.max_sequence_length or 512, ctx.component("transformer").config

    def tokens_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        img, txt, _ = self._dims(ctx, shapes)
        return img + txt

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs (2 per multiply-add): double blocks (per-stream q/k/v/out and a SwiGLU
        MLP of 3 x mlp_hidden x D per token, joint attention), single blocks (fused
        q/k/v + MLP-in, joint attention, fused out), without reference tokens."""
        img, txt, cfg = self._dims(ctx, shapes)
        n, d, m = img + txt, cfg.inner_dim, cfg.mlp_hidden_dim
        attention = 2 * n * n * d
        double = n * (4 * d * d + 3 * m * d) + attention
        single = n * (3 * d * d + 2 * m * d + (d + m) * d) + attention
        return float(2 * (cfg.num_layers * double + cfg.num_single_layers * single))

    def activation_bytes(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        """Peak transient memory of one forward: a single block's fused projection (3D + 2
        mlp_hidden) and the attention output per token, plus fp32 RoPE tables."""
        img, txt, cfg = self._dims(ctx, shapes)
        itemsize = torch.finfo(ctx.dtype).bits // 8
        width = 4 * cfg.inner_dim + 2 * cfg.mlp_hidden_dim
        return int((img + txt) * (width * itemsize + 2 * cfg.attention_head_dim * 4))


# -- the reference KV cache --------------------------------------------------------------------


@torch.no_grad()
def reference_cache(model: Flux2Transformer, tokens: torch.Tensor, grids: tuple[tuple[int, int], ...],
                    device: torch.device) -> ReferenceKV:
    """One request's references [1, L_ref, 4C] -> every block's keys/values, computed once
    (diffusers' first-step ``extract``; the same rows, without the text and noisy tokens)."""
    return model.reference_kv(tokens.to(device, model.dtype), reference_ids(grids, device))


class Flux2DenoiseParams(DenoiseParams):
    """``node_params['denoise']`` of FLUX.2: the denoise loop's knobs and the reference cache."""

    reference_kv: bool | None = Field(
        default=None, description="cache the reference images' keys/values once and reuse them every step "
        "(FLUX.2 [klein] KV: references at timestep 0, attending only to each other; ComfyUI's FluxKVCache). "
        "Always on for a Flux2KleinKVPipeline folder; off by default for klein")

    flat: ClassVar[Mapping[str, str]] = {**DenoiseParams.flat, "reference_kv": "reference_kv"}


def asked_reference_kv(knobs: Any) -> bool | None:
    """What a request's ``node_params['denoise']`` says of the reference cache (None: nothing)."""
    return knobs.reference_kv if isinstance(knobs, Flux2DenoiseParams) else None


@dataclass
class Flux2DenoiseLoop(DenoiseLoop):
    """The DenoiseLoop with FLUX.2's knobs: a request turns the reference cache on or off
    where the model allows it (refused, naming the field, where it does not)."""

    params_schema = Flux2DenoiseParams

    def estimate(self, ctx: StageContext, state: RequestState) -> WorkEstimate:
        """The loop's estimate, with the reference cache it holds while it runs: (k, v) of
        every block for every reference token (each 1024^2 reference: 4096 tokens)."""
        est = super().estimate(ctx, state)
        if not (isinstance(self.denoiser, Flux2Denoiser) and state.request.task == TaskType.I2I
                and self.denoiser.caches_references(state.node_params.get(ctx.node))):
            return est
        cfg = ctx.component("transformer").config
        tokens = reference_tokens(state.request, ctx.component("vae").latent_config.scale_factor_spatial)
        layers = cfg.num_layers + cfg.num_single_layers
        kv = 2 * layers * tokens * cfg.inner_dim * (torch.finfo(ctx.dtype).bits // 8)
        return dataclasses.replace(est, loop_bytes=est.loop_bytes + kv)

    def check_request(self, ctx: StageContext, state: RequestState, produced: frozenset[str]) -> None:
        super().check_request(ctx, state, produced)
        asked = asked_reference_kv(state.node_params.get(ctx.node))
        mode = self.denoiser.reference_cache if isinstance(self.denoiser, Flux2Denoiser) else "never"
        field = f"node_params[{ctx.node!r}].reference_kv"
        if asked and mode == "never":
            raise InvalidRequest(f"{field}: FLUX.2 [dev] has no reference KV cache (only FLUX.2 [klein] does)",
                                 hint="drop reference_kv", fields=(field,))
        if asked is False and mode == "always":
            raise InvalidRequest(f"{field}=false: this Flux2KleinKVPipeline model always caches its references' "
                                 "keys/values (it was trained with them at timestep 0)",
                                 hint="drop reference_kv, or serve a Flux2KleinPipeline model", fields=(field,))


# -- reference images (edits) ---------------------------------------------------------------


@dataclass(kw_only=True)
class ReferenceLatents(ConditionLatents):
    """The request's reference images in the DiT's latent space: ``references`` each
    [1, 4C, h_i, w_i]; ``latents`` is the first (the ConditionLatents contract)."""

    references: tuple[torch.Tensor, ...] = field(default_factory=tuple)

    @property
    def grids(self) -> tuple[tuple[int, int], ...]:
        return tuple((int(r.shape[-2]), int(r.shape[-1])) for r in self.references)


def reference_parts(request: OmniRequest) -> list[ImagePart | LatentPart]:
    """The request's references in order: its images (no mask role) and image latents."""
    return [p for p in request.inputs
            if (isinstance(p, ImagePart) and p.role != "mask") or (isinstance(p, LatentPart) and p.of is Modality.IMAGE)]


def reference_tokens(request: OmniRequest, multiple: int) -> int:
    """The DiT tokens of all of a (validated) edit's references: one per ``multiple``-pixel cell."""
    total = 0
    for part in reference_parts(request):
        if isinstance(part, LatentPart):
            shape = torch.as_tensor(part.data).shape
            total += int(shape[-2] * shape[-1])
        else:
            w, h = reference_size(*image_part_size(part), multiple)
            total += (w // multiple) * (h // multiple)
    return total


def reference_size(width: int, height: int, multiple: int) -> tuple[int, int]:
    """(width, height) a reference is encoded at: scaled to 1024^2 pixels when larger (the
    ``int`` of the scaled sides), then floored to ``multiple`` (Flux2KleinPipeline)."""
    if width * height > MAX_REFERENCE_AREA:
        scale = (MAX_REFERENCE_AREA / (width * height)) ** 0.5
        width, height = int(width * scale), int(height * scale)
    return width // multiple * multiple, height // multiple * multiple


def reference_pixels(part: ImagePart, multiple: int) -> torch.Tensor:
    """A reference image -> [1, 3, H, W] in [-1, 1]: scaled down past 1024^2 pixels (Lanczos),
    then center-cropped to multiples of ``multiple`` (``Flux2ImageProcessor``'s crop mode)."""
    from PIL import Image

    picture = open_image_part(part).convert("RGB")
    width, height = picture.size
    if width * height > MAX_REFERENCE_AREA:
        scale = (MAX_REFERENCE_AREA / (width * height)) ** 0.5
        picture = picture.resize((int(width * scale), int(height * scale)), Image.Resampling.LANCZOS)
    w, h = reference_size(picture.size[0], picture.size[1], multiple)
    left, top = (picture.size[0] - w) // 2, (picture.size[1] - h) // 2
    return image_to_tensor(picture.crop((left, top, left + w, top + h)), h, w)


@dataclass
class Flux2References(ComponentStage):
    """Reference images -> ReferenceLatents: each VAE-encoded to its posterior's mode
    (diffusers' ``sample_mode='argmax'``: no draw) and normalized; given latents
    ([1, 4C, h, w], the DiT's space) pass through."""

    component: str = "vae"
    outputs = {"condition": ReferenceLatents}

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        multiple = vae.latent_config.scale_factor_spatial
        refs = []
        for part in reference_parts(state.request):
            if isinstance(part, LatentPart):
                data = torch.as_tensor(part.data).to(ctx.device, torch.float32)
                refs.append(data.reshape(1, *data.shape[-3:]))
                continue
            # channels-last as diffusers' processor hands it (numpy HWC -> CHW view): the same conv path
            image = reference_pixels(part, multiple).to(ctx.device).contiguous(memory_format=torch.channels_last)
            refs.append(vae.normalize_latents(vae.encode(image).mean).float())
        assert refs, "admission guarantees an edit request carries a reference"
        ctx.write(state, "condition", ReferenceLatents(latents=refs[0], references=tuple(refs)))
