"""The ``chat`` node of Qwen3-Omni: the conversation through the chat template; with audio or image
parts, their encoders' embeddings at their placeholders (``MediaPromptTokens``, the thinker loop's
``lm_inputs``). The template renders ``<|audio_start|><|audio_pad|><|audio_end|>`` per audio part
and ``<|vision_start|><|image_pad|><|vision_end|>`` per image; like the processor, each placeholder
becomes as many as its part has embeddings. Audio keeps the rotary positions 1-D (transformers'
``get_rope_index`` numbers an audio's tokens in order); an image makes them 3-D, and brings its
DeepStack features (``MediaEmbeds.deepstack``, added after the thinker's first layers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniloop.models.families.qwen3_omni.vision import image_embeds
from omniloop.models.omni.audio_prompt import audio_embeds, audio_parts, count_placeholders, decode_audio, expand_placeholders
from omniloop.models.omni.image_prompt import VisionRun, image_parts, process_image, rope_positions
from omniloop.models.omni.media import MediaPromptTokens, media_embeds
from omniloop.pipeline.stages.chat import ChatPrompt, chat_ids, chat_messages
from omniloop.pipeline.state import RequestState, StageContext


@dataclass
class Omni3ChatPrompt(ChatPrompt):
    audio_tower: str = "audio_tower"
    feature_extractor: str = "feature_extractor"
    vision_tower: str = "vision_tower"
    image_processor: str = "image_processor"
    audio_token_id: int = -1  # the checkpoint's audio / image placeholders (set at build)
    image_token_id: int = -1
    position_id_per_seconds: int = 25  # the temporal plane's positions per second (thinker_config)

    @property
    def components(self) -> tuple[str, ...]:
        return (self.tokenizer, self.audio_tower, self.feature_extractor, self.vision_tower, self.image_processor)

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        sounds, pictures = audio_parts(state.request), image_parts(state.request)
        if not sounds and not pictures:
            super().forward(ctx, state)
            return
        ids = chat_ids(ctx.component(self.tokenizer), chat_messages(state.request, self.system_prompt))
        runs: dict[int, list[torch.Tensor]] = {}  # placeholder token -> each part's embeddings [tokens, D]
        if sounds:
            fe = ctx.component(self.feature_extractor)
            count_placeholders(ids, self.audio_token_id, len(sounds), "audio")
            runs[self.audio_token_id] = audio_embeds(ctx.component(self.audio_tower), fe,
                                                     [decode_audio(i, p, fe) for i, p in sounds], ctx.device, ctx.dtype)
            ids = expand_placeholders(ids, self.audio_token_id, [e.shape[0] for e in runs[self.audio_token_id]])
        deepstack = None
        vision: tuple[VisionRun, ...] = ()
        if pictures:
            count_placeholders(ids, self.image_token_id, len(pictures), "image")
            images = [process_image(i, p, ctx.component(self.image_processor)) for i, p in pictures]
            tower = ctx.component(self.vision_tower)
            runs[self.image_token_id], deepstack = image_embeds(tower, [im.pixels for im in images],
                                                                [im.grid for im in images], ctx.device, ctx.dtype)
            ids = expand_placeholders(ids, self.image_token_id, [e.shape[0] for e in runs[self.image_token_id]])
            vision = tuple(VisionRun(self.image_token_id, im.grid) for im in images)
        media = media_embeds(ids, runs, ctx.device)
        if vision:
            # media_embeds orders the table by prompt position: each image's DeepStack rows go where its embeddings went
            visual = torch.tensor([t == self.image_token_id for t in ids], device=ctx.device)[media.index >= 0]  # [N]
            assert deepstack is not None, "images bring their DeepStack features"
            table = deepstack.new_zeros(deepstack.shape[0], media.embeds.shape[0], deepstack.shape[2])
            table[:, visual] = deepstack  # images in prompt order, as the ViT ran them
            merge = ctx.component(self.vision_tower).config.spatial_merge_size
            positions, media.delta = rope_positions(ids, vision, merge, self.position_id_per_seconds)
            media.positions, media.deepstack, media.visual, media.runs = positions.to(ctx.device), table, visual, vision
        ctx.write(state, "prompt_tokens", MediaPromptTokens(token_ids=list(ids), lm_inputs=media))
