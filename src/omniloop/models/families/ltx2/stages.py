"""LTX-2 pipeline pieces (diffusers ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline`` /
``LTX2LatentUpsamplePipeline``, stage by stage): prompt -> Gemma layer states -> connectors;
the DenoiseLoop adapter over packed video and audio tokens; the I2V first-frame condition;
the latent upsampler between the base and refine loops; video decode; audio decode + vocoder.

Latent layout inside the loops (diffusers'): video ``[1, F*H*W, C]`` (latent frames x height x
width tokens), audio ``[1, La, C_a * M]`` (latent audio frames, channels x mel bins packed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.io.image import h264_recompress, image_to_tensor
from omniloop.pipeline.defaults import GenerationDefaults, admitted
from omniloop.pipeline.edges import ConditionLatents, DenoisedLatents, InitLatents, TextEmbeddings
from omniloop.pipeline.loops.denoise import DenoiserBase
from omniloop.pipeline.policies.cfg import Prediction, loops_guide
from omniloop.pipeline.stage import ComponentStage, StageBase
from omniloop.pipeline.stages.decode import to_uint8_frames
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import AudioArtifact, ImagePart, Modality, OmniRequest, TextArtifact, VideoArtifact, VideoPart
from omniloop.models.families.ltx2.guides import (
    LTX2FrameConditions,
    LTX2Keyframe,
    appended_count,
    cover_pixels,
    frame_conditions,
    guide_video,
    keyframe_coords,
    uses_guides,
)
from omniloop.models.families.ltx2.model import Guidance
from omniloop.models.families.ltx2.presets import LTX2Defaults

MODALITIES = ("video", "audio")


# -- geometry -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LTX2Geometry:
    height: int
    width: int
    num_frames: int
    fps: int
    frames: int  # latent frames
    rows: int  # latent height
    cols: int  # latent width
    audio_frames: int  # latent audio frames

    @property
    def tokens(self) -> int:
        return self.frames * self.rows * self.cols


def geometry(request: OmniRequest, vae: Any, audio_vae: Any, scale: int = 1, node: str = "admission") -> LTX2Geometry:
    """The resolved request's video and audio latent grid (admission filled in the model's
    defaults: ``resolve_request``); ``vae`` / ``audio_vae``: the components' configs (their
    compression ratios, sample rate, hop); ``scale``: the latent upsampler's spatial factor
    (the refine stage denoises at ``scale`` x the base resolution)."""
    p = request.diffusion
    height, width = admitted(p.height, "height", node), admitted(p.width, "width", node)
    frames, fps = admitted(p.num_frames, "num_frames", node), admitted(p.fps, "fps", node)
    duration = frames / float(fps)
    # diffusers: round(duration * sampling_rate / hop / 4) latent audio frames (Python's round)
    audio = round(duration * (audio_vae.sample_rate / audio_vae.mel_hop_length / float(audio_vae.temporal_ratio)))
    return LTX2Geometry(height * scale, width * scale, frames, fps, (frames - 1) // vae.temporal_ratio + 1,
                        height // vae.spatial_ratio * scale, width // vae.spatial_ratio * scale, audio)


def geometry_in(ctx: StageContext, request: OmniRequest, scale: int = 1) -> LTX2Geometry:
    """``geometry`` with the loaded VAEs."""
    return geometry(request, ctx.component("vae").config, ctx.component("audio_vae").config, scale, ctx.node)


def upsample_scale(upsampler: Any) -> int:
    """The latent upsampler's spatial factor (2 without one: the refine stage's default)."""
    if upsampler is None:
        return 2
    c = upsampler.config
    scale = c.rational_spatial_scale if c.use_rational_resampler and not c.temporal_upsample else 2
    if not float(scale).is_integer() or not c.spatial_upsample or c.temporal_upsample:
        raise ValueError(f"latent_upsampler/: spatial x{scale}, temporal {c.temporal_upsample}; the refine stage "
                         "supports integer spatial upsampling only")
    return int(scale)


def pack_video(x: torch.Tensor) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, F*H*W, C] (patch size 1)."""
    return x.permute(0, 2, 3, 4, 1).flatten(1, 3)


