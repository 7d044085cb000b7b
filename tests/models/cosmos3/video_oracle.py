"""transformers' ``Qwen3VLVideoProcessor`` as an oracle, run in a child process (``python -m
tests.models.cosmos3.video_oracle FOLDER FRAMES.npy FPS TEXT.txt OUT.pt``).

Why a child: torchvision's only registry wheels for torch 2.13 are CUDA builds whose ``_C``
extension links ``libtorch_cuda.so``, absent from the CPU torch. Its Python transforms (the
resize transformers calls) run without ``_C``, but ``import torchvision`` registers fake
kernels for the C++ ops ``nms`` / ``qnms`` and fails when their schemas do not exist; we
define those two schemas (never called) and import it from a ``--target`` folder
(``OMNILOOP_TORCHVISION_PATH``, default ``.ci-torchvision``; ``.ci/run`` installs it). In the
test process itself a torchvision on sys.path would switch transformers' backends for every
later test, so it lives only here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def torchvision_path() -> Path:
    return Path(os.environ.get("OMNILOOP_TORCHVISION_PATH", ROOT / ".ci-torchvision"))


def _import_torchvision() -> None:
    import torch

    sys.path.insert(0, str(torchvision_path()))
    lib = torch.library.Library("torchvision", "DEF")  # noqa: F841 (kept alive until exit)
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    globals()["_lib"] = lib
    import torchvision  # noqa: F401
    from transformers.utils import import_utils

    assert import_utils.is_torchvision_v2_available(), "transformers does not see torchvision"


def main(folder: str, frames_path: str, fps: str, text: str, out: str) -> None:
    """``Qwen3VLProcessor`` (the checkpoint's tokenizer, image and video processors) on the
    rendered chat text and the decoded frames -> its ids, ``pixel_values_videos``, grid and
    the frame groups' timestamps, saved to ``out``."""
    _import_torchvision()
    import numpy as np
    import torch
    from transformers import AutoImageProcessor, AutoTokenizer, AutoVideoProcessor
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    videos = AutoVideoProcessor.from_pretrained(folder, cap_pixels_per_frame=False)
    assert type(videos).__name__ == "Qwen3VLVideoProcessor", type(videos)
    processor = Qwen3VLProcessor(image_processor=AutoImageProcessor.from_pretrained(folder),
                                 tokenizer=AutoTokenizer.from_pretrained(folder), video_processor=videos)
    frames = np.load(frames_path)
    meta = VideoMetadata(total_num_frames=frames.shape[0], fps=float(fps))
    batch = processor(text=[Path(text).read_text()], videos=[frames], video_metadata=[meta], return_metadata=True,
                      return_tensors="pt")
    used = batch["video_metadata"][0]
    stamps = processor._calculate_timestamps(used.frames_indices, used.fps, videos.temporal_patch_size)
    torch.save({k: batch[k] for k in ("input_ids", "mm_token_type_ids", "pixel_values_videos", "video_grid_thw")}
               | {"timestamps": list(stamps), "torchvision": sys.modules["torchvision"].__version__}, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
