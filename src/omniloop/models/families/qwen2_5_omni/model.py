"""Qwen2.5-Omni's two AR transformers: the thinker (text LM) and the talker (codec LM).

Both are Qwen2 decoders (``omniloop.models.layers.qwen2_decoder``: GQA with q/k/v biases,
RMSNorm, SwiGLU; transformers' separate q/k/v and gate/up Linears) with multimodal RoPE
(``mrope_section``: the rotary frequencies split into temporal / height / width planes);
module names are transformers' (``model.layers.0.self_attn.q_proj``...), so the checkpoint
loads by stripping the ``thinker.`` / ``talker.`` prefix.

* :class:`OmniThinker` - ``input_ids`` -> text logits; every forward also records each
  row's final (normed) hidden states at their positions into the row's
  :class:`ThinkerRow` (the per-request record the thinker loop keeps): the talker reads them,
  as transformers' ``generate`` reads ``output_hidden_states``.
* :class:`OmniTalker` - codec ids -> codec logits. Its input embedding is not a lookup of the
  ids alone: a prompt position takes the prepared embedding of the thinker's states
  (:class:`TalkerRow.prompt_embeds`) and a generated position ``p`` the codec embedding of
  its id plus the thinker's reply part at ``p - prompt_len`` (the last one repeated), then
  ``thinker_to_talker_proj``. So chunked prefill, batched decode and re-prefill after
  preemption all see exactly the inputs transformers' talker ``generate`` feeds.

Text-only and audio prompts have 1-D positions (the three planes equal), which makes the
multimodal RoPE the plain one; the KV view's positions drive it. A prompt's audio / image
embeddings (``ThinkerRow.media``) replace its placeholder tokens' embeddings by position, and
an image or a video makes its rotary positions 3-D (``media.py``) - the talker's too
(``TalkerRow.rope``: its prompt is the same conversation, as transformers' talker derives it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, cast

import torch
from torch import nn

from omniloop.cache.kv import KVLayout
from omniloop.models.omni.decoder_config import TextDecoderConfig
from omniloop.models.omni.media import PromptRope, decode_rope_deltas, delta_planes, kv_positions, mixed_rope, with_media
from omniloop.models.omni.talker import append_rows
from omniloop.models.omni.thinker import ThinkerModel, ThinkerRow, record_batch, recording_rows
from omniloop.models.layers.mrope import inv_frequencies
from omniloop.models.layers.qwen2_decoder import DecoderDims, DecoderLayer, KVCacheView, RMSNorm, rope_tables
from omniloop.models.layers.run_blocks import run_blocks


@dataclass(frozen=True, kw_only=True)
class DecoderConfig(TextDecoderConfig):
    """One Qwen2 decoder of the omni checkpoint (thinker ``text_config`` or ``talker_config``)."""

    mrope_section: tuple[int, ...]  # always multimodal
    embedding_size: int  # the token embedding width (the talker's is the thinker's hidden size)

    @property
    def decoder_dims(self) -> DecoderDims:
        """One layer's shape, with transformers' separate q/k/v and gate/up Linears (the
        checkpoint loads by prefix stripping alone)."""
        return DecoderDims(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_heads=self.num_attention_heads, num_kv_heads=self.num_key_value_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, fused=False,
        )

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, embedding_size: int | None = None) -> "DecoderConfig":
        if d.get("use_sliding_window"):
            raise ValueError("Qwen2.5-Omni config: use_sliding_window=true is not supported (every released "
                             "checkpoint runs full attention); set it to false")
        return cls(
            **TextDecoderConfig.shared_fields(d, where="Qwen2.5-Omni config", mrope_section=(16, 24, 24)),
            embedding_size=int(embedding_size or d.get("embedding_size") or d["hidden_size"]),
        )


# -- layers -------------------------------------------------------------------------------


def mrope_cos_sin(positions: torch.Tensor, config: DecoderConfig, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions [3, B, L]`` (t, h, w planes) -> ``cos, sin [B, L, 1, D]``: frequency section
    ``i`` of ``mrope_section`` takes plane ``i % 3`` (transformers' ``recomposition_frequencies``)."""
    inv_freq = inv_frequencies(config.head_dim, config.rope_theta, positions.device)  # [D/2] fp32
    freqs = positions[..., None].float() * inv_freq  # [3, B, L, D/2]
    parts = [m[i % 3] for i, m in enumerate(freqs.split(list(config.mrope_section), dim=-1))]
    return rope_tables(torch.cat(parts, dim=-1), dtype)  # from [B, L, D/2]


