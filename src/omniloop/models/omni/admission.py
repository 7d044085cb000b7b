"""The admission checks of a request's parts both omni thinkers make (Qwen2.5-Omni, Qwen3-Omni),
spelled once: which parts the thinker reads, that its media sit in a conversation (the chat
template places their placeholders in role turns; a raw prompt has none), and that the prompt
with every media placeholder expanded fits the context and the KV pool (:func:`make_thinker_checks`:
audio, image and video parts only with the checkpoint's encoder and its preprocessor)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from omniloop.cache.paged_kv import BlockPool
from omniloop.models.omni.audio_prompt import audio_parts, count_placeholders, decode_audio, frames_of
from omniloop.models.omni.image_prompt import image_parts, process_image
from omniloop.models.omni.part_weights import OmniConfigBase
from omniloop.models.omni.video_prompt import VideoProcessing, require, video_extra_tokens
from omniloop.pipeline.loops.ar import check_context, make_ar_validator
from omniloop.pipeline.stages.chat import chat_ids, chat_messages, is_chat
from omniloop.request import InvalidRequest, OmniRequest

MEDIA = ("audio", "image", "video")  # the parts the thinker's encoders read


def refuse_unread_parts(request: OmniRequest, family: str) -> None:
    """Parts no encoder of the thinker reads (action, latent) are refused, naming them."""
    kinds = sorted({p.kind for p in request.inputs if p.kind != "text" and p.kind not in MEDIA})
    if kinds:
        raise InvalidRequest(f"inputs carry {kinds} parts; {family} reads text, audio, images and videos",
                             hint="send text, audio, image and video parts only", fields=("inputs",))


def refuse_media_outside_a_conversation(request: OmniRequest) -> None:
    """Audio, image or video parts in a raw prompt (text parts without roles) are refused,
    naming the first."""
    media = [(i, p) for i, p in enumerate(request.inputs) if p.kind in MEDIA]
    if media and not is_chat(request):
        field = f"inputs[{media[0][0]}]"
        raise InvalidRequest(f"{field}: {media[0][1].kind} goes into a conversation (text parts with roles), not a "
                             "raw prompt", hint="give the text parts a role (user)", fields=(field,))


@dataclass(frozen=True)
class ThinkerEncoders:
    """The thinker's optional encoders and their preprocessors as the checkpoint's components
    loaded them (None: the folder lacks it, and that kind of part is refused naming it).
    ``audio_tower.tokens(frames)``: an audio clip's embeddings from its feature frames;
    ``vision_tower.config.spatial_merge_size``: patches merged into one image token per side."""

    audio_tower: Any = None
    feature_extractor: Any = None
    vision_tower: Any = None
    image_processor: Any = None
    video_processing: VideoProcessing | None = None

    @classmethod
    def of(cls, components: Mapping[str, Any]) -> "ThinkerEncoders":
        """The loaded components under this class's field names."""
        return cls(**{f.name: components.get(f.name) for f in dataclasses.fields(cls)})


def make_thinker_checks(tokenizer: Any, encoders: ThinkerEncoders, config: OmniConfigBase, *, family: str,
                        image_processor: str,
                        pool: BlockPool) -> tuple[Callable[[OmniRequest], OmniRequest], Callable[[OmniRequest], None]]:
    """The thinker's two admission checks, in the order a family runs them with its own between:
    the text LM's (``make_ar_validator`` over the thinker's vocabulary, context and KV ``pool``),
    then its media parts' (a no-op without audio / image / video parts): each kind only with its
    encoder and preprocessor, one placeholder per part in the rendered conversation, each part
    decodable; the prompt with every placeholder expanded to its part's embeddings within the
    thinker's context and the KV pool. ``family`` names the checkpoint in the refusals,
    ``image_processor`` the file keys its image processor is read from (when it lacks them)."""
    e = encoders
    max_context = config.thinker.max_position_embeddings
    text = make_ar_validator(tokenizer, vocab_size=config.thinker.vocab_size, max_context=max_context, pool=pool)
    audio_token_id, image_token_id, video_token_id = config.audio_token_id, config.image_token_id, config.video_token_id

    def audio_extra(request: OmniRequest, ids: list[int]) -> int:
        parts = audio_parts(request)
        if not parts:
            return 0
        require(f"inputs[{parts[0][0]}]", "audio", family, ("thinker.audio_tower.* weights", e.audio_tower),
                ("preprocessor_config.json (its WhisperFeatureExtractor)", e.feature_extractor))
        count_placeholders(ids, audio_token_id, len(parts), "audio")
        return sum(e.audio_tower.tokens(frames_of(e.feature_extractor, decode_audio(i, p, e.feature_extractor))) - 1
                   for i, p in parts)

    def image_extra(request: OmniRequest, ids: list[int]) -> int:
        parts = image_parts(request)
        if not parts:
            return 0
        require(f"inputs[{parts[0][0]}]", "images", family, ("thinker.visual.* weights", e.vision_tower),
                (f"image processor ({image_processor})", e.image_processor))
        count_placeholders(ids, image_token_id, len(parts), "image")
        merge = e.vision_tower.config.spatial_merge_size
        return sum(process_image(i, p, e.image_processor).tokens(merge) - 1 for i, p in parts)

    def video_extra(request: OmniRequest, ids: list[int]) -> int:
        return video_extra_tokens(request, ids, video_token_id=video_token_id, vision_tower=e.vision_tower,
                                  video_processing=e.video_processing, audio_tower=e.audio_tower,
                                  feature_extractor=e.feature_extractor,
                                  audio_tokens=lambda frames: e.audio_tower.tokens(frames), family=family)

    def check_media(request: OmniRequest) -> None:
        if not any(p.kind in MEDIA for p in request.inputs):
            return
        ids = chat_ids(tokenizer, chat_messages(request))
        length = len(ids) + audio_extra(request, ids) + image_extra(request, ids) + video_extra(request, ids)
        check_context(length, request.sampling.max_tokens, max_context)
        pool.check_fits(length + request.sampling.max_tokens)

    return text, check_media
