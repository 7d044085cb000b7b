"""Admission checks of a Qwen3-Omni request: what a text LM checks (``make_ar_validator``);
text parts only (the thinker's audio and vision encoders are not implemented yet, so audio,
image and video parts are refused, naming the field); a spoken answer only for a conversation
(the talker speaks the assistant turn the chat template opens)."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.families.qwen3_omni.weights import Omni3Config
from omniloop.models.omni.thinker import wants_speech
from omniloop.pipeline.loops.ar import make_ar_validator
from omniloop.pipeline.stages.chat import is_chat
from omniloop.request import InvalidRequest, OmniRequest


def make_omni3_validator(tokenizer: Any, config: Omni3Config, *, pool: BlockPool) -> Callable[[OmniRequest], OmniRequest]:
    text = make_ar_validator(tokenizer, vocab_size=config.thinker.vocab_size,
                             max_context=config.thinker.max_position_embeddings, pool=pool)

    def validate(request: OmniRequest) -> OmniRequest:
        media = [(i, p.kind) for i, p in enumerate(request.inputs) if p.kind != "text"]
        if media:
            field = f"inputs[{media[0][0]}]"
            raise InvalidRequest(f"{field}: a {media[0][1]} part; this Qwen3-Omni build reads text only (its audio and "
                                 "vision encoders are not implemented)", hint="send text parts only", fields=(field,))
        if wants_speech(request):
            if not config.speaks:
                raise InvalidRequest("outputs.modalities names audio, but this checkpoint has no talker / code2wav "
                                     "(enable_audio_output=false)", hint="ask for text only",
                                     fields=("outputs.modalities",))
            if not is_chat(request):
                raise InvalidRequest("a spoken answer speaks the assistant turn of a conversation; this request is a "
                                     "raw prompt", hint="give the text parts a role (user)", fields=("inputs",))
        return text(request)

    return validate
