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
from omniloop.models.omni.admission import (
    ThinkerEncoders, make_thinker_checks, refuse_media_outside_a_conversation, refuse_unread_parts,
)
from omniloop.models.omni.thinker import wants_speech
from omniloop.models.omni.video_prompt import heard, video_parts
from omniloop.pipeline.stages.chat import is_chat
from omniloop.request import InvalidRequest, OmniRequest


def make_omni3_validator(tokenizer: Any, config: Omni3Config, *, pool: BlockPool,
                         encoders: ThinkerEncoders) -> Callable[[OmniRequest], OmniRequest]:
    text, check_media = make_thinker_checks(
        tokenizer, encoders, config, family="Qwen3-Omni", pool=pool,
        image_processor="the Qwen2VLImageProcessor keys of preprocessor_config.json")

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
        refuse_media_outside_a_conversation(request)  # after the text checks (a no-op without media)
        check_media(request)
        return request

    return validate