def unpack_video(x: torch.Tensor, g: LTX2Geometry) -> torch.Tensor:
    b = x.size(0)
    return x.reshape(b, g.frames, g.rows, g.cols, -1, 1, 1, 1).permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(
        4, 5).flatten(2, 3)


def pack_audio(x: torch.Tensor) -> torch.Tensor:
    """[B, C, L, M] -> [B, L, C*M]."""
    return x.transpose(1, 2).flatten(2, 3)


def unpack_audio(x: torch.Tensor, mel: int) -> torch.Tensor:
    return x.unflatten(2, (-1, mel)).transpose(1, 2)


def normalize_audio(x: torch.Tensor, audio_vae: Any) -> torch.Tensor:
    return (x - audio_vae.latents_mean.to(x.device, x.dtype)) / audio_vae.latents_std.to(x.device, x.dtype)


def denormalize_audio(x: torch.Tensor, audio_vae: Any) -> torch.Tensor:
    return (x * audio_vae.latents_std.to(x.device, x.dtype)) + audio_vae.latents_mean.to(x.device, x.dtype)


# -- guidance scales ------------------------------------------------------------------------


@dataclass(frozen=True)
class GuidanceScales:
    """Per modality: CFG scale, STG scale, modality-isolation scale, rescale."""

    cfg: Mapping[str, float]
    stg: Mapping[str, float]
    modality: Mapping[str, float]
    rescale: Mapping[str, float]
    stg_blocks: tuple[int, ...]

    @property
    def uses_text_cfg(self) -> bool:
        return any(s > 1.0 for s in self.cfg.values())

    @property
    def uses_stg(self) -> bool:
        return any(s > 0.0 for s in self.stg.values())

    @property
    def uses_modality(self) -> bool:
        return any(s > 1.0 for s in self.modality.values())


def _per_modality(value: Any, default: Mapping[str, float]) -> dict[str, float]:
    """A number for both modalities or one per modality (the request's ``guidance_scale``)."""
    if value is None:
        return dict(default)
    if isinstance(value, Mapping):
        return {m: float(value.get(Modality(m), value.get(m, default[m]))) for m in MODALITIES}
    return {m: float(value) for m in MODALITIES}


def _per_stream(value: Any, audio: Any, default: Mapping[str, float]) -> dict[str, float]:
    """diffusers' pair of knobs (``stg_scale`` / ``audio_stg_scale``): a number is the video
    stream's (a mapping: per modality), ``audio`` the audio stream's; unset ones the default."""
    out = dict(default)
    if isinstance(value, Mapping):
        out = _per_modality(value, default)
    elif value is not None:
        out["video"] = float(value)
    if audio is not None:
        out["audio"] = float(audio)
    return out


def guidance_scales(d: LTX2Defaults, request_cfg: Any = None, overrides: Mapping[str, Any] | None = None
                    ) -> GuidanceScales:
    """The node's defaults, the request's CFG scale (``diffusion.guidance_scale``: a number
    for both modalities or one per modality) and the node's knobs (``LTX2DenoiseParams``:
    ``stg_scale`` / ``audio_stg_scale`` ..., diffusers' names and meanings), in that order."""
    o = overrides or {}
    cfg = _per_modality(request_cfg, d.guidance_scale)
    cfg = _per_modality(o.get("guidance_scale"), cfg)
    if o.get("audio_guidance_scale") is not None:
        cfg["audio"] = float(o["audio_guidance_scale"])
    stg_blocks = o.get("stg_blocks")
    return GuidanceScales(cfg=cfg, stg=_per_stream(o.get("stg_scale"), o.get("audio_stg_scale"), d.stg_scale),
                          modality=_per_stream(o.get("modality_scale"), o.get("audio_modality_scale"), d.modality_scale),
                          rescale=_per_stream(o.get("guidance_rescale"), o.get("audio_guidance_rescale"),
                                              d.guidance_rescale),
                          stg_blocks=tuple(stg_blocks if stg_blocks is not None else d.stg_blocks or ()))


# -- text ----------------------------------------------------------------------------------


