"""Flux-specific pipeline pieces: the DenoiseLoop adapter (packs requests of any sizes into
one forward) and the image-to-image condition encoder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omniloop.io.image import image_to_tensor, open_image_part
from omniloop.models.families.flux.model import FluxInputs
from omniloop.models.layers.cuda_graphs import CudaGraphRunner
from omniloop.models.layers.lora import LoraPlan, current_plan, lora_rows
from omniloop.models.layers.packed import Segments, joint_segments
from omniloop.pipeline.loops.denoise import DenoiserBase
from omniloop.pipeline.edges import ConditionLatents, LatentPosterior, TextEmbeddings
from omniloop.pipeline.policies.cfg import COND, Prediction
from omniloop.pipeline.stage import ComponentStage
from omniloop.pipeline.defaults import admitted_image
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import ImagePart, LatentPart, Modality, OmniRequest

IMAGE = "image"


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """[C, h, w] -> [(h/2)(w/2), 4C]: 2x2 patches as tokens (diffusers ``_pack_latents``)."""
    c, h, w = x.shape
    return x.view(c, h // 2, 2, w // 2, 2).permute(1, 3, 0, 2, 4).reshape((h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[(h/2)(w/2), 4C] -> [C, h, w] (diffusers ``_unpack_latents``)."""
    c = tokens.shape[1] // 4
    return tokens.view(h // 2, w // 2, c, 2, 2).permute(2, 0, 3, 1, 4).reshape(c, h, w)


def image_ids(h: int, w: int, device: torch.device) -> torch.Tensor:
    """[(h/2)(w/2), 3] position ids (0, row, col) of a latent's packed tokens."""
    ids = torch.zeros(h // 2, w // 2, 3, device=device)
    ids[..., 1] += torch.arange(h // 2, device=device)[:, None]
    ids[..., 2] += torch.arange(w // 2, device=device)[None, :]
    return ids.reshape(-1, 3)


# one sample of a packed forward: its noisy latent [C, h, w], its timestep (0-d), its call's kwargs, its row there
Row = tuple[torch.Tensor, torch.Tensor, dict[str, Any], int]


@dataclass(frozen=True)
class FluxDenoiser(DenoiserBase):
    """Adapts ``FluxTransformer`` to the DenoiseLoop: one ``image`` latent modality, kept
    unpacked ``[1, C, h, w]`` in the loop (so the seed draws diffusers' noise and the
    sampler step is the same elementwise update) and packed into tokens per forward.

    ``graphs``: the deployment's CUDA-graph runner (``cuda_graphs=True``): forwards without
    LoRA up to its token threshold replay a graph captured per packed signature."""

    modalities: tuple[str, ...] = (IMAGE,)
    packs: bool = True
    graphs: CudaGraphRunner | None = None

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        g = admitted_image(request, ctx.node)
        vae = ctx.component("vae").config  # the latent grid is the VAE's
        s = vae.scale_factor_spatial
        return {IMAGE: (1, vae.latent_channels, g.height // s, g.width // s)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        text = ctx.read(state, "text", TextEmbeddings)
        assert text.pooled is not None, "Flux's TextEncode fills the pooled field (CLIP)"
        return {COND: {"encoder_hidden_states": text.prompt, "pooled_projections": text.pooled}}

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        return self.forward_packed(model, [inputs], [timestep], [kwargs])[0]

    def forward_packed(self, model: torch.nn.Module, xs: list[dict[str, torch.Tensor]], ts: list[torch.Tensor],
                       kws: list[dict[str, Any]]) -> list[Prediction]:
        """Calls of any latent sizes (each [b_i, C, h_i, w_i]) as ONE packed forward: every
        sample's image tokens and text tokens end to end, attention within each sample."""
        rows = [(x[IMAGE][r], t[r], kw, r) for x, t, kw in zip(xs, ts, kws) for r in range(x[IMAGE].shape[0])]
        device = rows[0][0].device
        image, ids = self.sample_tokens(rows)
        text = [kw["encoder_hidden_states"][r] for _, _, kw, r in rows]  # each [L_txt, D]
        guidance = [kw["guidance"][r] for _, _, kw, r in rows] if "guidance" in kws[0] else None
        inputs = FluxInputs(
            image=torch.cat(image),
            text=torch.cat(text),
            pooled=torch.stack([kw["pooled_projections"][r] for _, _, kw, r in rows]),
            timestep=torch.stack([t for _, t, *_ in rows]) / 1000,  # diffusers passes t / 1000
            image_ids=torch.cat(ids),
            text_ids=torch.zeros(sum(t.shape[0] for t in text), 3, device=device),
            image_segments=Segments(tuple(t.shape[0] for t in image)),
            text_segments=Segments(tuple(t.shape[0] for t in text)),
            guidance=torch.stack(guidance).to(device) if guidance is not None else None,
        )
        plan = _bound(current_plan(), inputs)
        if plan is None and self.graphs is not None:
            out = graphed_forward(self.graphs, model, inputs)  # [N_img (+ N_ref), 4C]
        else:
            with lora_rows(plan):  # each sample's LoRAs on its own tokens
                out = model(inputs)  # [N_img (+ N_ref), 4C]
        preds = []
        for tok, (noisy, *_) in zip(inputs.image_segments.split(out), rows):
            h, w = noisy.shape[1], noisy.shape[2]
            preds.append(unpack_latents(tok[:(h // 2) * (w // 2)], h, w))  # the noisy tokens' prediction
        result, i = [], 0
        for x in xs:
            b = x[IMAGE].shape[0]
            result.append({IMAGE: torch.stack(preds[i:i + b])})
            i += b
        return result

    def sample_tokens(self, rows: list[Row]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per sample row: its image tokens [N_i, 4C] and their (0, row, col) ids [N_i, 3], the
        noisy latent's first (a subclass appends a condition's tokens after them: Kontext)."""
        device = rows[0][0].device
        return [pack_latents(x) for x, *_ in rows], [image_ids(x.shape[1], x.shape[2], device) for x, *_ in rows]

    # -- analytic costs (the engine's cost model and token budget) ---------------------
    def _dims(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> tuple[int, int, Any]:
        """(image tokens, text tokens, config): the image tokens of every [1, C, h, w] latent the
        forward packs, the noisy ``image`` and any condition riding beside it (Kontext's reference)."""
        img = sum((h // 2) * (w // 2) for *_, h, w in shapes.values())
        return img, ctx.defaults.max_sequence_length or 512, ctx.component("transformer").config

    def tokens_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        img, txt, _ = self._dims(ctx, shapes)
        return img + txt

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs (2 per multiply-add): double blocks (per-stream qkv/out/MLP, joint
        attention), single blocks (qkv + MLP-in, joint attention, out over D + 4D)."""
        img, txt, cfg = self._dims(ctx, shapes)
        n, d = img + txt, cfg.inner_dim
        attention = 2 * n * n * d
        double = n * (4 * d * d + 8 * d * d) + attention
        single = n * (3 * d * d + 4 * d * d + 5 * d * d) + attention
        return float(2 * (cfg.num_layers * double + cfg.num_single_layers * single))

    def activation_bytes(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> int:
        """Peak transient memory of one forward: a single block's MLP input (4D) and the
        joint q/k/v/attention/residual (~8D) per token, plus fp32 RoPE tables."""
        img, txt, cfg = self._dims(ctx, shapes)
        itemsize = torch.finfo(ctx.dtype).bits // 8
        return int((img + txt) * (12 * cfg.inner_dim * itemsize + 2 * cfg.attention_head_dim * 4))


_TENSORS = ("image", "text", "pooled", "timestep", "image_ids", "text_ids", "guidance")


def graphed_forward(runner: CudaGraphRunner, model: torch.nn.Module, inputs: FluxInputs) -> torch.Tensor:
    """``model(inputs)`` through ``runner``: keyed by the packed layout (each sample's image
    and text token counts, hence the batch rows) and the tensors' shapes and dtypes (guidance
    present or not). NOTE steps with LoRAs never come here: the per-row plan (which rows,
    which adapters, their gather indices built on the CPU) changes with the batch's
    composition and is applied outside any captured state, so LoRA steps stay eager."""
    tensors = {name: getattr(inputs, name) for name in _TENSORS if getattr(inputs, name) is not None}
    img, txt = inputs.image_segments, inputs.text_segments

    def forward(t):  # captured once per key; img/txt keep the device index tensors the graph reads
        return model(FluxInputs(**t, image_segments=img, text_segments=txt))

    return runner.run(forward, tensors, structure=(id(model), img.lengths, txt.lengths), tokens=img.total + txt.total)


def _bound(plan: LoraPlan | None, inputs: FluxInputs) -> LoraPlan | None:
    """The loop's per-sample LoRA plan with each token stream's owners (packed layout)."""
    if plan is None:
        return None
    img, txt = inputs.image_segments, inputs.text_segments
    return plan.bind(image=img.owners(), text=txt.owners(), joint=joint_segments(txt, img).owners(),
                     sample=torch.arange(img.count))  # CPU: the plan builds its gather indices there


# -- image-to-image conditioning --------------------------------------------------------


def edit_source(request: OmniRequest) -> ImagePart | LatentPart | None:
    """The image (or its latents) an i2i request starts from."""
    latents = [p for p in request.inputs if isinstance(p, LatentPart) and p.of is Modality.IMAGE]
    return latents[0] if latents else next((p for p in request.images() if p.role not in ("mask", "control")), None)


def given_condition(source: LatentPart, device: torch.device) -> ConditionLatents:
    """Latents a request gives for its image ([C, h, w] or [1, C, h, w], the DiT's normalized
    space) as the condition, unchanged: [1, C, h, w] fp32 on ``device``."""
    latents = torch.as_tensor(source.data).to(device, torch.float32)
    return ConditionLatents(latents=latents.reshape(1, *latents.shape[-3:]))


@dataclass
class FluxImageCondition(ComponentStage):
    """Image-to-image: the starting image -> ConditionLatents. Given latents ([1, C, h, w],
    the DiT's normalized space) pass through; an image is VAE-encoded to its posterior,
    sampled by the loop from the request's seed (diffusers' draw order)."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ctx.write(state, "condition", self.condition(ctx, state))

    def condition(self, ctx: StageContext, state: RequestState) -> ConditionLatents:
        source = edit_source(state.request)
        assert source is not None, "admission guarantees an i2i request carries an image or image latents"
        if isinstance(source, LatentPart):
            return given_condition(source, ctx.device)
        vae = ctx.component(self.component)
        g = admitted_image(state.request, ctx.node)
        image = image_to_tensor(open_image_part(source), g.height, g.width).to(ctx.device)  # [1, 3, H, W]
        # NOTE: diffusers' VaeImageProcessor hands the VAE a channels-last view of the decoded
        # image, and oneDNN's convs take another (differently rounded) path on that layout; the
        # same layout keeps the encode bit-equal (and is the fast layout for GPU convs).
        image = image.contiguous(memory_format=torch.channels_last)
        moments = vae.encode(image)
        cfg = vae.config
        posterior = LatentPosterior(mean=moments.mean, std=moments.std, shift=cfg.shift_factor or 0.0,
                                    scale=cfg.scaling_factor)
        return ConditionLatents(latents=vae.normalize_latents(moments.mean), posterior=posterior)
