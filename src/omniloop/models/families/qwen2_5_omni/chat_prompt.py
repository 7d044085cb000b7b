"""The ``chat`` node of Qwen2.5-Omni: the conversation through the chat template; with audio,
image or video parts, their encoders' embeddings by prompt position (:class:`MediaPromptTokens`, the
thinker loop's ``lm_inputs``) and, with images or videos, the 3-D rotary positions."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from omniloop.models.omni.audio_prompt import audio_parts, count_placeholders, expand_placeholders, replace_placeholders
from omniloop.models.omni.image_prompt import (
    POSITION_PER_SECOND, VisionRun, image_parts, process_image, rope_positions, video_ids,
)
from omniloop.models.families.qwen2_5_omni.vision_encoder import image_embeds
from omniloop.models.omni.media import MediaPromptTokens, media_embeds
from omniloop.models.omni.chat_prompt import MediaChatPrompt
from omniloop.models.omni.video_prompt import process_video, video_parts
from omniloop.pipeline.stages.chat import chat_ids, chat_messages
from omniloop.pipeline.state import RequestState, StageContext


@dataclass
class OmniChatPrompt(MediaChatPrompt):
    """Qwen2.5-Omni's chat node: images and videos through its ViT, 25 temporal positions per second."""

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        ids = chat_ids(ctx.component(self.tokenizer), chat_messages(state.request, self.system_prompt))
        sounds, pictures, clips = audio_parts(state.request), image_parts(state.request), video_parts(state.request)
        if not sounds and not pictures and not clips:
            super().forward(ctx, state)
            return
        with_sound = self.soundtracks(ctx, state, clips)
        runs: dict[int, list[torch.Tensor]] = {}  # placeholder token -> each part's embeddings [tokens, D], prompt order
        # heard: a video part read with its soundtrack -> the soundtrack's tokens
        ids, heard = self.embed_sounds(ctx, ids, sounds, with_sound, runs)
        vision: list[VisionRun] = []
        if pictures:
            count_placeholders(ids, self.image_token_id, len(pictures), "image")
            images = [process_image(i, p, ctx.component(self.image_processor)) for i, p in pictures]
            runs[self.image_token_id] = image_embeds(ctx.component(self.vision_tower), images, ctx.device, ctx.dtype)
            ids = expand_placeholders(ids, self.image_token_id, [e.shape[0] for e in runs[self.image_token_id]])
            vision += [VisionRun(self.image_token_id, im.grid) for im in images]
        if clips:
            count_placeholders(ids, self.video_token_id, len(clips), "video")
            videos = [process_video(i, p, ctx.component(self.video_processing)) for i, p in clips]
            runs[self.video_token_id] = image_embeds(ctx.component(self.vision_tower), videos, ctx.device, ctx.dtype)
            clip_runs = [VisionRun(self.video_token_id, v.grid, v.seconds_per_grid, heard.get(v.part, 0)) for v in videos]
            merge = ctx.component(self.vision_tower).config.spatial_merge_size
            ids = replace_placeholders(ids, self.video_token_id, [
                video_ids(r, merge, POSITION_PER_SECOND, video_token=self.video_token_id, audio_token=self.audio_token_id,
                          audio_start=self.audio_start_token_id, audio_end=self.audio_end_token_id) for r in clip_runs])
            vision += clip_runs
        media = media_embeds(ids, runs, ctx.device)
        if vision:  # an image or a video makes the positions 3-D (audio alone keeps them 1-D, as transformers does)
            merge = ctx.component(self.vision_tower).config.spatial_merge_size
            positions, media.delta = rope_positions(ids, vision, merge)
            media.positions = positions.to(ctx.device)
        ctx.write(state, "prompt_tokens", MediaPromptTokens(token_ids=list(ids), lm_inputs=media))
