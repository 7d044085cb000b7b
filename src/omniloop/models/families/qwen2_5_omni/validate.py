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
from omniloop.models.families.qwen2_5_omni.weights import OmniConfig
from omniloop.models.omni.admission import (
    ThinkerEncoders, make_thinker_checks, refuse_media_outside_a_conversation, refuse_unread_parts,
)
from omniloop.request import OmniRequest


def make_omni_validator(tokenizer: Any, config: OmniConfig, *, pool: BlockPool,
                        encoders: ThinkerEncoders) -> Callable[[OmniRequest], OmniRequest]:
    text, check_media = make_thinker_checks(
        tokenizer, encoders, config, family="Qwen2.5-Omni", pool=pool,
        image_processor="the Qwen2VLImageProcessor keys of preprocessor_config.json")

    def validate(request: OmniRequest) -> OmniRequest:
        refuse_unread_parts(request, "Qwen2.5-Omni")
        refuse_media_outside_a_conversation(request)
        request = text(request)
        check_media(request)
        return request

    return validate