class Decoder(nn.Module):
    """embed_tokens + layers + norm (transformers' ``...ThinkerTextModel`` / ``...TalkerModel``)."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.embedding_size)
        self.layers = nn.ModuleList(DecoderLayer(c.decoder_dims, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv: KVCacheView | None) -> torch.Tensor:
        """``h [B, L, hidden]`` at ``positions [B, L]`` (or per plane, ``[3, B, L]``) -> normed
        hidden states ``[B, L, hidden]``."""
        planes = positions if positions.dim() == 3 else positions[None].expand(3, -1, -1)
        cos, sin = mrope_cos_sin(planes, self.config, h.dtype)
        return self.norm(run_blocks(cast(Sequence[nn.Module], self.layers), h, cos, sin, kv))


def _starts(ids: torch.Tensor, kv: KVCacheView | None) -> list[int]:
    """Each row's first position as host ints (the KV view keeps them: no device read per row)."""
    if kv is None:
        return [0] * ids.shape[0]
    assert kv.starts is not None, "per-request model inputs need the rows' positions on the host"
    return list(kv.starts)


# -- the thinker ------------------------------------------------------------------------


class OmniThinker(ThinkerModel):
    """transformers' ``thinker`` text path: ``model`` (the decoder) + ``lm_head``."""

    def __init__(self, c: DecoderConfig) -> None:
        super().__init__()
        self.config: DecoderConfig = c
        self.model: Decoder = Decoder(c)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def activation_bytes(self, num_tokens: int, context: int) -> int:
        return self.config.decoder_dims.activation_bytes(self.dtype, num_tokens, context, self.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, *, kv: KVCacheView | None = None, logits_to_keep: int = 0,
                lm_inputs: Sequence[ThinkerRow | None] | None = None) -> torch.Tensor:
        """``input_ids [B, L]`` -> logits ``[B, L', vocab]``; each row's hidden states go to its
        ``lm_inputs`` record (None: not recorded)."""
        positions = kv_positions(input_ids, kv)
        starts = _starts(input_ids, kv) if lm_inputs else []
        media = [None if row is None else row.media for row in lm_inputs or ()]
        embeds, rope = with_media(self.embed(input_ids), positions, starts, media)  # [B, L, hidden]; [B, L] or [3, B, L]
        h = self.model(embeds, rope, kv)  # [B, L, hidden]
        rows = list(lm_inputs or ())
        recording = recording_rows(rows)
        if recording:
            record_batch(rows, recording, starts, h)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self.lm_head(h)

    # -- a decode step replayed from a CUDA graph (pipeline/loops/ar_graphs.py: GraphStepLM; its
    # per-row inputs and record: ThinkerModel) --
    def graph_step(self, ids: torch.Tensor, kv: KVCacheView,
                   inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids [B, 1]`` -> fp32 logits ``[B, V]`` and the final hidden states ``[B, hidden]``
        (what ``forward`` records); ``inputs["delta"] [B]``: each row's rotary offset."""
        h = self.model(self.embed(ids), delta_planes(kv.positions, inputs["delta"]), kv)[:, -1]
        return self.lm_head(h).float(), h


# -- the talker -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TalkerTokens:
    """The talker's special ids: codec ids (its own vocabulary) and text ids (the thinker's)."""

    codec_bos: int
    codec_eos: int
    codec_pad: int
    codec_mask: int
    text_bos: int
    text_eos: int
    text_pad: int



@dataclass
class TalkerRow:
    """One request's talker inputs (``ARLoopState.lm_inputs``), built from the thinker's states."""

    prompt_embeds: torch.Tensor  # [P, thinker_hidden]: prompt position embeddings (codec pad/bos added)
    reply: torch.Tensor  # [R, thinker_hidden]: what generated position P + k adds (k >= R - 1: the last)
    rope: PromptRope | None = None  # the conversation's 3-D positions (an image / a video in it); None: 1-D
    prompt_len: int = field(init=False)
    # streamed from the thinker: ``reply`` is a view of the first rows of this buffer, grown by
    # doubling as the thinker's chunks arrive (``extend``); ``complete`` once its last row came
    _buffer: torch.Tensor | None = field(default=None, init=False, repr=False)
    complete: bool = True

    def __post_init__(self) -> None:
        self.prompt_len = int(self.prompt_embeds.shape[0])

    @property
    def fed(self) -> int:
        """Reply rows received so far (``omniloop.models.omni.talker.FedRow``)."""
        return int(self.reply.shape[0])

    def extend(self, rows: torch.Tensor) -> None:
        """Append ``rows [n, thinker_hidden]`` to ``reply`` (amortized O(n): no copy per row)."""
        self.reply, self._buffer = append_rows(self.reply, self._buffer, rows)


class OmniTalker(nn.Module):
    """transformers' ``talker``: ``thinker_to_talker_proj`` + ``model`` + ``codec_head``.

    Its codec-start logit is -inf: transformers' ``generate`` passes ``suppress_tokens=
    [codec_bos]`` (the talker never emits its start token)."""

    def __init__(self, c: DecoderConfig, tokens: TalkerTokens) -> None:
        super().__init__()
        self.config = c
        self.tokens = tokens
        self.suppress = (tokens.codec_bos,)
        self.thinker_to_talker_proj = nn.Linear(c.embedding_size, c.hidden_size)
        self.model = Decoder(c)
        self.codec_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.codec_head.weight.dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self.config.kv_layout

    def activation_bytes(self, num_tokens: int, context: int) -> int:
        return self.config.decoder_dims.activation_bytes(self.dtype, num_tokens, context, self.config.vocab_size)

    def _row_embeds(self, ids: torch.Tensor, positions: torch.Tensor, row: TalkerRow) -> torch.Tensor:
        """``ids, positions [L]`` of one row -> ``[L, thinker_hidden]`` talker input embeddings:
        the prepared prompt embedding below ``prompt_len``, else the code's embedding plus the
        reply part at ``position - prompt_len`` (the last one once they run out)."""
        in_prompt = (positions < row.prompt_len)[:, None]  # [L, 1]
        prompt = row.prompt_embeds[positions.clamp(max=row.prompt_len - 1)]
        if row.reply.shape[0] == 0:  # streamed: no reply position has come yet (a prefill step)
            return prompt
        reply = row.reply[(positions - row.prompt_len).clamp(0, row.reply.shape[0] - 1)]
        return torch.where(in_prompt, prompt, self.model.embed_tokens(ids) + reply)

    def forward(self, input_ids: torch.Tensor, *, kv: KVCacheView | None = None, logits_to_keep: int = 0,
                lm_inputs: Sequence[TalkerRow | None] | None = None) -> torch.Tensor:
        """``input_ids [B, L]`` codec ids -> codec logits ``[B, L', vocab]`` (fp32)."""
        rows = [r for r in lm_inputs or () if r is not None]
        assert len(rows) == input_ids.shape[0], "every talker row needs its TalkerRow"
        positions = kv_positions(input_ids, kv)
        starts = _starts(input_ids, kv)
        embeds = self._decode_embeds(input_ids, starts, rows)
        if embeds is None:  # a prefill chunk: prompt positions, row by row
            embeds = torch.stack([self._row_embeds(i, p, r) for i, p, r in zip(input_ids, positions, rows)])
        rope = mixed_rope(positions, [r.rope for r in rows], starts)  # [B, L], or [3, B, L] with an image / a video
        h = self.model(self.thinker_to_talker_proj(embeds), rope, kv)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return self._codec_logits(h)

    def _codec_logits(self, h: torch.Tensor) -> torch.Tensor:
        """``h [..., hidden]`` -> fp32 codec logits, the suppressed ids -inf."""
        logits = self.codec_head(h).float()
        for token in self.suppress:  # an int index: a fill, no index tensor to copy to the device
            logits[..., token] = float("-inf")
        return logits

    def _decode_embeds(self, ids: torch.Tensor, starts: Sequence[int], rows: Sequence[TalkerRow]) -> torch.Tensor | None:
        """``ids [B, 1]`` of a decode step whose every row is past its prompt -> ``[B, 1,
        thinker_hidden]``: the codes' embeddings plus each row's reply part (``_step_reply``);
        None for any other forward."""
        if ids.shape[1] != 1 or (reply := self._step_reply(starts, rows)) is None:
            return None
        return self.model.embed_tokens(ids) + reply

    @staticmethod
    def _step_reply(starts: Sequence[int], rows: Sequence[TalkerRow]) -> torch.Tensor | None:
        """A decode step's reply parts ``[B, 1, thinker_hidden]``: each row's at ``start -
        prompt_len`` (the last one once they run out), gathered as views and copied once for the
        batch (what ``_row_embeds`` gives row by row); None when a row is not past its prompt or
        has no reply row yet."""
        if any(s < r.prompt_len or r.reply.shape[0] == 0 for s, r in zip(starts, rows)):
            return None
        reply = torch.cat([r.reply[k:k + 1] for r, k in
                           ((r, min(s - r.prompt_len, r.reply.shape[0] - 1)) for s, r in zip(starts, rows))])  # [B, D]
        return reply[:, None]

    # -- a decode step replayed from a CUDA graph (pipeline/loops/ar_graphs.py: GraphStepLM) --
    def graph_step_inputs(self, ids: torch.Tensor, starts: Sequence[int],
                          rows: Sequence[TalkerRow]) -> dict[str, torch.Tensor] | None:
        """``{"reply": [n, 1, thinker_hidden], "delta": [n]}``, or None (a row not past its prompt)."""
        reply = self._step_reply(starts, rows)
        delta = decode_rope_deltas(starts, [r.rope for r in rows], ids.device)
        return None if reply is None or delta is None else {"reply": reply, "delta": delta}

    def graph_step(self, ids: torch.Tensor, kv: KVCacheView,
                   inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``ids [B, 1]`` codes -> fp32 codec logits ``[B, V]`` and the hidden states ``[B, hidden]``."""
        embeds = self.model.embed_tokens(ids) + inputs["reply"]  # [B, 1, thinker_hidden]
        h = self.model(self.thinker_to_talker_proj(embeds), delta_planes(kv.positions, inputs["delta"]), kv)[:, -1]
        return self._codec_logits(h), h

    def graph_step_record(self, rows: Sequence[TalkerRow], starts: Sequence[int], hidden: torch.Tensor) -> None:
        """The talker records nothing per step."""
