"""Admission checks of a Qwen2.5-Omni request: what a text LM checks (``make_ar_validator``);
audio parts only in a conversation, only with the checkpoint's audio encoder and feature
extractor, each decodable and within the extractor's window (decoding stops at the cap); the
prompt with every audio's placeholders expanded within the context and the KV pool. Images
and video are refused (the vision encoder is not run by this family yet)."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.families.qwen2_5_omni.audio_encoder import OmniAudioEncoder, audio_tokens
from omniloop.models.families.qwen2_5_omni.audio_prompt import audio_parts, count_placeholders, decode_audio, frames_of
from omniloop.models.families.qwen2_5_omni.weights import OmniConfig
from omniloop.pipeline.loops.ar import check_context, make_ar_validator
from omniloop.pipeline.stages.chat import chat_ids, chat_messages, is_chat
from omniloop.request import InvalidRequest, OmniRequest


def make_omni_validator(tokenizer: Any, config: OmniConfig, *, pool: BlockPool, audio_tower: OmniAudioEncoder | None = None,
                        feature_extractor: Any = None) -> Callable[[OmniRequest], OmniRequest]:
    text = make_ar_validator(tokenizer, vocab_size=config.thinker.vocab_size,
                             max_context=config.thinker.max_position_embeddings, pool=pool)

    def check_audio(request: OmniRequest) -> None:
        parts = audio_parts(request)
        if not parts:
            return
        field = f"inputs[{parts[0][0]}]"
        if audio_tower is None or feature_extractor is None:
            missing = "thinker.audio_tower.* weights" if audio_tower is None else "preprocessor_config.json (its " \
                "WhisperFeatureExtractor)"
            raise InvalidRequest(f"{field}: this checkpoint has no {missing}, so it takes no audio", fields=(field,),
                                 hint="send text only, or load the full Qwen2.5-Omni folder")
        if not is_chat(request):
            raise InvalidRequest(f"{field}: audio goes into a conversation (text parts with roles), not a raw prompt",
                                 hint="give the text parts a role (user)", fields=(field,))
        extra = sum(audio_tokens(frames_of(feature_extractor, decode_audio(i, p, feature_extractor))) - 1
                    for i, p in parts)
        ids = chat_ids(tokenizer, chat_messages(request))
        count_placeholders(request, ids, config.audio_token_id)
        check_context(len(ids) + extra, request.sampling.max_tokens, config.thinker.max_position_embeddings)
        pool.check_fits(len(ids) + extra + request.sampling.max_tokens)

    def validate(request: OmniRequest) -> OmniRequest:
        media = sorted({p.kind for p in request.inputs if p.kind not in ("text", "audio")})
        if media:
            raise InvalidRequest(f"inputs carry {media} parts; this Qwen2.5-Omni deployment reads text and audio (its "
                                 "vision encoder is not run yet)", hint="send text and audio parts only",
                                 fields=("inputs",))
        request = text(request)
        check_audio(request)
        return request

    return validate
