"""The first ten minutes of a new user: top-level imports, ``omniloop models``, flags checked
before the model loads and named as flags, ``--output x.png``, progress bars, ``--help``
defaults, the embedded model's size caps. CLI calls run ``main()`` in process (the
subprocess tests in test_generator_cli.py cover the entry point itself)."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

import omniloop
from omniloop.api.cli import build_parser, main


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_top_level_names_are_importable_and_import_omniloop_stays_cheap():
    probe = ("import sys, omniloop; heavy = sorted(m for m in ('torch', 'pydantic', 'omniloop.engine') "
             "if m in sys.modules); print(heavy)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"  # nothing heavy until a name is used
    from omniloop import (  # noqa: F401  (what the README's Python snippets use)
        AsyncEngine,
        DeployConfig,
        DiffusionParams,
        OmniOutput,
        OmniRequest,
        OutputSpec,
        SamplingParams,
        TaskType,
        TextPart,
        VideoGenerator,
    )
    from omniloop.api.generator import VideoGenerator as direct

    assert VideoGenerator is direct and set(omniloop.__all__) <= set(dir(omniloop))
    with pytest.raises(AttributeError, match="module 'omniloop' has no attribute 'VideoGenerater'"):
        omniloop.VideoGenerater  # noqa: B018


def test_models_lists_builtins_and_families(capsys):
    code, out, _ = _cli(capsys, "models")
    assert code == 0
    assert re.search(r"^  shapes-t2v +text-to-video of simple colored shapes", out, re.M)
    assert re.search(r"^  shapes-t2v-4step +the 4-step distilled student of shapes-t2v", out, re.M)
    assert "tasks t2v, t2i; default 128x128, 17 frames, 50 steps" in out
    assert re.search(r"^  wan +Wan2.1 / Wan2.2 video DiT", out, re.M) and "WanPipeline, WanImageToVideoPipeline" in out
    assert re.search(r"^  qwen2 +Qwen2 / Qwen2.5 decoder-only LM", out, re.M)
    # a family of two layouts is one entry: its second layout on a line of its own, under it
    families = re.findall(r"^  (\S+) ", out.split("\nfamilies")[1], re.M)
    assert families == sorted(set(families)) and {"far", "wan"} <= set(families), families
    wan = out.split("\n  wan ")[1].splitlines()
    assert wan[1].split() == ["WanPipeline,", "WanImageToVideoPipeline,", "WanVideoToVideoPipeline,", "WanVACEPipeline,",
                            "WanAnimatePipeline"]
    assert wan[2].strip().startswith("or omniloop_model.json: Wan DiT + causal 3D VAE in omniloop's manifest layout")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "error: --steps 0: Input should be greater than or equal to 1"),
    (["--num-inference-steps", "0"], "error: --num-inference-steps 0: Input should be greater than or equal to 1"),
    (["--steps", "2", "--num-inference-steps", "3"],
     "error: --steps: 2 disagrees with --num-inference-steps=3; pass one of them"),
    (["--height", "8"], "error: --height 8: Input should be greater than or equal to 16"),
    (["--device", "cuda"], "error: device='cuda': this torch ("),
    (["--device", "tpu"], "error: --device tpu: unknown device 'tpu'; pass 'auto', 'cpu', 'cuda' or 'cuda:N'"),
    (["--output", "clip.png"], "error: --output 'clip.png': .png is not written for a video; pass a .mp4 file or "
                               "a directory"),
    (["--output", "clip.gif", "--task", "t2i"], "error: --output 'clip.gif': .gif is not written for an image; pass "
                                                "a .png or .mp4 file or a directory"),
    (["--image", "/nonexistent/first.png"], "error: --image /nonexistent/first.png: no such file"),
    (["--last-image", "/nonexistent/last.png"], "error: --last-image needs --image (the first frame) too"),
])
def test_flags_are_checked_before_the_model_loads_and_named_as_flags(capsys, tmp_path, argv, message):
    # the model does not exist: a flag error must come first, without loading anything
    if "--device" in argv and argv[1] == "cuda":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    # the deployment's flags are judged after --model (they import torch): those cases name a built-in model
    model = "shapes-t2v-4step" if "--device" in argv else str(tmp_path / "no-such-model")
    code, _, err = _cli(capsys, "generate", "a cat", "--model", model, *argv)
    assert code == 2 and err.startswith(message) and len(err.strip().splitlines()) == 1, err
    assert "pydantic.dev" not in err and "Traceback" not in err


@pytest.mark.parametrize("model, hint", [("shapes", "; did you mean 'shapes-t2v'?"),
                                         ("shapes-t2v-4", "; did you mean 'shapes-t2v-4step'?"),
                                         ("/no/such/checkpoint", "")])
def test_a_mistyped_model_is_refused_at_once_naming_the_closest(model, hint):
    """``--model shapes`` was refused after importing torch and a family (2-6 s), without a hint."""
    probe = ("import sys, time; from omniloop.api.cli import main; t = time.perf_counter(); "
             f"code = main(['generate', 'a cat', '--model', {model!r}]); "
             "print(code, 'torch' in sys.modules, time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    code, torch_loaded, _ = out.stdout.split()
    assert (code, torch_loaded) == ("2", "False"), out
    assert out.stderr.strip() == (f"error: --model {model}: model {model!r} is neither a directory nor a built-in "
                                  "model name (built-in: ['shapes-interactive', 'shapes-t2v', 'shapes-t2v-4step'])"
                                  + hint), out.stderr


@pytest.mark.parametrize("spec", ["shapes-t2", "flux=shapes-t2"])
def test_serve_refuses_a_mistyped_model_before_the_server_imports(spec):
    """``omniloop serve --model shapes-t2`` was refused after torch, fastapi and the families
    loaded (~14 s on a loaded 2-core machine); now before any of them, naming the closest."""
    probe = ("import sys; from omniloop.api.cli import main; "
             f"code = main(['serve', '--model', {spec!r}]); print(code, 'torch' in sys.modules)")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - start  # from process start: the interpreter and the CLI's own imports too
    assert out.stdout.split() == ["2", "False"], out
    assert out.stderr.strip() == ("error: --model shapes-t2: model 'shapes-t2' is neither a directory nor a built-in "
                                  "model name (built-in: ['shapes-interactive', 'shapes-t2v', 'shapes-t2v-4step']); "
                                  "did you mean 'shapes-t2v'?"), out.stderr
    assert elapsed < 5, f"the refusal took {elapsed:.1f} s"


def test_an_empty_prompt_is_refused_as_the_server_refuses_it(capsys, tmp_path):
    for prompt, got in (("", "an empty string"), ("   ", "only whitespace")):
        code, _, err = _cli(capsys, "generate", prompt, "--model", str(tmp_path / "no-such-model"))
        # the HTTP server's message for the same prompt (tests/serve/test_bad_input.py), and the worker's
        assert code == 2 and err.strip() == f"error: prompt: pass a non-empty text prompt (got {got})"


def test_output_png_writes_a_png_and_the_bars_show_steps_and_decode(capsys, wan_t2v_dir, tmp_path):
    target = tmp_path / "x.png"
    code, out, err = _cli(capsys, "generate", "a cat", "--model", str(wan_t2v_dir), "--task", "t2i",
                          "--output", str(target), "--steps", "3", "--height", "32", "--width", "48",
                          "--device", "cpu", "--dtype", "float32")
    assert code == 0, err
    assert target.is_file() and out.startswith(f"wrote {target} (an image 48x32, seed ")
    assert np.asarray(Image.open(target)).shape == (32, 48, 3)
    # denoise: started at its first step, so its first rate is unknown, not "95325 step/s"
    assert re.search(r"denoise: +33%\|[^|]*\| 1/3 \[00:00<\?, \?step/s\]", err), err
    assert re.search(r"denoise: 100%\|[^|]*\| 3/3", err) and re.search(r"decode: 100%\|[^|]*\| 1/1", err), err


def test_a_bare_omniloop_prints_the_help_with_the_first_commands(capsys):
    """``omniloop`` alone was argparse's 'the following arguments are required: command'."""
    code, out, err = _cli(capsys)
    assert code == 2 and not err, err
    assert out.startswith("usage: omniloop ") and "start here" in out
    assert 'omniloop generate "a red circle moving right"' in out and "omniloop eval adherence --videos outputs" in out
    code, out, _ = _cli(capsys, "-v")
    assert code == 2 and "start here" in out
    with pytest.raises(SystemExit):  # a mistyped flag is still refused, naming the closest one
        main(["--verbse"])
    assert "did you mean --verbose?" in capsys.readouterr().err


