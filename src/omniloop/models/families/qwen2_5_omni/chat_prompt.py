"""The ``chat`` node of Qwen2.5-Omni: the conversation through the chat template; with audio or
image parts, their encoders' embeddings by prompt position (:class:`MediaPromptTokens`, the
thinker loop's ``lm_inputs``) and, with images, the 3-D rotary positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omniloop.models.families.qwen2_5_omni.audio_prompt import (
    audio_embeds, audio_parts, count_placeholders, decode_audio, expand_placeholders,
)
from omniloop.models.families.qwen2_5_omni.image_prompt import image_embeds, image_parts, process_image, rope_positions
from omniloop.models.families.qwen2_5_omni.media import MediaEmbeds, MediaPromptTokens
from omniloop.pipeline.stages.chat import ChatPrompt, chat_ids, chat_messages
from omniloop.pipeline.state import RequestState, StageContext


def media_embeds(ids: Sequence[int], runs: dict[int, list[torch.Tensor]], device: torch.device) -> MediaEmbeds:
    """``ids`` (placeholders expanded) + each placeholder token's embeddings in prompt order ->
    one table whose rows follow the prompt (``index[p]``: the row at position ``p``)."""
    order = {token: iter(torch.cat(embeds)) for token, embeds in runs.items() if embeds}
    rows: list[torch.Tensor] = []
    index: list[int] = []
    for t in ids:
        if t in order:
            index.append(len(rows))
            rows.append(next(order[t]))
        else:
            index.append(-1)
    return MediaEmbeds(index=torch.tensor(index, device=device), embeds=torch.stack(rows))


@dataclass
class OmniChatPrompt(ChatPrompt):
    audio_tower: str = "audio_tower"
    feature_extractor: str = "feature_extractor"
    vision_tower: str = "vision_tower"
    image_processor: str = "image_processor"
    audio_token_id: int = -1  # the checkpoint's <|AUDIO|> / <|IMAGE|> ids (set at build)
    image_token_id: int = -1

    @property
    def components(self) -> tuple[str, ...]:
        return (self.tokenizer, self.audio_tower, self.feature_extractor, self.vision_tower, self.image_processor)

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ids = chat_ids(ctx.component(self.tokenizer), chat_messages(state.request, self.system_prompt))
        sounds, pictures = audio_parts(state.request), image_parts(state.request)
        if not sounds and not pictures:
            super().forward(ctx, state)
            return
        runs: dict[int, list[torch.Tensor]] = {}
        grids: list[tuple[int, int, int]] = []
        if sounds:
            fe = ctx.component(self.feature_extractor)
            count_placeholders(ids, self.audio_token_id, len(sounds), "audio")
            runs[self.audio_token_id] = audio_embeds(ctx.component(self.audio_tower), fe,
                                                     [decode_audio(i, p, fe) for i, p in sounds], ctx.device, ctx.dtype)
            ids = expand_placeholders(ids, self.audio_token_id, [e.shape[0] for e in runs[self.audio_token_id]])
        if pictures:
            processor, tower = ctx.component(self.image_processor), ctx.component(self.vision_tower)
            count_placeholders(ids, self.image_token_id, len(pictures), "image")
            images = [process_image(i, p, processor) for i, p in pictures]
            runs[self.image_token_id] = image_embeds(tower, images, ctx.device, ctx.dtype)
            ids = expand_placeholders(ids, self.image_token_id, [e.shape[0] for e in runs[self.image_token_id]])
            grids = [im.grid for im in images]
        media = media_embeds(ids, runs, ctx.device)
        if grids:  # an image makes the positions 3-D (audio alone keeps them 1-D, as transformers does)
            positions, delta = rope_positions(ids, self.image_token_id, grids, ctx.component(self.vision_tower)
                                              .config.spatial_merge_size)
            media.positions, media.delta = positions.to(ctx.device), delta
        ctx.write(state, "prompt_tokens", MediaPromptTokens(token_ids=list(ids), lm_inputs=media))
