"""The part checks both omni thinkers make at admission (models/omni/admission.py): the
families' validators call them, so Qwen2.5-Omni and Qwen3-Omni refuse the same mistake in the
same words (their own engine tests cover the calls in place)."""

from __future__ import annotations

import base64

import pytest

from omniloop.models.omni.admission import refuse_media_outside_a_conversation, refuse_unread_parts
from omniloop.request import ActionPart, AudioPart, ImagePart, InvalidRequest, OmniRequest, TaskType, TextPart

B64 = base64.b64encode(b"any bytes: the checks read no media").decode()


def _request(*parts) -> OmniRequest:
    return OmniRequest(task=TaskType.REASON, inputs=list(parts))


def test_parts_no_encoder_reads_are_refused_naming_them_and_the_family():
    request = _request(TextPart(text="x", role="user"), ActionPart(values=[[0.0]]))
    with pytest.raises(InvalidRequest) as caught:
        refuse_unread_parts(request, "Qwen3-Omni")
    assert str(caught.value) == ("inputs carry ['action'] parts; Qwen3-Omni reads text, audio, images and videos; "
                                 "send text, audio, image and video parts only")
    assert caught.value.fields == ("inputs",)
    refuse_unread_parts(_request(TextPart(text="x"), AudioPart(b64=B64), ImagePart(b64=B64)), "Qwen2.5-Omni")


def test_media_in_a_raw_prompt_is_refused_naming_the_first_part():
    with pytest.raises(InvalidRequest) as caught:
        refuse_media_outside_a_conversation(_request(TextPart(text="x"), AudioPart(b64=B64), AudioPart(b64=B64)))
    assert str(caught.value) == ("inputs[1]: audio goes into a conversation (text parts with roles), not a raw "
                                 "prompt; give the text parts a role (user)")
    assert caught.value.fields == ("inputs[1]",)
    refuse_media_outside_a_conversation(_request(TextPart(text="x", role="user"), AudioPart(b64=B64)))
    refuse_media_outside_a_conversation(_request(TextPart(text="a raw prompt")))  # no media: nothing to place
