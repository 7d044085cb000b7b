"""The ``chat`` node both omni families build on (Qwen2.5-Omni, Qwen3-Omni): the components it
reads (the tokenizer, the audio and vision encoders and their preprocessors), the checkpoint's
placeholder ids set at build, its node params (``ChatParams``) and the audio step of its forward
(audio parts and videos' soundtracks through the audio encoder). Each family's node subclasses
:class:`MediaChatPrompt` and writes ``forward``: how its vision tower embeds images and videos and
how it lays their rotary positions out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from omniloop.models.omni.video_prompt import ChatParams, embed_audio
from omniloop.pipeline.stages.chat import ChatPrompt
from omniloop.pipeline.state import RequestState, StageContext
from omniloop.request import AudioPart, VideoPart


@dataclass
class MediaChatPrompt(ChatPrompt):
    audio_tower: str = "audio_tower"
    feature_extractor: str = "feature_extractor"
    vision_tower: str = "vision_tower"
    image_processor: str = "image_processor"
    video_processing: str = "video_processing"
    audio_token_id: int = -1  # the checkpoint's audio / image / video placeholders (set at build)
    image_token_id: int = -1
    video_token_id: int = -1
    # a video's soundtrack between these two: <|audio_bos|> / <|audio_eos|> (Qwen2.5-Omni),
    # <|audio_start|> / <|audio_end|> (Qwen3-Omni)
    audio_start_token_id: int = -1
    audio_end_token_id: int = -1
    params_schema = ChatParams

    @property
    def components(self) -> tuple[str, ...]:
        return (self.tokenizer, self.audio_tower, self.feature_extractor, self.vision_tower, self.image_processor,
                self.video_processing)

    @staticmethod
    def soundtracks(ctx: StageContext, state: RequestState,
                    clips: Sequence[tuple[int, VideoPart]]) -> Sequence[tuple[int, VideoPart]]:
        """The video parts read with their soundtracks: all of them with ``use_audio_in_video``, else none."""
        knobs = state.node_params.get(ctx.node)
        return clips if isinstance(knobs, ChatParams) and knobs.use_audio_in_video else []

    def embed_sounds(self, ctx: StageContext, ids: list[int], sounds: Sequence[tuple[int, AudioPart]],
                     with_sound: Sequence[tuple[int, VideoPart]],
                     runs: dict[int, list[torch.Tensor]]) -> tuple[list[int], dict[int, int]]:
        """The audio parts and the ``with_sound`` videos' soundtracks through the audio encoder (none:
        nothing runs) -> ``ids`` with each audio placeholder expanded, and each soundtrack's token
        count by video part; their embeddings ``[tokens, D]`` go to ``runs[audio_token_id]``."""
        if not sounds and not with_sound:
            return ids, {}
        ids, runs[self.audio_token_id], heard = embed_audio(
            ids, self.audio_token_id, sounds, with_sound, ctx.component(self.audio_tower),
            ctx.component(self.feature_extractor), ctx.device, ctx.dtype)
        return ids, heard
