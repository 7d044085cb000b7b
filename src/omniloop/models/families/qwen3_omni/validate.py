"""Admission checks of a Qwen3-Omni request: what a text LM checks (``make_ar_validator``);
text and audio parts (audio in a conversation only, with the checkpoint's audio encoder and
feature extractor, each decodable within the extractor's window; image and video parts are
refused, naming the field: the vision encoder is not implemented); the prompt with every audio
placeholder expanded within the context and the KV pool; a spoken answer only for a
conversation (the talker speaks the assistant turn the chat template opens)."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.families.qwen3_omni.weights import Omni3Config
from omniloop.models.omni.thinker import wants_speech
from omniloop.models.omni.audio_prompt import audio_parts, count_placeholders, decode_audio, frames_of
from omniloop.pipeline.loops.ar import check_context, make_ar_validator
from omniloop.pipeline.stages.chat import chat_ids, chat_messages, is_chat
from omniloop.request import InvalidRequest, OmniRequest


def make_omni3_validator(tokenizer: Any, config: Omni3Config, *, pool: BlockPool, audio_tower: Any = None,
                         feature_extractor: Any = None) -> Callable[[OmniRequest], OmniRequest]:
    text = make_ar_validator(tokenizer, vocab_size=config.thinker.vocab_size,
                             max_context=config.thinker.max_position_embeddings, pool=pool)

    def check_audio(request: OmniRequest) -> None:
        parts = audio_parts(request)
        if not parts:
            return
        field = f"inputs[{parts[0][0]}]"
        if not is_chat(request):
            raise InvalidRequest(f"{field}: audio goes into a conversation (text parts with roles), not a raw prompt",
                                 hint="give the text parts a role (user)", fields=(field,))
        for name, loaded in (("thinker.audio_tower.* weights", audio_tower),
                             ("preprocessor_config.json (its WhisperFeatureExtractor)", feature_extractor)):
            if loaded is None:
                raise InvalidRequest(f"{field}: this checkpoint has no {name}, so it takes no audio", fields=(field,),
                                     hint="send text only, or load the full Qwen3-Omni folder")
        ids = chat_ids(tokenizer, chat_messages(request))
        count_placeholders(ids, config.audio_token_id, len(parts), "audio")
        length = len(ids) + sum(audio_tower.tokens(frames_of(feature_extractor, decode_audio(i, p, feature_extractor))) - 1
                                for i, p in parts)
        check_context(length, request.sampling.max_tokens, config.thinker.max_position_embeddings)
        pool.check_fits(length + request.sampling.max_tokens)

    def validate(request: OmniRequest) -> OmniRequest:
        media = [(i, p.kind) for i, p in enumerate(request.inputs) if p.kind not in ("text", "audio")]
        if media:
            field = f"inputs[{media[0][0]}]"
            raise InvalidRequest(f"{field}: a {media[0][1]} part; this Qwen3-Omni build reads text and audio (its vision "
                                 "encoder is not implemented)", hint="send text and audio parts only", fields=(field,))
        if wants_speech(request):
            if not config.speaks:
                raise InvalidRequest("outputs.modalities names audio, but this checkpoint has no talker / code2wav "
                                     "(enable_audio_output=false)", hint="ask for text only",
                                     fields=("outputs.modalities",))
            if not is_chat(request):
                raise InvalidRequest("a spoken answer speaks the assistant turn of a conversation; this request is a "
                                     "raw prompt", hint="give the text parts a role (user)", fields=("inputs",))
        request = text(request)
        check_audio(request)
        return request

    return validate
