"""Admission checks of a Qwen3-Omni request: what a text LM checks (``make_ar_validator``);
audio, image and video parts only in a conversation, only with the checkpoint's encoder and its
preprocessor, each decodable (audio within the feature extractor's window; a video's
placeholders counted from its container's header, refused past the duration / frame-size limits
before any frame decodes: ``omniloop.models.omni.video_prompt``); the prompt with every
placeholder expanded within the context and the KV pool; a spoken answer only for a
conversation (the talker speaks the assistant turn the chat template opens), and not to a video
read with its soundtrack: transformers 5.25's talker cannot lay that prompt out (its
``get_rope_index`` reads an ``audio_config`` the talker's config lacks), so there is no reference
to match."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.families.qwen3_omni.weights import Omni3Config
from omniloop.models.omni.admission import MEDIA, refuse_media_outside_a_conversation, refuse_unread_parts
from omniloop.models.omni.thinker import wants_speech
from omniloop.models.omni.audio_prompt import audio_parts, count_placeholders, decode_audio, frames_of
from omniloop.models.omni.image_prompt import image_parts, process_image
from omniloop.models.omni.video_prompt import VideoProcessing, heard, require, video_extra_tokens, video_parts
from omniloop.pipeline.loops.ar import check_context, make_ar_validator
from omniloop.pipeline.stages.chat import chat_ids, chat_messages, is_chat
from omniloop.request import InvalidRequest, OmniRequest


def make_omni3_validator(tokenizer: Any, config: Omni3Config, *, pool: BlockPool, audio_tower: Any = None,
                         feature_extractor: Any = None, vision_tower: Any = None,
                         image_processor: Any = None,
                         video_processing: VideoProcessing | None = None) -> Callable[[OmniRequest], OmniRequest]:
    text = make_ar_validator(tokenizer, vocab_size=config.thinker.vocab_size,
                             max_context=config.thinker.max_position_embeddings, pool=pool)

    def audio_extra(request: OmniRequest, ids: list[int]) -> int:
        parts = audio_parts(request)
        if not parts:
            return 0
        require(f"inputs[{parts[0][0]}]", "audio", "Qwen3-Omni", ("thinker.audio_tower.* weights", audio_tower),
                ("preprocessor_config.json (its WhisperFeatureExtractor)", feature_extractor))
        count_placeholders(ids, config.audio_token_id, len(parts), "audio")
        return sum(audio_tower.tokens(frames_of(feature_extractor, decode_audio(i, p, feature_extractor))) - 1
                   for i, p in parts)

    def image_extra(request: OmniRequest, ids: list[int]) -> int:
        parts = image_parts(request)
        if not parts:
            return 0
        require(f"inputs[{parts[0][0]}]", "images", "Qwen3-Omni", ("thinker.visual.* weights", vision_tower),
                ("image processor (the Qwen2VLImageProcessor keys of preprocessor_config.json)", image_processor))
        count_placeholders(ids, config.image_token_id, len(parts), "image")
        merge = vision_tower.config.spatial_merge_size
        return sum(process_image(i, p, image_processor).tokens(merge) - 1 for i, p in parts)

    def video_extra(request: OmniRequest, ids: list[int]) -> int:
        return video_extra_tokens(request, ids, video_token_id=config.video_token_id, vision_tower=vision_tower,
                                  video_processing=video_processing, audio_tower=audio_tower,
                                  feature_extractor=feature_extractor,
                                  audio_tokens=lambda frames: audio_tower.tokens(frames), family="Qwen3-Omni")

    def check_media(request: OmniRequest) -> None:
        if not any(p.kind in MEDIA for p in request.inputs):
            return
        refuse_media_outside_a_conversation(request)
        ids = chat_ids(tokenizer, chat_messages(request))
        length = len(ids) + audio_extra(request, ids) + image_extra(request, ids) + video_extra(request, ids)
        check_context(length, request.sampling.max_tokens, config.thinker.max_position_embeddings)
        pool.check_fits(length + request.sampling.max_tokens)

    def validate(request: OmniRequest) -> OmniRequest:
        refuse_unread_parts(request, "Qwen3-Omni")
        if wants_speech(request):
            clips = video_parts(request)
            if clips and heard(request):
                field = f"inputs[{clips[0][0]}]"
                raise InvalidRequest(f"{field}: a spoken answer to a video read with its soundtrack "
                                     "(use_audio_in_video) is not supported by Qwen3-Omni here",
                                     hint="ask for text only, or drop use_audio_in_video", fields=(field,))
            if not config.speaks:
                raise InvalidRequest("outputs.modalities names audio, but this checkpoint has no talker / code2wav "
                                     "(enable_audio_output=false)", hint="ask for text only",
                                     fields=("outputs.modalities",))
            if not is_chat(request):
                raise InvalidRequest("a spoken answer speaks the assistant turn of a conversation; this request is a "
                                     "raw prompt", hint="give the text parts a role (user)", fields=("inputs",))
        request = text(request)
        check_media(request)
        return request

    return validate