@dataclass(kw_only=True)
class LTX2TextStates(TextEmbeddings):
    """Connector outputs: ``prompt`` / ``negative`` feed the video stream, ``audio_prompt`` /
    ``audio_negative`` the audio stream; masks [1, L] (1 = attend)."""

    audio_prompt: torch.Tensor
    audio_negative: torch.Tensor | None = None
    mask: torch.Tensor
    negative_mask: torch.Tensor | None = None


@dataclass
class LTX2TextEncode(StageBase):
    """Prompts (and the negative prompt when text CFG is on) -> Gemma layer states ->
    connectors, one call of each for every grouped request's prompts."""

    text_encoder: str = "text_encoder"
    connectors: str = "connectors"
    optional_inputs = {"enhanced_prompt": TextArtifact}  # the enhance_prompt node's rewrite of the prompt
    outputs = {"text": LTX2TextStates}

    @property
    def components(self) -> tuple[str, ...]:
        return (self.text_encoder, self.connectors)

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        self.forward_many(ctx, [state])

    @torch.inference_mode()
    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        encoder, connectors = ctx.component(self.text_encoder), ctx.component(self.connectors)
        wanted = [self._prompts(ctx, s) for s in states]
        layers = encoder.encode([p for prompts in wanted for p in prompts], device=ctx.device)
        video, audio, mask = connectors(layers.states.to(next(connectors.parameters()).dtype), layers.mask,
                                        padding_side=encoder.tokenizer.padding_side)
        outs, row = [], 0
        for prompts in wanted:
            cond, neg = slice(row, row + 1), slice(row + 1, row + 2)
            guided = len(prompts) == 2
            outs.append(LTX2TextStates(prompt=video[cond], audio_prompt=audio[cond], mask=mask[cond],
                                       negative=video[neg] if guided else None,
                                       audio_negative=audio[neg] if guided else None,
                                       negative_mask=mask[neg] if guided else None,
                                       prompt_lengths=[int(layers.mask[row].sum())]))
            row += len(prompts)
        for state, out in zip(states, outs):
            ctx.write(state, "text", out)

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission (after the loops resolved their guidance): the negative prompt, when a loop
        guides with text CFG and the request gives none (or an empty one), is the node's default."""
        if loops_guide(state.node_params) and not state.request.diffusion.negative_prompt:
            state.resolve_diffusion(negative_prompt=defaults.negative_prompt)

    @staticmethod
    def _prompts(ctx: StageContext, state: RequestState) -> list[str]:
        """[prompt] (the enhanced one when the enhance_prompt node ran), and the negative prompt
        when a loop's resolved CFG scale exceeds 1."""
        enhanced = ctx.read_optional(state, "enhanced_prompt", TextArtifact)
        prompts = [enhanced.text if enhanced is not None else state.request.prompt or ""]
        if loops_guide(state.node_params):
            prompts.append(admitted(state.request.diffusion.negative_prompt, "negative_prompt", ctx.node))
        return prompts


# -- the denoise adapter ------------------------------------------------------------------


