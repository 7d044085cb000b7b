"""Qwen3-Omni's AR transformers: the MoE thinker (text LM), the MoE talker (codebook 0 of each
speech frame) and the talker's code predictor (the residual codebooks of a frame).

All three are Qwen3 decoders (``omniloop.models.layers.qwen2_decoder`` with ``qk_norm`` and no
q/k/v biases); the thinker's and talker's feed-forwards are mixtures of experts
(``omniloop.models.layers.moe``: the talker's with a shared expert), the code predictor's a
SwiGLU. The thinker and talker rotate with interleaved multimodal RoPE (``mrope_section``;
text positions make it the plain RoPE), the code predictor with the plain RoPE. Module names
are transformers' below the part prefix (``thinker.``, ``talker.``), so each part loads by
stripping it.

* :class:`Qwen3OmniThinker` - ``input_ids`` -> text logits (``model.embed_tokens`` / ``lm_head``).
* :class:`Qwen3OmniTalker` - codebook-0 ids -> codec logits, transformers'
  ``Qwen3OmniMoeTalkerForConditionalGeneration``: a prompt position takes its prepared embedding
  (:class:`TalkerRow.prompt_embeds`); a generated position ``P + k`` first runs the code
  predictor on the talker's last hidden state and frame ``k``'s codebook-0 id (the residual
  codes of the frame, recorded in the row), then feeds the sum of the frame's codebook
  embeddings plus the ``k``-th trailing text row (``tts_pad`` once they run out). So chunked
  prefill after preemption, batched decode and a solo run see the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence, cast

import torch
from torch import nn

from omniloop.cache.kv import KVLayout
from omniloop.models.layers.moe import MoEDims, SparseMoE
from omniloop.models.layers.mrope import inv_frequencies, mrope_cos_sin
from omniloop.models.layers.qwen2_decoder import DecoderDims, DecoderLayer, KVCacheView, RMSNorm, rope_tables
from omniloop.models.layers.run_blocks import run_blocks
from omniloop.models.omni.decoder_config import TextDecoderConfig
from omniloop.models.omni.media import PromptRope, decode_rope_deltas, delta_planes, kv_positions, mixed_rope, with_media
from omniloop.models.omni.talker import append_rows
from omniloop.models.omni.thinker import ThinkerModel, ThinkerRow, record_batch, recording_rows


@dataclass(frozen=True, kw_only=True)
class Qwen3DecoderConfig(TextDecoderConfig):
    """One decoder of the checkpoint: the thinker's ``text_config``, the talker's ``text_config``
    or the code predictor's config (``num_experts`` 0: dense; ``mrope_section`` None: plain RoPE)."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    @property
    def decoder_dims(self) -> DecoderDims:
        return DecoderDims(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps, fused=False, qkv_bias=False,
                           qk_norm=True)

    def sparse(self, layer: int) -> bool:
        """transformers' rule: a layer is MoE unless listed dense or off the sparse step."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def moe_dims(self) -> MoEDims:
        return MoEDims(hidden_size=self.hidden_size, expert_intermediate_size=self.moe_intermediate_size,
                       num_experts=self.num_experts, top_k=self.num_experts_per_tok,
                       norm_topk_prob=self.norm_topk_prob, shared_intermediate_size=self.shared_expert_intermediate_size)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, part: str, multimodal_rope: bool = True,
                every_layer_sparse: bool = False) -> "Qwen3DecoderConfig":
        """``every_layer_sparse``: the talker (transformers' talker layer is a shared-expert MoE
        whatever ``mlp_only_layers`` / ``decoder_sparse_step`` say)."""
        if d.get("attention_bias"):
            raise ValueError(f"Qwen3-Omni {part}: attention_bias=true is not supported (no released checkpoint has it)")
        if d.get("sliding_window") and d.get("use_sliding_window"):
            raise ValueError(f"Qwen3-Omni {part}: sliding-window attention is not supported; set use_sliding_window=false")
        return cls(
            **TextDecoderConfig.shared_fields(d, where=f"Qwen3-Omni {part}", mrope_section=(24, 20, 20) if multimodal_rope else None),
            num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0), num_experts_per_tok=int(d.get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(d.get("moe_intermediate_size", 0) or 0),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            decoder_sparse_step=1 if every_layer_sparse else int(d.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=() if every_layer_sparse else tuple(int(i) for i in d.get("mlp_only_layers") or ()),
            shared_expert_intermediate_size=int(d.get("shared_expert_intermediate_size", 0) or 0),
        )


class Qwen3Decoder(nn.Module):
    """layers + norm; the owner adds its embedding (the thinker's ``embed_tokens``, the talker's
    ``codec_embedding``, the code predictor's ``codec_embedding`` list) under transformers' name."""

    def __init__(self, c: Qwen3DecoderConfig) -> None:
        super().__init__()
        self.config = c
        self.layers = nn.ModuleList(
            DecoderLayer(c.decoder_dims, i, SparseMoE(c.moe_dims()) if c.sparse(i) else None)
            for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, L]`` (or per plane ``[3, B, L]``) -> ``cos, sin [B, L, 1, D]``."""
        c = self.config
        if c.mrope_section is None:
            inv = inv_frequencies(c.head_dim, c.rope_theta, positions.device)
            return rope_tables(positions[..., None].float() * inv, dtype)
        planes = positions if positions.dim() == 3 else positions[None].expand(3, -1, -1)
        cos, sin = mrope_cos_sin(planes, c.head_dim, c.rope_theta, c.mrope_section, dtype)  # [B, L, D]
        return cos[:, :, None], sin[:, :, None]

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv: KVCacheView | None) -> torch.Tensor:
        """``h [B, L, hidden]`` -> normed hidden states ``[B, L, hidden]``."""
        return self.tapped(h, positions, kv, None)[0]

    def tapped(self, h: torch.Tensor, positions: torch.Tensor, kv: KVCacheView | None, tap: int | None,
               after: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
               after_layers: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The normed hidden states and, for ``tap`` k, the output of the first k layers (transformers'
        ``hidden_states[k]``; k = the layer count: the normed output, as transformers hands it).
        ``after(i, h)``: applied to the output of each of the first ``after_layers`` layers (the
        thinker's DeepStack additions; the tap reads the output before it, as transformers records it)."""
        cos, sin = self.rope(positions, h.dtype)
        layers = cast(Sequence[nn.Module], self.layers)
        hooked = after_layers if after is not None else 0
        mid: torch.Tensor | None = None
        for i in range(hooked):
            h = layers[i](h, cos, sin, kv)
            mid = h if tap == i + 1 else mid
            h = cast(Callable[[int, torch.Tensor], torch.Tensor], after)(i, h)
        if tap is not None and hooked < tap < len(layers):
            mid = run_blocks(layers[hooked:tap], h, cos, sin, kv)
            h = run_blocks(layers[tap:], mid, cos, sin, kv)
        else:
            h = run_blocks(layers[hooked:], h, cos, sin, kv)
        out = self.norm(h)
        return out, out if tap is not None and tap >= len(layers) else mid


def _activation_bytes(c: Qwen3DecoderConfig, dtype: torch.dtype, num_tokens: int, context: int) -> int:
    dims = c.decoder_dims
    if c.num_experts:  # a MoE layer's live set: top_k experts' SwiGLU per token instead of the dense one
        dims = DecoderDims(hidden_size=c.hidden_size, intermediate_size=c.moe_intermediate_size * c.num_experts_per_tok
                           + c.shared_expert_intermediate_size, num_heads=c.num_attention_heads,
                           num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
                           fused=False)
    return dims.activation_bytes(dtype, num_tokens, context, c.vocab_size)


# -- the thinker --------------------------------------------------------------------------


class ThinkerDecoder(Qwen3Decoder):
    def __init__(self, c: Qwen3DecoderConfig) -> None:
        super().__init__(c)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)


class Qwen3OmniThinker(ThinkerModel):
    """transformers' ``thinker`` text path: ``model`` (embed_tokens + MoE layers + norm) + ``lm_head``.
    Every forward records, for a spoken answer, each row's hidden states after ``accept_hidden_layer``
    layers into the row's ``ThinkerRow`` (what the talker reads at media positions)."""

    def __init__(self, c: Qwen3DecoderConfig, accept_hidden_layer: int | None = None) -> None:
        super().__init__()
        self.config: Qwen3DecoderConfig = c
        self.accept_hidden_layer = c.num_hidden_layers if accept_hidden_layer is None else accept_hidden_layer
        self.model: ThinkerDecoder = ThinkerDecoder(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def activation_bytes(self, num_tokens: int, context: int) -> int:
        return _activation_bytes(self.config, self.dtype, num_tokens, context)

    def forward(self, input_ids: torch.Tensor, *, kv: KVCacheView | None = None, logits_to_keep: int = 0,
                lm_inputs: Sequence[ThinkerRow | None] | None = None) -> torch.Tensor:
        """``input_ids [B, L]`` -> logits ``[B, L', vocab]``; each recording row's tapped states go
        to its ``lm_inputs`` record."""
        rows = list(lm_inputs or ())
        recording = recording_rows(rows)
        positions = kv_positions(input_ids, kv)
        starts = list(kv.starts) if kv is not None and kv.starts is not None else [0] * len(rows)
        # the encoders' embeddings at their placeholders (images: 3-D positions, DeepStack after the first layers)
        media = [None if row is None else row.media for row in rows]
        embeds, positions = with_media(self.embed(input_ids), positions, starts, media)
        layers = max((m.deepstack.shape[0] for m in media if m is not None and m.deepstack is not None), default=0)

        def deepstack(i: int, h: torch.Tensor) -> torch.Tensor:  # [B, L, D]
            return torch.stack([x if m is None else m.add_deepstack(x, s, i) for x, m, s in zip(h, media, starts)])

        h, tapped = self.model.tapped(embeds, positions, kv, self.accept_hidden_layer if recording else None,
                                      deepstack if layers else None, layers)
        if recording and tapped is not None:
            record_batch(rows, recording, starts, tapped)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self.lm_head(h)

    # -- a decode step replayed from a CUDA graph (pipeline/loops/ar_graphs.py: GraphStepLM; its
    # per-row inputs (no DeepStack: past the prompt) and record: ThinkerModel) --
    def graph_step(self, ids: torch.Tensor, kv: KVCacheView,
                   inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids [B, 1]`` -> fp32 logits ``[B, V]`` and the states after ``accept_hidden_layer``
        layers ``[B, hidden]`` (what ``forward`` records; tapped whether or not a row records)."""
        h, tapped = self.model.tapped(self.embed(ids), delta_planes(kv.positions, inputs["delta"]), kv,
                                      self.accept_hidden_layer)
        return self.lm_head(h[:, -1]).float(), cast(torch.Tensor, tapped)[:, -1]


# -- the code predictor -------------------------------------------------------------------


class _GrowingKV:
    """The code predictor's KV within one frame (at most ``groups + 1`` positions): appended, never paged."""

    def __init__(self, batch: int, device: torch.device) -> None:
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.length = 0
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.starts: Sequence[int] | None = None
        self.mask: torch.Tensor | None = None

    def advance(self, n: int) -> None:
        b, device = self.positions.shape[0], self.positions.device
        self.positions = torch.arange(self.length, self.length + n, device=device).expand(b, n)
        self.starts = [self.length] * b
        self.length += n

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.layers:
            pk, pv = self.layers[layer]
            k, v = torch.cat([pk, k], dim=1), torch.cat([pv, v], dim=1)
        self.layers[layer] = (k, v)
        return k, v


class PredictorDecoder(Qwen3Decoder):
    def __init__(self, c: Qwen3DecoderConfig, groups: int) -> None:
        super().__init__(c)
        self.codec_embedding = nn.ModuleList(nn.Embedding(c.vocab_size, c.hidden_size) for _ in range(groups - 1))


@dataclass(frozen=True)
class PredictorSampling:
    """How the code predictor picks a residual code: transformers' ``generate`` of it (greedy
    when the talker is greedy, else top-k 50 / top-p 0.8 at temperature 1) from ``generator``."""

    greedy: bool
    generator: torch.Generator | None = None
    top_k: int = 50
    top_p: float = 0.8


def _pick(logits: torch.Tensor, how: Sequence[PredictorSampling]) -> torch.Tensor:
    """``logits [B, V]`` -> ``[B]`` codes, each row greedy or sampled from its own generator."""
    out = logits.argmax(-1)
    for i, s in enumerate(how):
        if s.greedy:
            continue
        row = logits[i].float()
        kth = torch.topk(row, min(s.top_k, row.shape[-1])).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
        sorted_logits, order = torch.sort(row, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative <= 1 - s.top_p
        drop[-1] = False
        row = row.masked_fill(drop.scatter(0, order, drop), float("-inf"))
        out[i] = torch.multinomial(row.softmax(-1), 1, generator=s.generator)[0]
    return out


class CodePredictor(nn.Module):
    """transformers' ``talker.code_predictor``: ``model`` (a dense Qwen3 decoder with one codec
    embedding per residual codebook) + one ``lm_head`` per residual codebook."""

    def __init__(self, c: Qwen3DecoderConfig, groups: int) -> None:
        super().__init__()
        self.config = c
        self.groups = groups
        self.model = PredictorDecoder(c, groups)
        self.lm_head = nn.ModuleList(nn.Linear(c.hidden_size, c.vocab_size, bias=False) for _ in range(groups - 1))

    def forward(self, past_hidden: torch.Tensor, first: torch.Tensor, how: Sequence[PredictorSampling]) -> tuple[torch.Tensor, torch.Tensor]:
        """``past_hidden [B, D]`` (the talker's last hidden state) and ``first [B, D]`` (frame's
        codebook-0 embedding) -> residual codes ``[B, groups - 1]`` and the sum of their
        embeddings ``[B, D]``, as transformers' ``generate`` of the predictor makes them."""
        b = past_hidden.shape[0]
        kv = _GrowingKV(b, past_hidden.device)
        x = torch.stack([past_hidden, first], dim=1)  # [B, 2, D]
        codes, total = [], torch.zeros_like(first)
        for j in range(self.groups - 1):
            kv.advance(x.shape[1])
            h = self.model(x, kv.positions, kv)
            code = _pick(self.lm_head[j](h[:, -1]), how)  # [B]
            codes.append(code)
            x = self.model.codec_embedding[j](code)[:, None]  # [B, 1, D]
            total = total + x[:, 0]
        return torch.stack(codes, dim=1), total


# -- the talker ---------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TalkerTokens:
    """The talker's codec special ids (its own vocabulary)."""

    codec_eos: int
    codec_pad: int
    codec_bos: int
    codec_nothink: int
    codec_think_bos: int
    codec_think_eos: int


@dataclass(frozen=True, kw_only=True)
class ChatTokens:
    """The chat template's ids the talker reads the conversation by (top-level ``config.json``)."""

    im_start: int
    im_end: int
    user: int
    assistant: int
    system: int
    tts_pad: int
    tts_bos: int
    tts_eos: int


@dataclass
class TalkerRow:
    """One request's talker inputs and record (``ARLoopState.lm_inputs``). ``trailing`` grows as the
    thinker's stream brings its positions (``extend``); ``complete`` once its end (``tts_eos``) is in."""

    prompt_embeds: torch.Tensor  # [P, D] the talker's prompt (user turns + assistant opening), projected
    trailing: torch.Tensor  # [R, D] what generated position P + k adds (k >= R once complete: ``pad``)
    pad: torch.Tensor  # [D] text_projection(embed(tts_pad))
    sampling: PredictorSampling
    complete: bool = True
    rope: PromptRope | None = None  # the talker prompt's 3-D positions (an image in a user turn); None: 1-D
    prompt_len: int = field(init=False)
    last_hidden: torch.Tensor | None = None  # [D] the talker's normed hidden state at its last forwarded position
    frames: list[list[int]] = field(default_factory=list)  # frame k: [codebook 0, residual 1 .. G-1]
    frame_embeds: list[torch.Tensor] = field(default_factory=list)  # frame k's summed codebook embeddings [D]
    streamed: int = 0  # frames handed on (codec_stream)
    _buffer: torch.Tensor | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_len = int(self.prompt_embeds.shape[0])

    @property
    def fed(self) -> int:
        """Text rows received so far (``omniloop.models.omni.talker.FedRow``)."""
        return int(self.trailing.shape[0])

    def extend(self, rows: torch.Tensor) -> None:
        """Append ``rows [n, D]`` to ``trailing`` (amortized O(n): grown by doubling)."""
        self.trailing, self._buffer = append_rows(self.trailing, self._buffer, rows)

    def text_row(self, k: int) -> torch.Tensor:
        return self.trailing[k] if k < self.trailing.shape[0] else self.pad


class TalkerDecoder(Qwen3Decoder):
    def __init__(self, c: Qwen3DecoderConfig) -> None:
        super().__init__(c)
        self.codec_embedding = nn.Embedding(c.vocab_size, c.hidden_size)


class ResizeMLP(nn.Module):
    """``text_projection`` / ``hidden_projection``: thinker width -> talker width."""

    def __init__(self, thinker_hidden: int, intermediate: int, hidden: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(thinker_hidden, intermediate, bias=True)
        self.linear_fc2 = nn.Linear(intermediate, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(torch.nn.functional.silu(self.linear_fc1(x)))


class Qwen3OmniTalker(nn.Module):
    """transformers' ``talker``: ``text_projection`` / ``hidden_projection`` + ``model`` (MoE) +
    ``codec_head`` + ``code_predictor``.

    Its logits of the top 1024 codec ids other than the codec end are -inf: transformers'
    ``generate`` passes them as ``suppress_tokens`` (control ids, never spoken)."""

    def __init__(self, c: Qwen3DecoderConfig, predictor: Qwen3DecoderConfig, *, thinker_hidden: int, groups: int,
                 tokens: TalkerTokens, chat: ChatTokens, voices: Mapping[str, int], spatial_merge_size: int = 2,
                 position_id_per_seconds: int = 25) -> None:
        super().__init__()
        self.config = c
        # how its prompt's image positions are laid out (talker_config: transformers' get_rope_index)
        self.spatial_merge_size, self.position_id_per_seconds = spatial_merge_size, position_id_per_seconds
        self.tokens = tokens
        self.chat = chat  # the conversation's ids its prompt is built by
        self.voices = dict(voices)  # name (lower case) -> the codec id that selects it
        self.groups = groups
        self.text_projection = ResizeMLP(thinker_hidden, c.intermediate_size, c.hidden_size)
        self.hidden_projection = ResizeMLP(thinker_hidden, c.intermediate_size, c.hidden_size)
        self.model = TalkerDecoder(c)
        self.codec_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        self.code_predictor = CodePredictor(predictor, groups)

    @property
    def dtype(self) -> torch.dtype:
        return self.codec_head.weight.dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self.config.kv_layout

    def activation_bytes(self, num_tokens: int, context: int) -> int:
        return _activation_bytes(self.config, self.dtype, num_tokens, context)

    def codec_embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.codec_embedding(ids)

    def _new_frames(self, ids: torch.Tensor, positions: Sequence[int], rows: Sequence[TalkerRow]) -> None:
        """The code predictor over every row whose forward reaches a frame not yet recorded
        (a decode step's codebook-0 id): the rows' residual codes and summed embeddings, batched."""
        new = [i for i, (p, r) in enumerate(zip(positions, rows)) if p >= r.prompt_len + len(r.frames)]
        if not new:
            return
        for i in new:
            assert positions[i] == rows[i].prompt_len + len(rows[i].frames) and rows[i].last_hidden is not None, (
                "a frame's codebook-0 id is forwarded once its predecessor's hidden state is recorded")
        first = self.codec_embed(ids[new, -1])  # [N, D]
        past = torch.stack([cast(torch.Tensor, rows[i].last_hidden) for i in new])
        residual, embeds = self.code_predictor(past, first, [rows[i].sampling for i in new])
        for n, i in enumerate(new):
            rows[i].frames.append([int(ids[i, -1])] + residual[n].tolist())
            rows[i].frame_embeds.append(first[n] + embeds[n])

    def _row_embeds(self, positions: Sequence[int], row: TalkerRow) -> torch.Tensor:
        """One row's inputs ``[L, D]`` at ``positions``: the prompt's, else frame ``k``'s
        codebook embeddings + text row ``k``."""
        p = row.prompt_len
        out = [row.prompt_embeds[positions[0]:min(positions[-1] + 1, p)]]  # [<= L, D]
        out += [(row.frame_embeds[q - p] + row.text_row(q - p))[None] for q in positions if q >= p]
        return torch.cat(out)

    def forward(self, input_ids: torch.Tensor, *, kv: KVCacheView | None = None, logits_to_keep: int = 0,
                lm_inputs: Sequence[TalkerRow | None] | None = None) -> torch.Tensor:
        """``input_ids [B, L]`` codebook-0 ids -> codec logits ``[B, L', vocab]`` (fp32)."""
        rows = [r for r in lm_inputs or () if r is not None]
        assert len(rows) == input_ids.shape[0], "every talker row needs its TalkerRow"
        positions = kv_positions(input_ids, kv)
        starts = list(kv.starts) if kv is not None and kv.starts is not None else [0] * len(rows)
        length = input_ids.shape[1]
        self._new_frames(input_ids, [s + length - 1 for s in starts], rows)
        embeds = torch.stack([self._row_embeds(range(s, s + length), r) for s, r in zip(starts, rows)])
        rope = mixed_rope(positions, [r.rope for r in rows], starts)  # [B, L], or [3, B, L] with an image
        h = self.model(embeds, rope, kv)  # [B, L, D]
        for r, s, last in zip(rows, starts, h[:, -1]):
            if s + length >= r.prompt_len + len(r.frames):  # the row's newest position (a re-prefill recomputes it)
                r.last_hidden = last
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self._codec_logits(h)

    def _codec_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h [..., D]`` -> fp32 codec logits, the top 1024 ids but the codec end -inf."""
        logits = self.codec_head(h).float()
        eos = logits[..., self.tokens.codec_eos].clone()
        logits[..., max(logits.shape[-1] - 1024, 0):] = float("-inf")
        logits[..., self.tokens.codec_eos] = eos
        return logits

    # -- a decode step replayed from a CUDA graph (pipeline/loops/ar_graphs.py: GraphStepLM) --
    def graph_step_inputs(self, ids: torch.Tensor, starts: Sequence[int],
                          rows: Sequence[TalkerRow]) -> dict[str, torch.Tensor] | None:
        """Eager, before the captured part: the code predictor over each row's new frame (its
        sampling draws from the row's generator, its codes are read on the host), then every
        row's input ``{"embeds": [n, 1, D]}`` (the frame's codebook embeddings + its text row)
        and ``{"delta": [n]}``; None when a row is not past its prompt."""
        delta = decode_rope_deltas(starts, [r.rope for r in rows], ids.device)
        if delta is None or any(s < r.prompt_len for s, r in zip(starts, rows)):
            return None
        self._new_frames(ids, starts, rows)
        embeds = torch.stack([self._row_embeds(range(s, s + 1), r) for s, r in zip(starts, rows)])
        return {"embeds": embeds, "delta": delta}

    def graph_step(self, ids: torch.Tensor, kv: KVCacheView,
                   inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``inputs["embeds"] [B, 1, D]`` -> fp32 codec logits ``[B, V]`` and the normed hidden
        states ``[B, D]`` (each row's ``last_hidden``, the next frame's code predictor input)."""
        h = self.model(inputs["embeds"], delta_planes(kv.positions, inputs["delta"]), kv)[:, -1]
        return self._codec_logits(h), h

    def graph_step_record(self, rows: Sequence[TalkerRow], starts: Sequence[int], hidden: torch.Tensor) -> None:
        for row, last in zip(rows, hidden):
            row.last_hidden = last
