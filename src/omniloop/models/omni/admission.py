"""The admission checks of a request's parts both omni thinkers make (Qwen2.5-Omni, Qwen3-Omni),
spelled once: which parts the thinker reads, and that its media sit in a conversation (the chat
template places their placeholders in role turns; a raw prompt has none)."""

from __future__ import annotations

from omniloop.pipeline.stages.chat import is_chat
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
