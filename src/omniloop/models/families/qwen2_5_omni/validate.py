"""Admission checks of a Qwen2.5-Omni request: what a text LM checks (``make_ar_validator``),
and no media inputs (the thinker's audio and vision encoders are not run by this family)."""

from __future__ import annotations

from typing import Any, Callable

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.families.qwen2_5_omni.weights import OmniConfig
from omniloop.pipeline.loops.ar import make_ar_validator
from omniloop.request import InvalidRequest, OmniRequest


def make_omni_validator(tokenizer: Any, config: OmniConfig, *, pool: BlockPool) -> Callable[[OmniRequest], OmniRequest]:
    text = make_ar_validator(tokenizer, vocab_size=config.thinker.vocab_size,
                             max_context=config.thinker.max_position_embeddings, pool=pool)

    def validate(request: OmniRequest) -> OmniRequest:
        media = sorted({p.kind for p in request.inputs if p.kind != "text"})
        if media:
            raise InvalidRequest(f"inputs carry {media} parts; this Qwen2.5-Omni deployment reads text only (its "
                                 "audio and vision encoders are not run yet)", hint="send text parts only",
                                 fields=("inputs",))
        return text(request)

    return validate