@dataclass(frozen=True)
class LTX2Denoiser(DenoiserBase):
    """Adapts ``LTX2DiT.forward`` to the DenoiseLoop: packed video and audio tokens, text and
    rope coordinates per branch, the guidance pass (STG / modality isolation) as a kwarg, and
    I2V's per-token timestep (clean first frame: t = 0)."""

    scale: int = 1  # spatial factor of the latent upsampler (the refine stage)
    modalities: tuple[str, ...] = MODALITIES

    def geometry(self, ctx: StageContext, request: OmniRequest) -> LTX2Geometry:
        return geometry_in(ctx, request, self.scale)

    def unpacked_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        g, audio = self.geometry(ctx, request), ctx.component("audio_vae").config
        channels = ctx.component("transformer").config.in_channels
        return {"video": (1, channels, g.frames, g.rows, g.cols),
                "audio": (1, audio.latent_channels, g.audio_frames, audio.latent_mel_bins)}

    def latent_shapes(self, ctx: StageContext, request: OmniRequest) -> dict[str, tuple[int, ...]]:
        g, audio = self.geometry(ctx, request), ctx.component("audio_vae").config
        channels = ctx.component("transformer").config.in_channels
        # guides: keyframes appended after the video's tokens (one latent frame per image, (F - 1) / 8 + 1 per video)
        appended = appended_count(frame_conditions(request, g.num_frames)) * g.rows * g.cols
        return {"video": (1, g.tokens + appended, channels),
                "audio": (1, g.audio_frames, audio.latent_channels * audio.latent_mel_bins)}

    def branch_inputs(self, ctx: StageContext, state: RequestState, branches: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        text = ctx.read(state, "text", LTX2TextStates)
        g = self.geometry(ctx, state.request)
        dit = ctx.component("transformer")
        common = {
            "video_coords": dit.rope.video_coords(1, g.frames, g.rows, g.cols, ctx.device, float(g.fps)),
            "audio_coords": dit.audio_rope.audio_coords(1, g.audio_frames, ctx.device),
        }
        condition = ctx.read_optional(state, "condition", ConditionLatents)
        if isinstance(condition, LTX2FrameConditions):  # guides: per-token strengths, keyframes' positions
            common["conditioning_mask"] = condition.hold().mask.squeeze(-1).to(ctx.device)  # [1, L]
            common["video_coords"] = torch.cat([common["video_coords"]] + [
                keyframe_coords(dit.rope.scale_factors, kf.shape, kf.frame, float(g.fps), ctx.device, kf.pixel_frames)
                for kf in condition.keyframes], dim=2)
        elif condition is not None:  # I2V: the first latent frame's tokens are clean
            common["conditioning_mask"] = first_frame_mask(g, ctx.device)
        cond = {"encoder_hidden_states": text.prompt, "audio_encoder_hidden_states": text.audio_prompt,
                "text_mask": text.mask, **common}
        out = {b: dict(cond) for b in branches}
        if "uncond" in branches:
            assert text.negative is not None, "text CFG is on but no negative prompt was encoded"
            out["uncond"] = {"encoder_hidden_states": text.negative, "audio_encoder_hidden_states": text.audio_negative,
                             "text_mask": text.negative_mask, **common}
        return out

    def forward(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], timestep: torch.Tensor,
                kwargs: dict[str, Any]) -> Prediction:
        mask = kwargs.get("conditioning_mask")  # [B, N] 1 = clean
        video_t = timestep.unsqueeze(-1) * (1 - mask) if mask is not None else timestep
        video, audio = model(inputs["video"], inputs["audio"], kwargs["encoder_hidden_states"],
                             kwargs["audio_encoder_hidden_states"], video_t, timestep, timestep, kwargs["video_coords"],
                             kwargs["audio_coords"], kwargs["text_mask"], kwargs.get("guidance", Guidance()))
        return {"video": video, "audio": audio}

    def flops_per_forward(self, ctx: StageContext, shapes: dict[str, tuple[int, ...]]) -> float:
        """Matmul FLOPs of one DiT forward (2 per multiply-add): per stream self-attention,
        text cross-attention and FFN, plus the two cross-modal attentions."""
        c = ctx.component("transformer").config
        n, la = shapes["video"][1], shapes["audio"][1]
        lt = ctx.defaults.max_sequence_length or 1024
        d, da, dc = c.inner_dim, c.audio_inner_dim, c.cross_attention_dim
        per_layer = (
            4 * n * d * d + 2 * n * n * d + 2 * n * d * d + 2 * lt * dc * d + 2 * n * lt * d + 8 * n * d * d  # video
            + 4 * la * da * da + 2 * la * la * da + 2 * la * da * da + 2 * lt * da * da + 2 * la * lt * da
            + 8 * la * da * da  # audio
            + 2 * (2 * n * d * da + 2 * la * da * da + 2 * n * la * da)  # audio <-> video
        )
        return float(2 * c.num_layers * per_layer)


def first_frame_mask(g: LTX2Geometry, device: torch.device) -> torch.Tensor:
    """[1, N] float32: 1 for the tokens of latent frame 0 (diffusers' packed conditioning mask)."""
    mask = torch.zeros(1, 1, g.frames, g.rows, g.cols, device=device)
    mask[:, :, 0] = 1.0
    return pack_video(mask).squeeze(-1)


# -- image-to-video --------------------------------------------------------------------


def load_image_part(part: ImagePart):
    from omniloop.io.image import open_image

    if part.data is not None:
        return open_image(part.data)
    return open_image(part.raw_bytes() if part.b64 is not None else part.path)


