"""The ``chat`` node of Qwen3-Omni: the conversation through the chat template; with audio, image or
video parts, their encoders' embeddings at their placeholders (``MediaPromptTokens``, the thinker
loop's ``lm_inputs``). The template renders ``<|audio_start|><|audio_pad|><|audio_end|>`` per audio
part, ``<|vision_start|><|image_pad|><|vision_end|>`` per image and ``<|vision_start|><|video_pad|>
<|vision_end|>`` per video; like the processor, each placeholder becomes as many as its part has
embeddings (a video read with its soundtrack, ``node_params["chat"].use_audio_in_video``:
``<|audio_start|>``, its cells' and the soundtrack's placeholders merged in time order,
``<|audio_end|>``). Audio keeps the rotary positions 1-D (transformers' ``get_rope_index`` numbers
an audio's tokens in order); an image or a video makes them 3-D, and brings its DeepStack features
(``MediaEmbeds.deepstack``, added after the thinker's first layers at every image and video cell)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from omniloop.models.families.qwen3_omni.vision import image_embeds
from omniloop.models.omni.audio_prompt import audio_parts, count_placeholders, expand_placeholders, replace_placeholders
from omniloop.models.omni.image_prompt import VisionRun, image_parts, process_image, rope_positions, video_ids
from omniloop.models.omni.media import MediaEmbeds, MediaPromptTokens, media_embeds
from omniloop.models.omni.chat_prompt import MediaChatPrompt
from omniloop.models.omni.video_prompt import process_video, video_parts
from omniloop.pipeline.stages.chat import chat_ids, chat_messages
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import InvalidRequest


@dataclass
class Omni3ChatPrompt(MediaChatPrompt):
    """Qwen3-Omni's chat node: images and videos through its ViT with DeepStack features."""

    position_id_per_seconds: int = 25  # the temporal plane's positions per second (thinker_config)

    @torch.inference_mode()
    def forward(self, ctx: StageContext, state: RequestState) -> None:
        sounds, pictures, clips = audio_parts(state.request), image_parts(state.request), video_parts(state.request)
        if not sounds and not pictures and not clips:
            super().forward(ctx, state)
            return
        ids = chat_ids(ctx.component(self.tokenizer), chat_messages(state.request, self.system_prompt))
        with_sound = self.soundtracks(ctx, state, clips)
        if with_sound and self.audio_end_token_id < 0:
            raise InvalidRequest("node_params.chat.use_audio_in_video: this checkpoint's tokenizer has no <|audio_end|> "
                                 "to close a soundtrack with", hint="drop use_audio_in_video",
                                 fields=("node_params.chat.use_audio_in_video",))
        runs: dict[int, list[torch.Tensor]] = {}  # placeholder token -> each part's embeddings [tokens, D]
        # heard: a video part read with its soundtrack -> the soundtrack's tokens
        ids, heard = self.embed_sounds(ctx, ids, sounds, with_sound, runs)
        tower: Any = ctx.component(self.vision_tower) if pictures or clips else None  # the ViT (None: no image or video)
        deepstack: dict[int, torch.Tensor] = {}  # image / video token -> [layers, that kind's cells, D], prompt order
        vision: list[VisionRun] = []
        if pictures:
            count_placeholders(ids, self.image_token_id, len(pictures), "image")
            images = [process_image(i, p, ctx.component(self.image_processor)) for i, p in pictures]
            runs[self.image_token_id], deepstack[self.image_token_id] = image_embeds(
                tower, [im.pixels for im in images], [im.grid for im in images], ctx.device, ctx.dtype)
            ids = expand_placeholders(ids, self.image_token_id, [e.shape[0] for e in runs[self.image_token_id]])
            vision += [VisionRun(self.image_token_id, im.grid) for im in images]
        if clips:  # the ViT's second run (transformers' get_video_features), over every video at once
            count_placeholders(ids, self.video_token_id, len(clips), "video")
            videos = [process_video(i, p, ctx.component(self.video_processing)) for i, p in clips]
            runs[self.video_token_id], deepstack[self.video_token_id] = image_embeds(
                tower, [v.pixels for v in videos], [v.grid for v in videos], ctx.device, ctx.dtype)
            clip_runs = [VisionRun(self.video_token_id, v.grid, v.seconds_per_grid, heard.get(v.part, 0), by_time=True)
                         for v in videos]
            merge = tower.config.spatial_merge_size
            ids = replace_placeholders(ids, self.video_token_id, [
                video_ids(r, merge, self.position_id_per_seconds, video_token=self.video_token_id,
                          audio_token=self.audio_token_id, audio_start=self.audio_start_token_id,
                          audio_end=self.audio_end_token_id) for r in clip_runs])
            vision += clip_runs
        media = media_embeds(ids, runs, ctx.device)
        if vision:
            merge = tower.config.spatial_merge_size
            self._add_deepstack(media, ids, deepstack, ctx.device)
            positions, media.delta = rope_positions(ids, vision, merge, self.position_id_per_seconds)
            media.positions, media.runs = positions.to(ctx.device), tuple(vision)
        ctx.write(state, "prompt_tokens", MediaPromptTokens(token_ids=list(ids), lm_inputs=media))

    @staticmethod
    def _add_deepstack(media: MediaEmbeds, ids: Sequence[int], deepstack: dict[int, torch.Tensor],
                       device: torch.device) -> None:
        """media_embeds orders the table by prompt position: each image's and video's DeepStack rows
        go where its embeddings went (transformers' joint ``visual_pos_masks``; zeros at audio rows)."""
        rows = media.index >= 0
        first = next(iter(deepstack.values()))
        table = first.new_zeros(first.shape[0], media.embeds.shape[0], first.shape[2])  # [layers, N, D]
        visual = torch.zeros(media.embeds.shape[0], dtype=torch.bool, device=device)
        for token, features in deepstack.items():
            mine = torch.tensor([t == token for t in ids], device=device)[rows]  # [N]: this kind's rows
            table[:, mine] = features  # in prompt order, as the ViT ran them
            visual |= mine
        media.deepstack, media.visual = table, visual
