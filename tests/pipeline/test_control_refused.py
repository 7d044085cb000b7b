"""A control image (``ImagePart(role='control')``) on a graph that reads none is refused at
admission naming ``control_image``, whatever the family (the Flux control variant reads it:
tests/models/flux/test_control.py)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from omniloop.request import ImagePart, InvalidRequest, VideoPart
from tests.engine.fake_stages import create_pipeline, create_request


def test_a_control_image_on_a_graph_without_control_is_refused():
    pipeline, _ = create_pipeline()
    request = create_request("r")
    pipeline.admit(request)  # without it: admitted
    edges = ImagePart(role="control", data=Image.new("RGB", (32, 32)))
    with pytest.raises(InvalidRequest, match="takes none") as err:
        pipeline.admit(request.model_copy(update={"inputs": [*request.inputs, edges]}))
    assert err.value.fields == ("control_image",)


@pytest.mark.parametrize("part, field", [
    (ImagePart(role="keyframe", frame_index=3, data=Image.new("RGB", (32, 32))), "inputs[1]"),
    (ImagePart(role="first_frame", strength=0.5, data=Image.new("RGB", (32, 32))), "inputs[1].strength"),
    (VideoPart(role="keyframe", frame_index=0, data=np.zeros((9, 32, 32, 3), np.uint8)), "inputs[1]"),
    (VideoPart(role="first_frame", data=np.zeros((9, 32, 32, 3), np.uint8)), "inputs[1]"),
])
def test_keyframes_and_image_strengths_on_a_graph_without_them_are_refused(part, field):
    """Only a graph listing "keyframe" in control_inputs (LTX-2's guides) reads them."""
    pipeline, _ = create_pipeline()
    request = create_request("r")
    with pytest.raises(InvalidRequest, match="takes no") as err:
        pipeline.admit(request.model_copy(update={"inputs": [*request.inputs, part]}))
    assert err.value.fields == (field,)
