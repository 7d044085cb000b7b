"""Offline API and CLI end to end on a tiny Wan checkpoint: real mp4s that PyAV decodes."""

from __future__ import annotations

import subprocess
import sys

import av
import numpy as np

from omniloop.api.generator import VideoGenerator
from omniloop.request import ProgressEvent


def _decode(path):
    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        frames = [f.to_ndarray(format="rgb24") for f in c.decode(stream)]
        return np.stack(frames), stream.codec_context.name, float(stream.average_rate)


def test_generate_video_writes_h264_mp4(wan_t2v_dir, tmp_path):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    events = []
    result = gen.generate_video("a red circle moving right", num_inference_steps=3, height=32, width=48,
                                num_frames=9, fps=8, seed=5, output_path=tmp_path, on_event=events.append)
    assert result.frames.shape == (9, 32, 48, 3) and result.frames.dtype == np.uint8
    assert result.seed == 5 and result.path.suffix == ".mp4"
    decoded, codec, fps = _decode(result.path)
    assert codec == "h264" and decoded.shape == (9, 32, 48, 3) and fps == 8.0
    # lossy, but close to what we encoded
    assert np.abs(decoded.astype(int) - result.frames.astype(int)).mean() < 12
    progress = [e for e in events if isinstance(e, ProgressEvent)]
    assert [e.step for e in progress] == [1, 2, 3] and progress[-1].eta_s < progress[0].eta_s
    assert [e.type for e in events][-1] == "final"


def test_same_seed_reproduces_and_t2i_gives_image(wan_t2v_dir, tmp_path):
    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    kw = dict(steps=2, height=32, width=32, num_frames=5, seed=9, save_video=False)
    a, b = gen.generate_video("a cat", **kw), gen.generate_video("a cat", **kw)
    assert np.array_equal(a.frames, b.frames)
    img = gen.generate_video("a cat", task="t2i", steps=2, height=32, width=32, seed=1, save_video=False)
    assert img.frames.shape == (1, 32, 32, 3) and img.output.image is not None


def test_cli_generate(wan_t2v_dir, tmp_path):
    out = tmp_path / "clip.mp4"
    proc = subprocess.run(
        [sys.executable, "-m", "omniloop.api.cli", "generate", "a blue square moving left", "--model", str(wan_t2v_dir),
         "--output", str(out), "--steps", "2", "--height", "32", "--width", "32", "--num-frames", "5",
         "--seed", "3", "--guidance-scale", "4.5", "--dtype", "float32", "--device", "cpu",
         "--knob", "guidance_scale_2=3"],  # the denoise loop's own knob, flat under diffusers' name
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote" in proc.stdout and "seed 3" in proc.stdout
    assert "denoise" in proc.stderr  # the progress bar
    decoded, codec, _ = _decode(out)
    assert codec == "h264" and decoded.shape == (5, 32, 32, 3)


def test_cli_bad_input_is_a_clear_error(wan_t2v_dir, tmp_path, capsys):
    """In-process (``main``, the console script's function; test_cli_generate runs the real
    entry point in a fresh process): the model's own size rule, named as the flag."""
    from omniloop.api.cli import main

    code = main(["generate", "x", "--model", str(wan_t2v_dir), "--height", "30", "--width", "32", "--num-frames", "5",
                 "--output", str(tmp_path), "--no-progress"])
    assert code == 2
    assert "error: --height=30 must be a multiple of 16; pass 16 or 32" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_a_knob_the_models_loops_lack_is_refused_naming_it_and_the_model(wan_t2v_dir, tmp_path, capsys):
    """LTX-2's ``stg_scale`` on a Wan model: refused by the offline API and the CLI (--knob),
    naming the knob, the model and the knobs its loops have; nothing runs."""
    import pytest

    from omniloop.api.cli import main
    from omniloop.request import FieldError

    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    name = gen.pipeline.spec.name
    with pytest.raises(FieldError, match=rf"^stg_scale: unknown generation parameter\(s\) \['stg_scale'\]: not a knob "
                                         rf"of '{name}''s loops \(its loop knobs: ") as e:
        gen.generate_video("x", stg_scale=2.0, save_video=False)
    assert e.value.fields == ("stg_scale",)
    code = main(["generate", "x", "--model", str(wan_t2v_dir), "--knob", "stg_scale=2", "--steps", "1", "--height",
                 "32", "--width", "32", "--num-frames", "5", "--output", str(tmp_path), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: --knob stg_scale: unknown generation parameter(s) ['stg_scale']: not a knob of " \
        f"'{name}''s loops" in err, err
    assert main(["generate", "x", "--knob", "stg_scale"]) == 2  # not NAME=VALUE: refused before loading
    assert "--knob stg_scale: pass NAME=VALUE" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written


def test_knob_flags_parse_as_json_and_the_old_flags_still_work(capsys):
    """``--knob NAME=VALUE`` (JSON values), and a loop knob's old flag (``--guidance-scale-2``),
    kept one release with a deprecation warning; all before any model loads."""
    import pytest

    from omniloop.api.cli import _knob_flags, build_parser

    args = build_parser().parse_args(["generate", "x", "--guidance-scale-2", "3", "--knob",
                                      "spatio_temporal_guidance_blocks=[28]", "--knob", "sampler_name=euler"])
    assert _knob_flags(args) == {"guidance_scale_2": 3, "spatio_temporal_guidance_blocks": [28], "sampler_name": "euler"}
    assert "warning: --guidance-scale-2 is deprecated (a loop knob now): pass --knob guidance_scale_2=3" in \
        capsys.readouterr().err
    shared = build_parser().parse_args(["generate", "x", "--knob", "num_inference_steps=3"])
    with pytest.raises(ValueError, match=r"^--knob num_inference_steps=3: num_inference_steps is a generation flag "
                                         r"every model takes; pass --steps$"):
        _knob_flags(shared)