def condition_frames(part: ImagePart | VideoPart) -> np.ndarray:
    """[F, H, W, 3] uint8: a condition image as one frame, a video guide's frames."""
    if isinstance(part, VideoPart):
        return guide_video(part)
    return np.array(load_image_part(part).convert("RGB"))[None]


def first_frame(request: OmniRequest) -> ImagePart | None:
    images = request.images("first_frame")
    return images[0] if images else None


@dataclass
class LTX2ImageCondition(ComponentStage):
    """The first frame: H.264 re-compressed at the model's CRF (as in training), resized
    (bilinear), VAE-encoded (posterior mean) and normalized -> ConditionLatents [1, C, 1, h, w].
    With guides (a keyframe, a last frame, a first frame at strength < 1: ``guides.py``): every
    condition image re-compressed, resized to cover the frame and center-cropped, encoded ->
    ``LTX2FrameConditions`` (diffusers ``LTX2ConditionPipeline.prepare_latents``)."""

    component: str = "vae"
    outputs = {"condition": ConditionLatents}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        from PIL import Image

        vae = ctx.component(self.component)
        g = geometry_in(ctx, state.request)
        conditions = frame_conditions(state.request, g.num_frames)
        if uses_guides(conditions):
            ctx.write(state, "condition", self._guides(ctx, vae, g, conditions))
            return
        part = first_frame(state.request)
        assert part is not None, "admission guarantees an i2v request carries a first_frame image"
        image = load_image_part(part)
        crf = ctx.defaults.family_as(LTX2Defaults).image_crf
        if crf:
            image = Image.fromarray(h264_recompress(np.array(image.convert("RGB")), crf))
        pixels = image_to_tensor(image, g.height, g.width, resample="bilinear").to(ctx.device)  # [1, 3, H, W]
        latents = vae.encode(pixels.unsqueeze(2)).float()  # [1, C, 1, h, w]
        ctx.write(state, "condition", ConditionLatents(latents=vae.normalize(latents, scaling=1.0)))


    def _guides(self, ctx: StageContext, vae: Any, g: LTX2Geometry, conditions: list) -> LTX2FrameConditions:
        crf = ctx.defaults.family_as(LTX2Defaults).image_crf
        first, first_strength, keyframes = None, 1.0, []
        for c in conditions:
            frames = condition_frames(c.part)  # [F0, H0, W0, 3] uint8
            if crf and len(frames) == 1:  # a single frame is re-compressed as in training; a sequence is not (diffusers)
                frames = h264_recompress(frames[0], crf)[None]
            pixels = cover_pixels(frames[:c.frames], g.height, g.width)  # [1, 3, F, H, W], F = 8k+1
            latents = vae.normalize(vae.encode(pixels.to(ctx.device, vae.dtype)).float(), scaling=1.0)  # [1, C, k+1, h, w]
            if not c.appended:
                first, first_strength = latents, c.strength
            else:
                keyframes.append(LTX2Keyframe(tokens=pack_video(latents), shape=tuple(latents.shape[2:]),
                                              frame=c.frame, strength=c.strength, pixel_frames=c.frames))
        if first is None:  # nothing written into the video's own tokens
            first = torch.zeros(1, vae.config.latent_channels, 0, g.rows, g.cols, device=ctx.device)
        return LTX2FrameConditions(latents=first, first_strength=first_strength, base_tokens=g.tokens,
                                   keyframes=tuple(keyframes))


# -- the latent upsampler (between the base and the refine loop) ---------------------------


class UpsampleParams(BaseModel):
    """``node_params["upsample"]``: asking for it runs base -> upsample -> refine."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adain_factor: float = Field(default=0.0, ge=0.0, le=1.0, description="match the base latents' statistics")
    tone_map_compression_ratio: float = Field(default=0.0, ge=0.0, le=1.0)


def adain(latents: torch.Tensor, reference: torch.Tensor, factor: float) -> torch.Tensor:
    """Per channel, the upsampled latents take the reference's mean and std (lerped by ``factor``)."""
    result = latents.clone()
    for i in range(latents.size(0)):
        for c in range(latents.size(1)):
            r_sd, r_mean = torch.std_mean(reference[i, c], dim=None)
            i_sd, i_mean = torch.std_mean(result[i, c], dim=None)
            result[i, c] = ((result[i, c] - i_mean) / i_sd) * r_sd + r_mean
    return torch.lerp(latents, result, factor)


