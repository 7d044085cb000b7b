"""Admission checks of a Qwen2.5-Omni request: what a text LM checks (``make_ar_validator``);
audio, image and video parts only in a conversation, only with the checkpoint's encoder and its
preprocessor, each decodable (audio within the feature extractor's window; decoding stops at
the cap); the prompt with every placeholder expanded within the context and the KV pool.
Video parts: their placeholders counted from the container's header (frames sampled at 2 fps,
each frame's resized size), refused past the duration / frame-size limits before any frame
decodes."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.families.qwen2_5_omni.audio_encoder import OmniAudioEncoder, audio_tokens
from omniloop.models.omni.admission import MEDIA, refuse_media_outside_a_conversation, refuse_unread_parts
from omniloop.models.omni.audio_prompt import audio_parts, count_placeholders, decode_audio, frames_of
from omniloop.models.omni.image_prompt import image_parts, process_image
from omniloop.models.omni.video_prompt import VideoProcessing, require, video_extra_tokens
from omniloop.models.families.qwen2_5_omni.vision_encoder import OmniVisionEncoder
from omniloop.models.families.qwen2_5_omni.weights import OmniConfig
from omniloop.pipeline.loops.ar import check_context, make_ar_validator
from omniloop.pipeline.stages.chat import chat_ids, chat_messages
from omniloop.request import OmniRequest


def make_omni_validator(tokenizer: Any, config: OmniConfig, *, pool: BlockPool, audio_tower: OmniAudioEncoder | None = None,
                        feature_extractor: Any = None, vision_tower: OmniVisionEncoder | None = None,
                        image_processor: Any = None,
                        video_processing: VideoProcessing | None = None) -> Callable[[OmniRequest], OmniRequest]:
    text = make_ar_validator(tokenizer, vocab_size=config.thinker.vocab_size,
                             max_context=config.thinker.max_position_embeddings, pool=pool)

    def audio_extra(request: OmniRequest, ids: list[int]) -> int:
        parts = audio_parts(request)
        if not parts:
            return 0
        field = f"inputs[{parts[0][0]}]"
        require(field, "audio", "Qwen2.5-Omni", ("thinker.audio_tower.* weights", audio_tower),
                ("preprocessor_config.json (its WhisperFeatureExtractor)", feature_extractor))
        count_placeholders(ids, config.audio_token_id, len(parts), "audio")
        return sum(audio_tokens(frames_of(feature_extractor, decode_audio(i, p, feature_extractor))) - 1
                   for i, p in parts)

    def image_extra(request: OmniRequest, ids: list[int]) -> int:
        parts = image_parts(request)
        if not parts:
            return 0
        field = f"inputs[{parts[0][0]}]"
        require(field, "images", "Qwen2.5-Omni", ("thinker.visual.* weights", vision_tower),
                ("image processor (the Qwen2VLImageProcessor keys of preprocessor_config.json)", image_processor))
        assert vision_tower is not None  # require refused the request otherwise
        count_placeholders(ids, config.image_token_id, len(parts), "image")
        merge = vision_tower.config.spatial_merge_size
        return sum(process_image(i, p, image_processor).tokens(merge) - 1 for i, p in parts)

    def video_extra(request: OmniRequest, ids: list[int]) -> int:
        return video_extra_tokens(request, ids, video_token_id=config.video_token_id, vision_tower=vision_tower,
                                  video_processing=video_processing, audio_tower=audio_tower,
                                  feature_extractor=feature_extractor, audio_tokens=audio_tokens, family="Qwen2.5-Omni")

    def check_media(request: OmniRequest) -> None:
        if not any(p.kind in MEDIA for p in request.inputs):
            return
        ids = chat_ids(tokenizer, chat_messages(request))
        length = len(ids) + audio_extra(request, ids) + image_extra(request, ids) + video_extra(request, ids)
        check_context(length, request.sampling.max_tokens, config.thinker.max_position_embeddings)
        pool.check_fits(length + request.sampling.max_tokens)

    def validate(request: OmniRequest) -> OmniRequest:
        refuse_unread_parts(request, "Qwen2.5-Omni")
        refuse_media_outside_a_conversation(request)
        request = text(request)
        check_media(request)
        return request

    return validate
