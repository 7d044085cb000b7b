"""Video in a Qwen2.5-Omni conversation vs transformers on the tiny checkpoint.

The clip is a real mp4 (PyAV H.264, 5 frames of 40x60 at 4 fps: 1.25 s) decoded by our reader;
sampled at 2 fps (at least 4 frames: qwen-omni-utils' rule) it gives frames 0, 1, 3, 4, two
temporal patches. ``Qwen2_5OmniProcessor`` (its ``Qwen2VLVideoProcessor``: the torchvision
backend, in a child process, ``video_oracle.py``) turns those frames into the oracle's ids and
patches; the frames are resized up to the processor's 128 * 28 * 28 pixels a frame (280x392),
140 placeholders a temporal patch. Measured on the CPU in fp32: the patches bit-equal, the
greedy text identical, the spoken answer's codes identical and its waveform bit-equal."""

from __future__ import annotations

import base64
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from omniloop.engine.offline import run_request
from omniloop.io.video import encode_mp4
from omniloop.request import InvalidRequest, OmniRequest, SamplingParams, TaskType, TextPart, VideoPart
from tests.models.cosmos3.video_oracle import ROOT, torchvision_path
from tests.models.qwen2_5_omni.helpers import AUDIO_TOKENS, TEXT_TOKENS, run_nodes
from tests.models.qwen2_5_omni.test_spoken_media import WAVE_TOL, hf_spoken, left_padded, spoken_request

FRAMES = np.random.default_rng(0).integers(0, 256, (5, 40, 60, 3), dtype=np.uint8)
CLIP = encode_mp4(FRAMES, 4)
TEXT = "what happens"


def video_part(data: bytes = CLIP) -> VideoPart:
    return VideoPart(b64="data:video/mp4;base64," + base64.b64encode(data).decode())


def video_request(part: VideoPart | None = None, **sampling) -> OmniRequest:
    sampling.setdefault("max_tokens", TEXT_TOKENS)
    return OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=TEXT, role="user"), part or video_part()],
                       sampling=SamplingParams(temperature=0.0, seed=5, **sampling))