def tone_map(latents: torch.Tensor, compression: float) -> torch.Tensor:
    scale = compression * 0.75
    return latents * (1.0 - 0.8 * scale * torch.sigmoid(4.0 * scale * (torch.abs(latents) - 1.0)))


@dataclass
class LTX2LatentUpsample(StageBase):
    """The base loop's latents -> the refine loop's InitLatents: video denormalized, upsampled
    (``LTX2LatentUpsamplePipeline`` with given latents), normalized again; audio carried over
    (denormalized and normalized again, as the stage-2 call of diffusers does)."""

    upsampler: str = "latent_upsampler"
    inputs = {"latents": DenoisedLatents}
    outputs = {"init_latents": InitLatents}
    params_schema = UpsampleParams

    @property
    def components(self) -> tuple[str, ...]:
        return (self.upsampler, "vae", "audio_vae")

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae, audio_vae, model = ctx.component("vae"), ctx.component("audio_vae"), ctx.component(self.upsampler)
        params = state.node_params.get(ctx.node) or UpsampleParams()
        base = ctx.read(state, "latents", DenoisedLatents).latents
        g = geometry_in(ctx, state.request)
        video = vae.denormalize(unpack_video(base["video"], g))  # [1, C, F, h, w] in the VAE's space
        up = model(video).float()
        if params.adain_factor > 0.0:
            up = adain(up, video, params.adain_factor)
        if params.tone_map_compression_ratio > 0.0:
            up = tone_map(up, params.tone_map_compression_ratio)
        audio = denormalize_audio(base["audio"], audio_vae)
        ctx.write(state, "init_latents", InitLatents(latents={"video": pack_video(vae.normalize(up)),
                                                              "audio": normalize_audio(audio, audio_vae)}))


# -- decoders ----------------------------------------------------------------------------


def _final(ctx: StageContext, state: RequestState) -> tuple[dict[str, torch.Tensor], int]:
    """The refine loop's latents when it ran (spatial scale of the upsampler), else the base's."""
    refined = ctx.read_optional(state, "refined", DenoisedLatents)
    if refined is not None:
        return refined.latents, upsample_scale(ctx.component("latent_upsampler"))
    return ctx.read(state, "latents", DenoisedLatents).latents, 1


@dataclass
class LTX2VideoDecode(ComponentStage):
    component: str = "vae"
    inputs = {"latents": DenoisedLatents}
    optional_inputs = {"refined": DenoisedLatents}
    outputs = {"video": VideoArtifact}


    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        vae = ctx.component(self.component)
        latents, scale = _final(ctx, state)
        g = geometry_in(ctx, state.request, scale)
        video = vae.decode(vae.denormalize(unpack_video(latents["video"], g).to(vae.dtype)))  # [1, 3, F, H, W]
        frames = to_uint8_frames((video[0].float() / 2 + 0.5).clamp(0, 1))
        ctx.write(state, "video", VideoArtifact(frames=frames, fps=g.fps))


@dataclass
class LTX2AudioDecode(StageBase):
    """Audio latents -> mel spectrogram (audio VAE) -> waveform (vocoder)."""

    inputs = {"latents": DenoisedLatents}
    optional_inputs = {"refined": DenoisedLatents}
    outputs = {"audio": AudioArtifact}
    components = ("audio_vae", "vocoder")

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        audio_vae, vocoder = ctx.component("audio_vae"), ctx.component("vocoder")
        latents, _ = _final(ctx, state)
        z = unpack_audio(denormalize_audio(latents["audio"], audio_vae), audio_vae.config.latent_mel_bins)
        mel = audio_vae.decode(z.to(audio_vae.dtype))  # [1, channels, T, mel]
        wave = vocoder(mel.to(vocoder.dtype))[0]  # [out_channels, samples]
        ctx.write(state, "audio", AudioArtifact(samples=wave.float().cpu(),
                                                sample_rate=int(vocoder.config.output_sampling_rate)))
