"""The Cosmos3 omni transformer, written natively: ONE module for the reasoner and the generator.

Architecture (diffusers ``Cosmos3OmniTransformer``; transformers' reasoner is its
understanding half): token embedding -> N mixture-of-transformers layers with two pathways
(``und``: text, causal; ``gen``: vision patches, sound and action tokens, full attention
over the sample's text and generation tokens) -> per-pathway final norms -> ``lm_head`` on
text, ``proj_out`` / ``audio_proj_out`` / ``action_proj_out`` on generated tokens. Positions
are 3D-MRoPE planes (text 1D; vision t/h/w with FPS modulation; sound and action 1D in time).

One module serves both loops (``models/layers/mot.py``):

* the AR reasoner runs :meth:`Cosmos3Transformer.forward_text` (und pathway) over a paged
  KV and :meth:`lm_logits` (``Cosmos3Reasoner`` is the loop's view of it; it holds no weights);
* a denoise step runs the same understanding pathway once per request over the prompt (its
  K/V kept for the whole loop: the text stream never attends generated tokens, so it is the
  same at every step and CFG branch), then :meth:`forward_gen` per step: only generation
  tokens, attending the cached text K/V plus themselves.

Vocabulary: ``L`` text tokens, ``Lg`` generation tokens of one sample (vision ``T*Hp*Wp``
patches, then ``Ts`` sound tokens, then ``Ta`` action tokens), ``D`` width, ``Dh`` head dim,
``p`` the latent patch size, ``C`` latent channels (48 with the Wan2.2 VAE).

Departures (numerically equivalent, checked against diffusers in tests/models/cosmos3):
one time embedding per sample instead of one per noisy token (identical rows); fused
Q/K/V and gate/up GEMMs (``weights.py`` concatenates the checkpoint's tensors).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from omniloop.cache.kv import KVLayout
from omniloop.models.families.cosmos3.vision import forward_inputs
from omniloop.models.layers.mot import KVView, MoTLayer, PathwayConfig, RMSNorm
from omniloop.models.layers.mrope import Rotary, mrope_cos_sin
from omniloop.models.layers.packed_seq import GEN, UND, AttnMode, PackedSeq, SampleBuilder, grid_positions, text_positions
from omniloop.models.layers.wan_dit import TwoLayerMLP

DIFFUSERS_CLASS = "Cosmos3OmniTransformer"
TIME_FREQ_DIM = 256  # diffusers: Timesteps(num_channels=256)

# diffusers config.json keys that describe the file, not the architecture
_METADATA = frozenset({"_class_name", "_diffusers_version", "_name_or_path", "dtype", "attention_dropout"})


@dataclass(frozen=True, kw_only=True)
class Cosmos3Config:
    """Architecture of the omni transformer; names and defaults follow diffusers' config
    (the defaults are the published Cosmos3 architecture)."""

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5000000.0
    rope_axes_dim: tuple[int, int, int] = (24, 20, 20)
    attention_bias: bool = False
    hidden_act: str = "silu"
    qk_norm_for_text: bool = True
    # generation pathway and towers (absent in a reasoner-only checkpoint)
    generator: bool = True
    latent_channel: int = 48
    latent_patch_size: int = 2
    patch_latent_dim: int = 192
    base_fps: int = 24
    enable_fps_modulation: bool = True
    unified_3d_mrope_reset_spatial_ids: bool = True
    unified_3d_mrope_temporal_modality_margin: int = 15000
    timestep_scale: float = 0.001
    sound_gen: bool = False
    sound_dim: int | None = None
    sound_latent_fps: float = 25.0
    action_gen: bool = False
    action_dim: int | None = None
    num_embodiment_domains: int = 32
    max_position_embeddings: int | None = None  # the reasoner's context (transformers config)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "latent_channel", "latent_patch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Cosmos3 config: {name} must be a positive int; got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"Cosmos3 config: num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.hidden_act not in ("silu", "relu2"):
            raise ValueError(f"Cosmos3 config: hidden_act={self.hidden_act!r}; pass 'silu' (Qwen3) or 'relu2' (Nemotron)")
        if len(self.rope_axes_dim) != 3 or sum(self.rope_axes_dim) != self.head_dim // 2:
            raise ValueError(f"Cosmos3 config: rope_axes_dim={list(self.rope_axes_dim)} must be three sections summing "
                             f"to head_dim // 2 = {self.head_dim // 2}")
        if self.generator and self.patch_latent_dim != self.latent_channel * self.latent_patch_size ** 2:
            raise ValueError(f"Cosmos3 config: patch_latent_dim={self.patch_latent_dim} must equal latent_channel * "
                             f"latent_patch_size**2 = {self.latent_channel * self.latent_patch_size ** 2}")
        if self.sound_gen and not self.sound_dim:
            raise ValueError("Cosmos3 config: sound_gen=true needs sound_dim")
        if self.action_gen and not self.action_dim:
            raise ValueError("Cosmos3 config: action_gen=true needs action_dim")

    @property
    def kv_layout(self) -> KVLayout:
        return KVLayout(self.num_hidden_layers, self.num_key_value_heads, self.head_dim)

    def pathway(self, name: str) -> PathwayConfig:
        return PathwayConfig(
            hidden_size=self.hidden_size, head_dim=self.head_dim, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads, intermediate_size=self.intermediate_size, eps=self.rms_norm_eps,
            bias=self.attention_bias, act=self.hidden_act, qk_norm=self.qk_norm_for_text if name == UND else True,  # type: ignore[arg-type]
            fp32_norm_weight=self.hidden_act == "relu2",
        )

    @classmethod
    def from_diffusers_config(cls, d: Mapping[str, Any]) -> "Cosmos3Config":
        """From a diffusers ``transformer/config.json``; options this implementation does not run raise ValueError."""
        d = dict(d)
        if d.get("_class_name", DIFFUSERS_CLASS) != DIFFUSERS_CLASS:
            raise ValueError(f"transformer config is a {d['_class_name']!r}, not a {DIFFUSERS_CLASS}")
        if float(d.get("attention_dropout", 0.0)) != 0.0:
            raise ValueError("Cosmos3 config: attention_dropout must be 0 at inference")
        if d.pop("use_und_k_norm_for_gen", False) and not d.get("qk_norm_for_text", True):
            raise ValueError("Cosmos3 config: use_und_k_norm_for_gen=true (a separate key norm of text keys for the "
                             "generation pathway) is not supported; pass a checkpoint with use_und_k_norm_for_gen=false")
        scaling = d.pop("rope_scaling", None) or {}
        if d.get("rope_axes_dim") is None:
            d["rope_axes_dim"] = scaling.get("mrope_section", [24, 20, 20])
        known = {f.name for f in dataclasses.fields(cls)} - {"generator", "max_position_embeddings"}
        unknown = sorted(set(d) - known - _METADATA)
        if unknown:
            raise ValueError(f"unknown Cosmos3 transformer config keys {unknown}; known: {sorted(known)}")
        kwargs = {k: v for k, v in d.items() if k in known}
        kwargs["rope_axes_dim"] = tuple(kwargs["rope_axes_dim"])
        return cls(**kwargs)

    @classmethod
    def from_reasoner_config(cls, d: Mapping[str, Any]) -> "Cosmos3Config":
        """From transformers' ``Cosmos3OmniConfig`` (``config.json`` of the unified checkpoint):
        the understanding pathway only (the reasoner)."""
        text = dict(d.get("text_config") or {})
        if not text:
            raise ValueError("Cosmos3OmniConfig has no text_config; pass the unified checkpoint's config.json")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"Cosmos3 reasoner: rope_type={rope['rope_type']!r} is not supported; only the default mRoPE")
        if rope.get("mrope_interleaved") is False:
            raise ValueError("Cosmos3 reasoner: mrope_interleaved=false (chunked MRoPE) is not supported")
        if text.get("attention_bias"):
            raise ValueError("Cosmos3 reasoner: attention_bias=true is not supported")
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        return cls(
            vocab_size=text["vocab_size"], hidden_size=text["hidden_size"], intermediate_size=text["intermediate_size"],
            num_hidden_layers=text["num_hidden_layers"], num_attention_heads=text["num_attention_heads"],
            num_key_value_heads=text.get("num_key_value_heads") or text["num_attention_heads"], head_dim=head_dim,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6), rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 5e6))),
            rope_axes_dim=tuple(rope.get("mrope_section", (24, 20, 20))), hidden_act=text.get("hidden_act", "silu"),
            generator=False, max_position_embeddings=text.get("max_position_embeddings"),
        )


@dataclass(frozen=True)
class GenLayout:
    """A sample's generation tokens: what they are and which are predicted. Hashable: requests
    whose layouts are equal batch their denoise steps (text lengths may differ).

    Token order in the generation segment: vision patches (t-major), sound, action.
    """

    vision_shape: tuple[int, int, int, int]  # latent (C, T, H, W)
    patch: int  # latent patch size p
    noisy_vision: tuple[int, ...]  # latent frames the model predicts (the rest are clean conditions)
    sound_len: int = 0  # Ts sound latent frames (0: no sound)
    action_len: int = 0  # Ta action steps (0: no actions)
    noisy_action: tuple[int, ...] = ()  # predicted action steps; () with action_len > 0: actions are a clean condition

    @property
    def vision_grid(self) -> tuple[int, int, int]:
        _, t, h, w = self.vision_shape
        return t, -(-h // self.patch), -(-w // self.patch)

    @property
    def num_vision_tokens(self) -> int:
        t, hp, wp = self.vision_grid
        return t * hp * wp

    @property
    def num_tokens(self) -> int:
        return self.num_vision_tokens + self.sound_len + self.action_len


def pack_sample(config: "Cosmos3Config", layout: GenLayout, text_len: int, *, fps: float,
                frames_per_latent: int) -> PackedSeq:
    """The PackedSeq of one sample: ``[text (und, causal) | vision | sound | action (gen, full)]``
    with Cosmos3's 3D-MRoPE planes (text from 0; every generated modality starts at
    ``text_len + temporal_modality_margin``, vision and sound and action being temporal siblings)."""
    c = config
    b = SampleBuilder()
    planes, next_offset = text_positions(text_len, 0)
    b.add("text", UND, AttnMode.CAUSAL, (text_len, 1, 1), planes)
    start = next_offset + c.unified_3d_mrope_temporal_modality_margin
    modulated = c.enable_fps_modulation
    grid = partial(grid_positions, base_fps=float(c.base_fps), reset_spatial=c.unified_3d_mrope_reset_spatial_ids)
    planes, _ = grid(layout.vision_grid, start, fps=fps if modulated else None, frames_per_token=frames_per_latent)
    b.add("vision", GEN, AttnMode.FULL, layout.vision_grid, planes)
    if layout.sound_len:
        planes, _ = grid((layout.sound_len, 1, 1), start, fps=c.sound_latent_fps if modulated else None,
                         frames_per_token=1)
        b.add("sound", GEN, AttnMode.FULL, (layout.sound_len, 1, 1), planes)
    if layout.action_len:
        planes, _ = grid((layout.action_len, 1, 1), start, fps=fps if modulated else None, frames_per_token=1,
                         base_frames_per_token=frames_per_latent, start_frame=1)
        b.add("action", GEN, AttnMode.FULL, (layout.action_len, 1, 1), planes)
    return b.build()


class DomainAwareLinear(nn.Module):
    """One weight/bias pair per embodiment domain, selected per token (checkpoint layout: ``fc``
    holds each domain's ``[in, out]`` matrix flattened, ``bias`` its ``[out]``)."""

    def __init__(self, in_features: int, out_features: int, num_domains: int) -> None:
        super().__init__()
        self.in_features, self.out_features, self.num_domains = in_features, out_features, num_domains
        self.fc = nn.Embedding(num_domains, in_features * out_features)
        self.bias = nn.Embedding(num_domains, out_features)

    def forward(self, x: torch.Tensor, domain: torch.Tensor) -> torch.Tensor:
        """``x [N, in]``, ``domain [N]`` int64 -> ``[N, out]`` (a [1, in] x [in, out] product per token)."""
        weight = self.fc(domain).view(-1, self.in_features, self.out_features)
        return torch.bmm(x.unsqueeze(1), weight).squeeze(1) + self.bias(domain)


class Cosmos3Transformer(nn.Module):
    def __init__(self, config: Cosmos3Config) -> None:
        super().__init__()
        c = self.config = config
        fp32_norm = c.hidden_act == "relu2"
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        pathways = {UND: c.pathway(UND), **({GEN: c.pathway(GEN)} if c.generator else {})}
        self.layers = nn.ModuleList(MoTLayer(pathways, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, fp32_norm)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        if not c.generator:
            return
        self.gen_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, fp32_norm)
        self.proj_in = nn.Linear(c.patch_latent_dim, c.hidden_size)
        self.proj_out = nn.Linear(c.hidden_size, c.patch_latent_dim)
        self.time_embedder = TwoLayerMLP(TIME_FREQ_DIM, c.hidden_size, nn.SiLU())  # kept fp32 (diffusers too)
        if c.sound_gen:
            self.audio_proj_in = nn.Linear(c.sound_dim, c.hidden_size)  # type: ignore[arg-type]
            self.audio_proj_out = nn.Linear(c.hidden_size, c.sound_dim)  # type: ignore[arg-type]
            self.audio_modality_embed = nn.Parameter(torch.zeros(c.hidden_size))
        if c.action_gen:
            self.action_proj_in = DomainAwareLinear(c.action_dim, c.hidden_size, c.num_embodiment_domains)  # type: ignore[arg-type]
            self.action_proj_out = DomainAwareLinear(c.hidden_size, c.action_dim, c.num_embodiment_domains)  # type: ignore[arg-type]
            self.action_modality_embed = nn.Parameter(torch.zeros(c.hidden_size))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self.config.kv_layout

    # -- shared ------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [3, *batch, N]`` -> ``cos, sin [*batch, N, Dh]`` in the model dtype."""
        c = self.config
        return mrope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_axes_dim, self.dtype)

    # -- understanding pathway (text) -----------------------------------------------------
    def forward_text(self, input_ids: torch.Tensor, kv: KVView | None = None,
                     positions: torch.Tensor | None = None, visual: Any = None) -> torch.Tensor:
        """``input_ids [B, L]`` -> hidden ``[B, L, D]`` before the final norm. Positions: the
        given ``[3, B, L]`` planes, else the KV view's ``positions [B, L]`` in all three planes
        (text), else ``0..L-1``. The layers append their keys/values to ``kv``. ``visual``
        (``vision.VisualRows``): image tokens' embeddings replace their pad tokens', and the
        ViT's DeepStack features are added after the first layers (Qwen3-VL)."""
        b, length = input_ids.shape
        if positions is None:
            flat = kv.positions if kv is not None else torch.arange(length, device=input_ids.device).expand(b, length)  # type: ignore[attr-defined]
            positions = flat.float().unsqueeze(0).expand(3, -1, -1)
        rope = Rotary.of(*self.rope(positions))  # once per forward, shared by every layer
        h = self.embed_tokens(input_ids)
        if visual is not None:
            h[visual.mask] = visual.embeds.to(h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer.forward_pathway(UND, h, rope, kv)
            if visual is not None and i < len(visual.deepstack):
                h[visual.mask] = h[visual.mask] + visual.deepstack[i].to(h.dtype)
        return h

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    # -- generation pathway -----------------------------------------------------------------
    def forward_gen(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context: KVView) -> torch.Tensor:
        """Generation tokens ``hidden [B, Lg, D]`` attending ``context`` (the sample's text K/V,
        then their own) -> final-normed ``[B, Lg, D]``."""
        rope = Rotary.of(cos, sin)
        for layer in self.layers:
            hidden = layer.forward_pathway(GEN, hidden, rope, context)
        return self.gen_norm(hidden)

    def time_embedding(self, timestep: torch.Tensor) -> torch.Tensor:
        """``[B]`` model timesteps (0..1000) -> ``[B, D]`` in the model dtype (computed in the
        embedder's dtype, fp32 unless it was cast)."""
        t = timestep.float() * self.config.timestep_scale
        return self.time_embedder.embed_timesteps(t, TIME_FREQ_DIM).to(self.dtype)

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """``[B, C, T, H, W]`` -> ``[B, T*Hp*Wp, p*p*C]`` (H/W zero-padded to a multiple of p)."""
        p = self.config.latent_patch_size
        b, c, t, h, w = latents.shape
        ph, pw = -h % p, -w % p
        if ph or pw:
            latents = F.pad(latents, (0, pw, 0, ph))
        hp, wp = (h + ph) // p, (w + pw) // p
        x = latents.reshape(b, c, t, hp, p, wp, p).permute(0, 2, 3, 5, 4, 6, 1)  # [B, T, Hp, Wp, p, q, C]
        return x.reshape(b, t * hp * wp, p * p * c)

    def unpatchify(self, patches: torch.Tensor, frames: tuple[int, ...], shape: tuple[int, int, int, int]) -> torch.Tensor:
        """Predicted patches of the ``frames`` listed ``[B, len(frames)*Hp*Wp, p*p*C]`` -> latents
        ``[B, C, T, H, W]`` with zeros in every other frame."""
        p = self.config.latent_patch_size
        c, t, h, w = shape
        hp, wp = -(-h // p), -(-w // p)
        b = patches.shape[0]
        out = patches.new_zeros(b, c, t, h, w)
        if frames:
            x = patches.reshape(b, len(frames), hp, wp, p, p, c).permute(0, 6, 1, 2, 4, 3, 5)  # [B, C, Tn, Hp, p, Wp, q]
            x = x.reshape(b, c, len(frames), hp * p, wp * p)[..., :h, :w]
            out[:, :, list(frames)] = x
        return out

    def embed_gen(self, layout: GenLayout, vision: torch.Tensor, timestep: torch.Tensor,
                  sound: torch.Tensor | None = None, action: torch.Tensor | None = None,
                  domain: torch.Tensor | None = None, temb: torch.Tensor | None = None) -> torch.Tensor:
        """Generation tokens of B samples of one layout -> ``[B, Lg, D]``.

        ``vision [B, C, T, H, W]``, ``timestep [B]``, ``sound [B, C_s, Ts]``, ``action [B, Ta, Da]``,
        ``domain [B]`` embodiment ids. Predicted frames get the time embedding (``temb [B, D]``
        when given, else computed from ``timestep``); clean ones do not.
        """
        b = vision.shape[0]
        temb = (self.time_embedding(timestep) if temb is None else temb)[:, None]  # [B, 1, D]
        tokens = self.proj_in(self.patchify(vision.to(self.dtype)))  # [B, Nv, D]
        t, hp, wp = layout.vision_grid
        if layout.noisy_vision:
            frames = tokens.view(b, t, hp * wp, -1)
            noisy = list(layout.noisy_vision)
            frames[:, noisy] = frames[:, noisy] + temb[:, None]
        parts = [tokens]
        if layout.sound_len:
            assert sound is not None, "layout has sound but no sound latents were given"
            s = self.audio_proj_in(sound.to(self.dtype).transpose(1, 2)) + self.audio_modality_embed  # [B, Ts, D]
            parts.append(s + temb)
        if layout.action_len:
            assert action is not None and domain is not None, "layout has actions but no actions / domain ids"
            per_token = domain.reshape(-1, 1).expand(b, layout.action_len).reshape(-1)
            a = self.action_proj_in(action.to(self.dtype).reshape(b * layout.action_len, -1), per_token)
            a = (a + self.action_modality_embed).view(b, layout.action_len, -1)
            if layout.noisy_action:
                noisy = list(layout.noisy_action)
                a[:, noisy] = a[:, noisy] + temb
            parts.append(a)
        return torch.cat(parts, dim=1) if len(parts) > 1 else tokens

    def decode_gen(self, layout: GenLayout, hidden: torch.Tensor, domain: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Final-normed generation tokens ``[B, Lg, D]`` -> predictions: ``video [B, C, T, H, W]``
        (zeros in clean frames), ``audio [B, C_s, Ts]``, ``action [B, Ta, Da]`` (zeros in clean steps)."""
        b = hidden.shape[0]
        t, hp, wp = layout.vision_grid
        nv = layout.num_vision_tokens
        vis = hidden[:, :nv].view(b, t, hp * wp, -1)[:, list(layout.noisy_vision)].flatten(1, 2)
        out = {"video": self.unpatchify(self.proj_out(vis), layout.noisy_vision, layout.vision_shape)}
        if layout.sound_len:
            out["audio"] = self.audio_proj_out(hidden[:, nv:nv + layout.sound_len]).transpose(1, 2)
        if layout.action_len and layout.noisy_action:
            noisy = list(layout.noisy_action)
            rows = hidden[:, nv + layout.sound_len:][:, noisy]  # [B, Tn, D]
            per_token = domain.reshape(-1, 1).expand(b, len(noisy)).reshape(-1)  # type: ignore[union-attr]
            pred = self.action_proj_out(rows.reshape(b * len(noisy), -1), per_token).view(b, len(noisy), -1)
            action = pred.new_zeros(b, layout.action_len, pred.shape[-1])
            action[:, noisy] = pred
            out["action"] = action
        return out

    def forward_packed(self, hidden: torch.Tensor, seq: PackedSeq) -> torch.Tensor:
        """The joint forward: ``hidden [N, D]`` every token of ``seq`` (any number of samples)
        -> final-normed ``[N, D]`` (und tokens by ``norm``, gen tokens by ``gen_norm``)."""
        rope = Rotary.of(*self.rope(seq.positions.to(hidden.device)))
        for layer in self.layers:
            hidden = layer.forward_packed(hidden, seq, rope)
        out = torch.empty_like(hidden)
        und, gen = seq.index(hidden.device, pathway=UND), seq.index(hidden.device, pathway=GEN)
        out[und] = self.norm(hidden[und])
        if gen.numel():
            out[gen] = self.gen_norm(hidden[gen])
        return out


class Cosmos3Reasoner:
    """The AR decode loop's causal-LM view of the resident transformer: its understanding
    pathway and ``lm_head``. Holds a reference, never a copy, of the weights."""

    def __init__(self, model: Cosmos3Transformer) -> None:
        self.model = model

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self.model.kv_layout

    @property
    def config(self) -> Cosmos3Config:
        return self.model.config

    def __call__(self, input_ids: torch.Tensor, *, kv: KVView, logits_to_keep: int = 0,
                 lm_inputs: Sequence[Any] | None = None) -> torch.Tensor:
        """``input_ids [B, L]`` -> logits ``[B, L', vocab]`` of the last ``logits_to_keep`` positions.
        ``lm_inputs``: per row, the request's ``vision.VisionPrompt`` (images in its prompt) or None."""
        positions = visual = None
        if lm_inputs is not None and any(p is not None for p in lm_inputs):
            positions, visual = forward_inputs(lm_inputs, kv.positions)  # type: ignore[attr-defined]
        h = self.model.forward_text(input_ids, kv, positions, visual)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self.model.lm_logits(h)

    def parameters(self):  # the weights it runs on, for accounting (the transformer's own)
        return self.model.parameters()

    def activation_bytes(self, num_tokens: int, context: int) -> int:
        """Peak transient memory of one request's text forward of ``num_tokens`` tokens over
        ``context`` positions: a layer's live set, fp32 attention scores, one row of logits."""
        c = self.config
        qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        layer = num_tokens * (3 * c.hidden_size + qkv + 3 * c.intermediate_size) * self.dtype.itemsize
        return int(layer + c.num_attention_heads * num_tokens * context * 4 + c.vocab_size * 4)
