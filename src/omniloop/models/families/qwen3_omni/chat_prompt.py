"""The ``chat`` node of Qwen3-Omni: the conversation through the chat template; with audio parts,
the audio encoder's embeddings at their placeholders (``MediaPromptTokens``, the thinker loop's
``lm_inputs``). The template renders ``<|audio_start|><|audio_pad|><|audio_end|>`` per audio part;
like the processor, each placeholder becomes as many as its audio has embeddings. Audio keeps
the rotary positions 1-D (transformers' ``get_rope_index`` numbers an audio's tokens in order)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniloop.models.omni.audio_prompt import audio_embeds, audio_parts, count_placeholders, decode_audio, expand_placeholders
from omniloop.models.omni.media import MediaPromptTokens, media_embeds
from omniloop.pipeline.stages.chat import ChatPrompt, chat_ids, chat_messages
from omniloop.pipeline.state import RequestState, StageContext


@dataclass
class AudioChatPrompt(ChatPrompt):
    audio_tower: str = "audio_tower"
    feature_extractor: str = "feature_extractor"
    audio_token_id: int = -1  # the checkpoint's audio placeholder (set at build)

    @property
    def components(self) -> tuple[str, ...]:
        return (self.tokenizer, self.audio_tower, self.feature_extractor)

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        sounds = audio_parts(state.request)
        if not sounds:
            super().forward(ctx, state)
            return
        ids = chat_ids(ctx.component(self.tokenizer), chat_messages(state.request, self.system_prompt))
        fe = ctx.component(self.feature_extractor)
        count_placeholders(ids, self.audio_token_id, len(sounds), "audio")
        audios = [decode_audio(i, p, fe) for i, p in sounds]
        embeds = audio_embeds(ctx.component(self.audio_tower), fe, audios, ctx.device, ctx.dtype)
        ids = expand_placeholders(ids, self.audio_token_id, [e.shape[0] for e in embeds])
        media = media_embeds(ids, {self.audio_token_id: embeds}, ctx.device)
        ctx.write(state, "prompt_tokens", MediaPromptTokens(token_ids=list(ids), lm_inputs=media))