def run_oracle(folder, frames: np.ndarray, work, soundtrack: np.ndarray | None = None, qwen3: bool = False) -> dict:
    """``video_oracle.py`` in a child process on the sampled frames (and the soundtrack); ``qwen3``:
    ``Qwen3OmniMoeProcessor``'s."""
    from transformers import AutoTokenizer

    if not (torchvision_path() / "torchvision").is_dir():
        pytest.skip(f"no torchvision at {torchvision_path()}: pip install --no-deps --target .ci-torchvision "
                    "torchvision==0.28.0 (.ci/run does)")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": [{"type": "text", "text": TEXT}, {"type": "video"}]}]
    np.save(work / "frames.npy", frames)
    (work / "text.txt").write_text(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    args = [str(folder), str(work / "frames.npy"), str(work / "text.txt"), str(work / "out.pt")]
    if soundtrack is not None:
        np.save(work / "sound.npy", soundtrack)
        args.append(str(work / "sound.npy"))
    if qwen3:
        args.append("--qwen3")
    run = subprocess.run([sys.executable, "-m", "tests.models.qwen2_5_omni.video_oracle", *args],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = torch.load(work / "out.pt")
    assert out["torchvision"].startswith("0.28")
    return out


@pytest.fixture(scope="module")
def oracle(omni_dir, omni_pipeline, tmp_path_factory):
    """The processor's ids, patches, grid and seconds per grid for the sampled frames."""
    from omniloop.models.omni.video_prompt import decode_frames

    frames = decode_frames(1, video_part(), omni_pipeline.components["video_processing"])
    assert frames.shape == (4, 40, 60, 3)
    return run_oracle(omni_dir, frames, tmp_path_factory.mktemp("omni_video_oracle"))


def test_video_patches_equal_the_processors(omni_pipeline, oracle):
    from omniloop.models.omni.video_prompt import process_video

    video = process_video(1, video_part(), omni_pipeline.components["video_processing"])
    assert video.grid == tuple(oracle["video_grid_thw"][0].tolist()) == (2, 20, 28)
    assert video.seconds_per_grid == float(oracle["video_second_per_grid"][0]) == 1.0
    assert torch.equal(video.pixels, oracle["pixel_values_videos"])


@torch.inference_mode()
def test_greedy_text_given_a_video_equals_transformers(omni_hf, omni_pipeline, oracle):
    """The processor's inputs through transformers' thinker vs our whole path from the mp4 bytes
    (decode, sample, preprocess, expand, vision encoder, 3-D positions with the temporal spacing)."""
    hf, _ = omni_hf
    inputs = {k: oracle[k] for k in ("input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw",
                                     "video_second_per_grid")}
    want = hf.thinker.generate(**inputs, max_new_tokens=TEXT_TOKENS, do_sample=False)[0, inputs["input_ids"].shape[1]:]
    out = run_request(omni_pipeline, video_request())
    assert out.status.value == "completed", out.error
    assert out.text.prompt_tokens == inputs["input_ids"].shape[1]
    assert out.text.token_ids == want.tolist()


@torch.inference_mode()
def test_spoken_answer_given_a_video_equals_transformers(omni_hf, omni_pipeline, oracle):
    """The talker reads zeros at the video's positions and the thinker's 3-D positions (transformers'
    talker gets ``video_grid_thw`` and ``video_second_per_grid``; ``pixel_values_videos`` is kept from
    it, see test_spoken_media)."""
    hf, tokenizer = omni_hf
    inputs = {k: oracle[k] for k in ("input_ids", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")}
    text, codes, wav = hf_spoken(hf, left_padded(inputs, tokenizer.pad_token_id), talker_pixel_values_videos=None)
    state = run_nodes(omni_pipeline, spoken_request([TextPart(text=TEXT, role="user"), video_part()]))
    assert state.artifacts["text"].token_ids == text
    assert state.artifacts["codec"].codes == codes
    audio = state.artifacts["audio"].samples[0]
    assert audio.shape == wav.shape and (audio - wav).abs().max() <= WAVE_TOL


def _tiny(frames: int, fps: int, size: tuple[int, int] = (16, 16)) -> bytes:
    return encode_mp4(np.zeros((frames, *size, 3), dtype=np.uint8), fps)


BAD_VIDEOS = [
    (b"\x00\x00\x00\x18ftypmp42 not a video", "cannot read the video"),
    ((400, 1), "the video is 400.0 s long, over the 384 s this model reads (768 frames at 2 fps); send at most 384 s"),
    ((1, 4), "the video has 1 frame(s); send at least 2"),
]


def check_bad_video_refused(pipeline, clip, says: str) -> None:
    """``clip`` (bytes, or ``(frames, fps)`` of a tiny mp4) refused at admission with ``says``, naming the part."""
    data = clip if isinstance(clip, bytes) else _tiny(*clip)
    with pytest.raises(InvalidRequest, match=re.escape(says)) as caught:
        pipeline.admit(video_request(video_part(data)))
    assert caught.value.fields == ("inputs[1]",), str(caught.value)
    assert str(caught.value).startswith("inputs[1]: ")


def check_oversized_frames_refused(pipeline) -> None:
    """In-process frames one column wider than 4K UHD (never touched: the header's shape is enough)."""
    frames = np.zeros((4, 2160, 3842, 3), dtype=np.uint8)
    with pytest.raises(InvalidRequest, match=re.escape("inputs[1]: its frames are 3842x2160 = 8,298,720 pixels, over "
                                                       "the 8,294,400 this model decodes; send a smaller video")):
        pipeline.admit(video_request(VideoPart(data=frames)))


@pytest.mark.parametrize("clip, says", BAD_VIDEOS)
def test_bad_video_is_refused_naming_the_part(omni_pipeline, clip, says):
    """Undecodable, too long (refused from the header: nothing decodes), too few frames."""
    check_bad_video_refused(omni_pipeline, clip, says)


def test_a_checkpoint_without_a_vision_encoder_refuses_videos(omni_dir, tmp_path):
    """The same folder without ``thinker.visual.*``: a video is refused at admission, naming it."""
    import shutil

    from safetensors.torch import load_file, save_file

    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    blind = tmp_path / "blind"
    shutil.copytree(omni_dir, blind)
    for path in blind.glob("*.safetensors"):
        tensors = load_file(path)
        save_file({k: v for k, v in tensors.items() if not k.startswith("thinker.visual.")}, path, metadata={"format": "pt"})
    _, pipeline = load_pipeline(blind, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    assert pipeline.components.get("vision_tower") is None
    with pytest.raises(InvalidRequest, match=r"^inputs\[1\]: this checkpoint has no thinker.visual.\* weights, so it "
                                             r"takes no videos") as caught:
        pipeline.admit(video_request())
    assert caught.value.fields == ("inputs[1]",)


def test_a_frame_over_the_pixel_limit_is_refused_before_decoding(omni_pipeline):
    check_oversized_frames_refused(omni_pipeline)


@torch.inference_mode()
def test_a_video_with_its_soundtrack_equals_transformers(omni_hf, omni_pipeline, omni_dir, tmp_path):
    """``node_params["chat"].use_audio_in_video``: a 3 s clip (12 frames at 4 fps -> 6 sampled,
    three temporal patches) with a 1.25 s AAC soundtrack. The processor (``load_audio_from_video``)
    frames the soundtrack's 31 placeholders in ``<|audio_bos|>`` / ``<|audio_eos|>`` and interleaves
    them with the frames' by 2 s chunk (two patches, the soundtrack, the third patch); the positions
    put both from one start. Our ids, the greedy text and the spoken answer equal transformers'."""
    from omniloop.models.omni.video_prompt import decode_frames, soundtrack

    t = np.arange(20000) / 16000
    sound = (np.sin(2 * np.pi * 440 * t) * 0.3 + np.random.default_rng(1).standard_normal(t.shape) * 0.05)
    frames = np.random.default_rng(2).integers(0, 256, (12, 40, 60, 3), dtype=np.uint8)
    part = video_part(encode_mp4(frames, 4, audio=sound[None].astype(np.float32), sample_rate=16000))
    sampled = decode_frames(1, part, omni_pipeline.components["video_processing"])
    heard = soundtrack(1, part, omni_pipeline.components["feature_extractor"]).samples
    assert sampled.shape[0] == 6
    want = run_oracle(omni_dir, sampled, tmp_path, heard)
    hf, tokenizer = omni_hf
    inputs = {k: want[k] for k in ("input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw",
                                   "video_second_per_grid", "input_features", "feature_attention_mask")}
    ids = inputs["input_ids"][0].tolist()
    audio, video = tokenizer.convert_tokens_to_ids("<|AUDIO|>"), tokenizer.convert_tokens_to_ids("<|VIDEO|>")
    first_audio, last_video = ids.index(audio), len(ids) - 1 - ids[::-1].index(video)
    assert first_audio < last_video  # interleaved: a video chunk after the soundtrack's
    text = hf.thinker.generate(**inputs, use_audio_in_video=True, max_new_tokens=TEXT_TOKENS,
                               do_sample=False)[0, len(ids):].tolist()
    request = video_request(part).model_copy(update={"node_params": {"chat": {"use_audio_in_video": True}}})
    out = run_request(omni_pipeline, request)
    assert out.status.value == "completed", out.error
    assert out.text.prompt_tokens == len(ids) and out.text.token_ids == text
    # spoken: the talker reads zeros at the frames' and the soundtrack's positions, and their positions
    spoken = spoken_request([TextPart(text=TEXT, role="user"), part]).model_copy(
        update={"node_params": {"chat": {"use_audio_in_video": True}, "talker": {"max_tokens": AUDIO_TOKENS}}})
    state = run_nodes(omni_pipeline, spoken)
    assert state.artifacts["prompt_tokens"].token_ids == ids  # the processor's layout, token for token
    padded = left_padded({k: v for k, v in inputs.items() if k != "attention_mask"}, tokenizer.pad_token_id)
    text, codes, wav = hf_spoken(hf, padded, use_audio_in_video=True, talker_pixel_values_videos=None)
    assert state.artifacts["text"].token_ids == text and state.artifacts["codec"].codes == codes
    audio = state.artifacts["audio"].samples[0]
    assert audio.shape == wav.shape and (audio - wav).abs().max() <= WAVE_TOL