def test_a_generated_clip_carries_its_prompt_and_eval_reads_it(capsys, wan_t2v_dir, tmp_path):
    """``omniloop generate`` then ``omniloop eval adherence --videos outputs`` (the README's next
    step) used to end in 'no prompt for [...]': the mp4 now carries its prompt in its title."""
    from omniloop.io.video import mp4_title

    code, out, err = _cli(capsys, "generate", "a red circle moving right", "--model", str(wan_t2v_dir),
                          "--output", str(tmp_path), "--steps", "2", "--height", "32", "--width", "32",
                          "--num-frames", "5", "--device", "cpu", "--dtype", "float32", "--no-progress")
    assert code == 0, err
    (clip,) = tmp_path.glob("*.mp4")
    assert mp4_title(clip) == "a red circle moving right"
    code, out, err = _cli(capsys, "eval", "adherence", "--videos", str(tmp_path))
    assert code == 0, err
    assert '"n_clips": 1' in out
    clip.with_suffix(".txt").write_text("a blue square moving left")  # a sidecar still wins over the title
    from omniloop.eval.adherence import file_pairs

    assert file_pairs(str(tmp_path)) == [(clip, "a blue square moving left")]


def test_a_reader_that_leaves_early_gets_no_traceback():
    """``omniloop eval adherence ... | head`` ended in a BrokenPipeError traceback."""
    import os

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    try:
        proc = subprocess.run([sys.executable, "-c", "from omniloop.api.cli import entry; entry()", "models"],
                              stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert (proc.returncode, proc.stderr) == (141, ""), proc.stderr


def test_help_shows_defaults():
    generate = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    flat = " ".join(generate.split())
    assert "--output OUTPUT a .mp4 file, a .png file" in flat and "(default: outputs/)" in flat
    assert "--steps STEPS number of denoising steps (default: the model's)" in flat
    assert "--attention-backend ATTENTION_BACKEND" in flat and "(default: auto)" in flat  # models/fast_path.py
    assert "--compile, --no-compile" in flat
    assert "(default: a random one" in flat  # --seed
    top = " ".join(build_parser().format_help().split())
    assert "-v, --verbose log at INFO level" in top and "each command's flags: omniloop COMMAND --help" in top
    models = " ".join(build_parser()._subparsers._group_actions[0].choices["models"].format_help().split())
    assert "The built-in models (--model NAME" in models
    adherence = build_parser()._subparsers._group_actions[0].choices["eval"]._subparsers._group_actions[0]
    assert "else the prompt omniloop generate wrote into the mp4" in " ".join(
        adherence.choices["adherence"].format_help().split())
    serve = " ".join(build_parser()._subparsers._group_actions[0].choices["serve"].format_help().split())
    assert "--port PORT TCP port (0: any free port) (default: 8000)" in serve
    assert "--drain-timeout SECONDS, --drain-timeout-s SECONDS" in serve


def test_the_embedded_model_caps_the_sizes_it_serves():
    """shapes-t2v took 832x480 x 4 s (a predicted 84 minutes on a CPU); its manifest's limits
    now refuse it, naming the limit."""
    from omniloop.api.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained("shapes-t2v-4step", device="cpu")
    assert (gen.pipeline.defaults.max_height, gen.pipeline.defaults.max_frames) == (256, 33)
    with pytest.raises(ValueError, match=r"^diffusion.height=480 is more than this model serves \(at most 256: "
                                         r"the limits.max_height of its manifest\); pass 256 or less$"):
        gen.generate_video("a red circle", width=832, height=480, num_frames=65, save_video=False)
    with pytest.raises(ValueError, match=r"^diffusion.num_frames=65 is more than this model serves \(at most 33"):
        gen.generate_video("a red circle", num_frames=65, save_video=False)
    assert gen.engine.stats.rejected == 2


def test_serve_and_dynamo_worker_spell_their_shared_flags_the_same():
    commands = build_parser()._subparsers._group_actions[0].choices

    def flags(name: str) -> set[str]:
        return {o for a in commands[name]._actions for o in a.option_strings}

    shared = flags("serve") & flags("dynamo-worker")
    for flag in ("--model", "--served-model-name", "--deploy-config", "--drain-timeout", "--drain-timeout-s",
                 "--warmup-steps", "--warmup-size", "--warmup-frames", "--device", "--limits", "--max-batch"):
        assert flag in shared, flag
    # the HTTP server's own: its socket, jobs, drain, and live sessions (/v1/sessions, HTTP only)
    assert flags("serve") - shared == {"--host", "--port", "--api-key", "--max-jobs", "--max-upload-bytes", "--drain",
                                       "--cancel-wait-s", "--sse-keepalive-s", "--job-store", "--output-dir",
                                       "--requeue-on-restart", "--no-requeue-on-restart", "--retention-max-bytes",
                                       "--retention-max-age-s", "--max-sessions", "--session-idle-s", "--session-model",
                                       "--session-connect-grace-s",
                                       # issue 29's edges: caps, browser safety, LoRA registrations
                                       "--max-json-depth", "--max-ws-message-bytes", "--max-image-pixels",
                                       "--metrics-public", "--no-metrics-public", "--browser-token-s",
                                       "--allowed-hosts", "--allowed-origins", "--max-loras", "--max-lora-bytes",
                                       # issue 29 item 8: crash checkpoints of durable jobs
                                       "--checkpoint-every-s", "--checkpoint-every-steps", "--checkpoint-max-bytes",
                                       "--max-job-restarts",
                                       # issue 31 item 5: the weight plane (admin routes; HTTP only)
                                       "--weights-dir", "--while-asleep",
                                       # issue 33: ComfyUI's API beside the OpenAI one (HTTP only)
                                       "--comfy-models", "--comfy-workdir"}
