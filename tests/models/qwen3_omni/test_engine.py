"""The Qwen3-Omni graph through the engine (the offline API): a spoken answer is text plus 24 kHz
audio; concurrent requests batch their thinker / talker steps (MoE layers and the code
predictor over several rows) and each equals its solo run; bad input is refused naming the field."""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.engine.offline import run_request
from omniloop.request import OmniRequest, SamplingParams, TaskType, TextPart, VideoPart
from tests.models.qwen3_omni.checkpoint import PROMPTS
from tests.models.qwen3_omni.helpers import omni3_request


@pytest.fixture(scope="module")
def omni3_generator(omni3_dir):
    return VideoGenerator.from_pretrained(omni3_dir, device="cpu", dtype="float32")


@torch.inference_mode()
def test_concurrent_spoken_answers_batch_and_equal_solo(omni3_generator, omni3_pipeline):
    solo = [run_request(omni3_pipeline, omni3_request(p, seed=i, voice=v))
            for i, (p, v) in enumerate(zip(PROMPTS, [None, "chelsie", "Ethan"]))]
    engine = omni3_generator.engine
    ids = [engine.add_request(omni3_request(p, seed=i, voice=v))
           for i, (p, v) in enumerate(zip(PROMPTS, [None, "chelsie", "Ethan"]))]
    for rid in ids:
        engine.run_until_done(rid)
    outs = [engine.pop_output(rid) for rid in ids]
    for alone, together in zip(solo, outs):
        assert together.status.value == "completed", together.error
        assert together.text.token_ids == alone.text.token_ids
        assert together.audio is not None and together.audio.node == "code2wav" and together.audio.sample_rate == 24000
        assert together.audio.samples.shape == alone.audio.samples.shape
        assert (together.audio.samples - alone.audio.samples).abs().max() <= 1e-6  # batched rows pad and mask the KV


def test_bad_input_is_refused_naming_the_field(omni3_pipeline):
    with pytest.raises(ValueError, match=r"voice 'Nobody' is not one of .*\['chelsie', 'ethan'\]") as err:
        run_request(omni3_pipeline, omni3_request(PROMPTS[0], voice="Nobody"))
    assert err.value.fields == ("outputs.voice",)
    video = OmniRequest(task=TaskType.REASON, inputs=[TextPart(text="what is it", role="user"),
                                                      VideoPart(b64="AAAA")],
                        sampling=SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=r"inputs\[1\]: cannot read the video") as err:
        run_request(omni3_pipeline, video)
    assert err.value.fields == ("inputs[1]",)
    with pytest.raises(ValueError, match=r"a spoken answer speaks the assistant turn of a conversation") as err:
        run_request(omni3_pipeline, omni3_request(PROMPTS[0], chat=False))
    assert err.value.fields == ("inputs",)
    with pytest.raises(ValueError, match=r"speech frames at most|less than or equal to 32768"):
        run_request(omni3_pipeline, omni3_request(PROMPTS[0]).model_copy(update={"node_params": {"talker": {"max_tokens": 10 ** 6}}}))


def test_bad_checkpoint_configs_are_refused_naming_the_key(omni3_dir):
    import json

    from omniloop.models.families.qwen3_omni.weights import Omni3Config

    raw = json.loads((omni3_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"talker_config.speaker_id is empty"):
        Omni3Config.from_hf({**raw, "talker_config": {**raw["talker_config"], "speaker_id": {}}})
    with pytest.raises(ValueError, match=r"code2wav_config.num_quantizers=3 must equal talker_config.num_code_groups=4"):
        Omni3Config.from_hf({**raw, "code2wav_config": {**raw["code2wav_config"], "num_quantizers": 3}})
    text_only = Omni3Config.from_hf({**raw, "enable_audio_output": False})
    assert not text_only.speaks and text_only.talker is None
