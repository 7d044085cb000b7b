"""Stable Audio pipeline pieces: prompt + seconds conditioning, the DenoiseLoop adapter,
and the waveform decode (diffusers' ``StableAudioPipeline``, stage by stage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from omniloop.pipeline.edges import DenoisedLatents, TextEmbeddings
from omniloop.pipeline.loops.denoise import DenoiserBase
from omniloop.pipeline.policies.cfg import COND, UNCOND, Prediction, loops_guide
from omniloop.pipeline.stage import ComponentStage, StageBase
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import AudioArtifact, OmniRequest


@dataclass(frozen=True)
class AudioSpan:
    """The seconds a request asks for: conditioning values and the crop of the waveform."""

    start_s: float
    end_s: float

    def samples(self, sample_rate: int) -> slice:
        return slice(int(self.start_s * sample_rate), int(self.end_s * sample_rate))


def max_seconds(dit: Any, vae: Any) -> float:
    """The model's longest clip: the DiT's fixed latent length (``sample_size``) times the
    VAE hop, in seconds (``dit`` / ``vae``: the components' configs)."""
    return dit.sample_size * vae.hop_length / vae.sampling_rate


def audio_span(request: OmniRequest, ctx: StageContext) -> AudioSpan:
    duration = request.diffusion.duration_s
    longest = max_seconds(ctx.component("transformer").config, ctx.component("vae").config)
    return AudioSpan(0.0, float(duration) if duration is not None else longest)


@dataclass(kw_only=True)
class StableAudioConditioning(TextEmbeddings):
    """``prompt`` / ``negative``: [1, Lt + 2, D] projected T5 states then the start and end
    seconds tokens (the uncond branch: the negative prompt's, or all zeros without one);
    ``global_states``: [1, 1, 2 D] start ++ end seconds, shared by both branches."""

    global_states: torch.Tensor


@dataclass
class StableAudioEncode(StageBase):
    """Prompts (and negative prompts when guidance needs them) through T5 and the projection
    model, plus the seconds tokens -> StableAudioConditioning."""

    text_encoder: str = "text_encoder"
    projection: str = "projection_model"
    outputs = {"text": StableAudioConditioning}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.text_encoder, self.projection)

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        self.forward_many(ctx, [state])

    @torch.inference_mode()
    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        """One T5 call for every request's prompts; nothing is written before it succeeded."""
        encoder, projection = ctx.component(self.text_encoder), ctx.component(self.projection)
        wanted = [self._prompts(ctx, s) for s in states]
        encoded = encoder.encode([p for prompts in wanted for p in prompts], device=ctx.device)
        lengths = torch.tensor(encoded.lengths, device=ctx.device)
        mask = (torch.arange(encoded.embeds.shape[1], device=ctx.device)[None] < lengths[:, None])  # [N, L]
        mask = mask.unsqueeze(-1).to(projection_dtype(projection))
        text = projection.project_text(encoded.embeds.to(projection_dtype(projection))) * mask  # [N, L, D]
        outs, row = [], 0
        for state, prompts in zip(states, wanted):
            span = audio_span(state.request, ctx)
            start, end = projection.seconds(torch.tensor([span.start_s], device=ctx.device),
                                            torch.tensor([span.end_s], device=ctx.device))  # [1, 1, D] each
            cond = torch.cat([text[row:row + 1], start, end], dim=1)
            negative = None
            if len(prompts) == 2:
                negative = torch.cat([text[row + 1:row + 2], start, end], dim=1)
            elif self._guided(ctx, state):  # no negative prompt: diffusers' uncond is all zeros
                negative = torch.zeros_like(cond)
            outs.append(StableAudioConditioning(prompt=cond, negative=negative, prompt_lengths=encoded.lengths[row:row + 1],
                                                global_states=torch.cat([start, end], dim=2)))
            row += len(prompts)
        for state, out in zip(states, outs):
            ctx.write(state, "text", out)

    @staticmethod
    def _guided(ctx: StageContext, state: RequestState) -> bool:
        """A loop's resolved CFG scale exceeds 1 (no negative prompt given: the uncond branch
        reads zeros, diffusers' StableAudioPipeline; the model's default is none)."""
        return loops_guide(state.node_params)

    def _prompts(self, ctx: StageContext, state: RequestState) -> list[str]:
        """[prompt], or [prompt, negative prompt] when guided with a negative prompt given."""
        prompts = [state.request.prompt or ""]
        negative = state.request.diffusion.negative_prompt
        if self._guided(ctx, state) and negative is not None:
            prompts.append(negative)
        return prompts


def projection_dtype(projection: torch.nn.Module) -> torch.dtype:
    return next(projection.parameters()).dtype


@dataclass(frozen=True)
class StableAudioDenoiser(DenoiserBase):
    """Adapts ``StableAudioDiT.forward`` to the DenoiseLoop: one ``audio`` latent modality of a
    fixed length (``sample_size``), so every request batches with every other."""

    modalities: tuple[str, ...] = ("audio",)

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        dit = ctx.component("transformer").config  # a fixed latent length: the DiT's
        return {"audio": (1, dit.in_channels, dit.sample_size)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        cond = ctx.read(state, "text", StableAudioConditioning)
        out = {COND: {"encoder_hidden_states": cond.prompt, "global_hidden_states": cond.global_states}}
        if UNCOND in branches:
            assert cond.negative is not None, "guidance is on but no unconditional states were encoded"
            out[UNCOND] = {"encoder_hidden_states": cond.negative, "global_hidden_states": cond.global_states}
        return out

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        return {"audio": model(inputs["audio"], timestep, **kwargs)}

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs of one DiT forward: self-attention (projections and scores), cross
        attention to the text tokens, the SwiGLU FFN (2 per multiply-add)."""
        c = ctx.component("transformer").config
        L, D, Lt = shapes["audio"][-1] + 1, c.inner_dim, (ctx.defaults.max_sequence_length or 128) + 2
        kv = c.num_key_value_attention_heads * c.attention_head_dim
        self_attn = 4 * L * D * D + 2 * L * L * D
        cross = 2 * L * D * D + 2 * 2 * Lt * c.cross_attention_dim * kv + 2 * L * Lt * D
        ffn = 3 * L * D * 4 * D
        return float(2 * c.num_layers * (self_attn + cross + ffn))


@dataclass
class StableAudioDecode(ComponentStage):
    """Denoised latents -> the Oobleck waveform, cropped to the request's seconds."""

    component: str = "vae"
    inputs = {"latents": DenoisedLatents}
    outputs = {"audio": AudioArtifact}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        latents = ctx.read(state, "latents", DenoisedLatents).latents["audio"]
        rate = int(vae.config.sampling_rate)
        waveform = vae.decode(latents)[0]  # [channels, S]
        crop = waveform[:, audio_span(state.request, ctx).samples(rate)]
        ctx.write(state, "audio", AudioArtifact(samples=crop.float().cpu(), sample_rate=rate))
