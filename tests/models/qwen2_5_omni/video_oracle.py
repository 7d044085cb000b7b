"""transformers' ``Qwen2_5OmniProcessor`` (or, with ``--qwen3``, ``Qwen3OmniMoeProcessor``) video path as
an oracle, run in a child process (``python -m tests.models.qwen2_5_omni.video_oracle [--qwen3] FOLDER
FRAMES.npy TEXT.txt OUT.pt [SOUNDTRACK.npy]``): its
``Qwen2VLVideoProcessor`` needs torchvision, which only a side folder holds (why a child, and
why a side folder: ``tests/models/cosmos3/video_oracle.py``).

The processor is built from the checkpoint's parts as ``from_pretrained`` would (its tokenizer
given the special-token attributes the released tokenizer config names) and called as the
released model's usage calls it: the conversation's rendered text and the sampled frames, its
defaults for the rest (fps 2, the processor's video size bounds). With a soundtrack (16 kHz
samples), the video is read with it (``load_audio_from_video``, the soundtrack given rather than
decoded by the processor)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.models.cosmos3.video_oracle import _import_torchvision

SPECIAL_QWEN3 = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
                 "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>",
                 "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}
SPECIAL = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>", "video_token": "<|VIDEO|>",
           "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
           "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}
KEYS = ("input_ids", "attention_mask", "pixel_values_videos", "video_grid_thw", "video_second_per_grid")
AUDIO_KEYS = ("input_features", "feature_attention_mask")


def main(folder: str, frames_path: str, text: str, out: str, soundtrack: str | None = None, qwen3: bool = False) -> None:
    _import_torchvision()
    import numpy as np
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, AutoVideoProcessor, WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import Qwen2_5OmniProcessor
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import Qwen3OmniMoeProcessor

    videos = AutoVideoProcessor.from_pretrained(folder, cap_pixels_per_frame=False)
    assert type(videos).__name__ == "Qwen2VLVideoProcessor", type(videos)
    kind = Qwen3OmniMoeProcessor if qwen3 else Qwen2_5OmniProcessor
    processor = kind(image_processor=AutoImageProcessor.from_pretrained(folder), video_processor=videos,
                     feature_extractor=WhisperFeatureExtractor.from_pretrained(folder),
                     tokenizer=AutoTokenizer.from_pretrained(folder, extra_special_tokens=SPECIAL_QWEN3 if qwen3 else SPECIAL))
    sound = {} if soundtrack is None else {"audio": [np.load(soundtrack)], "audio_from_video_indices": [0],
                                           "load_audio_from_video": True}
    batch = processor(text=[Path(text).read_text()], videos=[np.load(frames_path)], return_tensors="pt", **sound)
    keys = KEYS + (AUDIO_KEYS if sound else ())
    torch.save({k: batch[k] for k in keys} | {"torchvision": sys.modules["torchvision"].__version__}, out)


if __name__ == "__main__":
    args = sys.argv[1:]
    main(*[a for a in args if a != "--qwen3"], qwen3="--qwen3" in args)
