"""The ``omniloop`` command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from pydantic import ValidationError

from omniloop.api.schema_flags import DefaultsHelpFormatter, add_schema_flags, collect, flag_error
from omniloop.api.suggest import SuggestingParser, refuse_unknown
from omniloop.deploy import DeployConfig
from omniloop.models.catalog import DEFAULT_MODEL, LayoutCard
from omniloop.request import (
    ALIASES, DiffusionParams, FieldError, Fields, InvalidRequest, SamplingParams, TaskType, parse_task, require_prompt,
)
from omniloop.request.params import MOVED_TO_LOOPS
from omniloop.serve.config import DEFAULT_DRAIN_TIMEOUT_S
from omniloop.serve.warmup import DEFAULT_STEPS as DEFAULT_WARMUP_STEPS
from omniloop.serve.warmup import WarmupFailed


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a video (with sound when the model makes it), an image or audio",
                       formatter_class=DefaultsHelpFormatter)
    p.add_argument("prompt", help="what to generate")
    p.add_argument("--model", default=None,
                   help="checkpoint directory or built-in name (default: shapes-t2v, the embedded model; "
                   "see omniloop models)")
    p.add_argument("--output", default="outputs/",
                   help="a .mp4 file, a .png file (an image: --task t2i), a .wav/.flac/.mp3 file (audio), a .txt "
                   "file (text: --task reason) or a directory of <request id>.mp4/.png/.wav/.txt")
    p.add_argument("--audio-only", action="store_true",
                   help="write only the sound as a wav (text-to-audio models always do)")
    p.add_argument("--task", default=None, metavar="{" + ",".join(t.value for t in TaskType) + "}",
                   help="task (default: the one suggested for the model and inputs: t2v for a video model, i2v with "
                   "--image, t2i for an image model, t2a for an audio model...)")
    p.add_argument("--image", default=None, help="first-frame image for i2v")
    p.add_argument("--last-image", default=None, help="last-frame image for first-last-frame i2v (with --image)")
    p.add_argument("--control-image", default=None, help="the edge or depth map a FLUX.1 Canny / Depth model follows")
    p.add_argument("--video", "--control-video", dest="video", default=None,
                   help="video to transform (v2v); a Wan VACE model's control video")
    p.add_argument("--mask", default=None, help="Wan VACE: which pixels of --video to generate (white): a video of its "
                   "frames, or one image for all")
    p.add_argument("--reference-image", dest="reference_images", action="append", default=None,
                   help="Wan VACE: an image the video shows (a subject, a style); repeatable")
    p.add_argument("--deploy-config", default=None, help="YAML file of deploy options")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--knob", action="append", default=None, metavar="NAME=VALUE",
                   help="a knob of the model's own loops, under diffusers' name (LTX-2: --knob stg_scale=2 --knob "
                   "audio_guidance_scale=5; a VALUE in JSON for lists: --knob spatio_temporal_guidance_blocks=[28]); "
                   "repeatable; a knob the model's loops do not have is refused, naming the knobs they have")
    for name in MOVED_TO_LOOPS:  # loop knobs that were generation flags: one release as --knob's spelling
        p.add_argument(f"--{name.replace('_', '-')}", dest=f"moved_{name}", default=None, help=argparse.SUPPRESS)
    p.set_defaults(_params=add_schema_flags(p, DiffusionParams, skip={"plugin_params"}, group="generation",
                                            unset="the model's", aliases=ALIASES))
    p.set_defaults(_sampling=add_schema_flags(p, SamplingParams, skip=SAMPLING_SKIP, group="text (--task reason)"))
    p.set_defaults(_deploy=add_schema_flags(p, DeployConfig, skip={"plugins", "limits"}, group="deployment"))
    p.set_defaults(func=_cmd_generate)


# --seed is the generation group's (one flag for both kinds); stops are API-only
SAMPLING_SKIP = {"seed", "stop", "stop_token_ids"}


def _deploy_from_flags(args: argparse.Namespace) -> DeployConfig:
    """The deploy YAML (if any) with the deployment flags over it; errors name the flag."""
    base = None
    if args.deploy_config:
        try:
            base = DeployConfig.from_yaml(args.deploy_config)
        except ValidationError as e:
            where = {f: f"--deploy-config {args.deploy_config}: {f}" for f in DeployConfig.model_fields}
            raise flag_error(e, {}, where) from None
    given = collect(args, args._deploy)
    try:
        return DeployConfig.from_options(base, **given)
    except ValidationError as e:
        raise flag_error(e, given) from None


def _in_flag_terms(error: ValueError) -> ValueError:
    """An admission refusal in flag terms: the request fields it names (``diffusion.height``,
    ``sampling.max_tokens``) spelled as their flags (``--height``, ``--max-tokens``)."""
    if not isinstance(error, InvalidRequest):
        return error
    flags = {}
    for path in error.fields:
        plane, _, rest = path.partition(".")
        name = rest.split(".")[0].split("[")[0]
        if plane in ("diffusion", "sampling") and name:
            flags[f"{plane}.{name}"] = "--" + name.replace("_", "-")
    return ValueError(error.spelled(flags))


def _output_kinds(args: argparse.Namespace, task: TaskType | None = None) -> list[dict]:
    """What ``--output`` may name: a video, an image or sound, from the flags (and, once the
    model is loaded, the ``task`` it runs: --task or the one suggested, e.g. t2a for a
    text-to-audio model, which writes sound)."""
    from omniloop.api.output_paths import AUDIO_FILES, IMAGE_FILES, TEXT_FILES, VIDEO_FILES

    task = task or (TaskType(args.task) if args.task is not None else None)
    if task is TaskType.REASON:
        return [TEXT_FILES]
    if args.audio_only or task is TaskType.T2A:
        return [AUDIO_FILES]
    if task is not None and task.makes_image:
        return [IMAGE_FILES]
    return [VIDEO_FILES] if task is not None else [VIDEO_FILES, AUDIO_FILES, TEXT_FILES]  # before loading: any


def _declared_task(args: argparse.Namespace, declared: Any) -> TaskType | None:
    """Before loading: --task, or the task the manifest's tasks suggest (None: not known yet)."""
    from omniloop.request import Modality, suggest_task

    if args.task is not None:
        return TaskType(args.task)
    if declared is None:
        return None
    given = ([Modality.IMAGE] if args.image is not None else []) + ([Modality.VIDEO] if args.video is not None else [])
    return suggest_task([TaskType(t) for t in declared.tasks], given)


def _task(args: argparse.Namespace, gen: Any) -> TaskType:
    """--task, or the task the offline API suggests for these flags (``request.suggest_task``)."""
    return gen.task_for(args.task, image=args.image is not None, video=args.video is not None)


def _check_output(args: argparse.Namespace, task: TaskType | None = None) -> None:
    from omniloop.api.output_paths import output_file
    from omniloop.api.preflight import check_writable

    errors = []
    for kind in _output_kinds(args, task):
        try:
            check_writable(output_file(args.output, "check", **kind), "--output", args.output)
            return
        except ValueError as e:
            errors.append(str(e).replace("output_path", "--output", 1))
    raise ValueError(errors[0])


def _generation_flags(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """The generation flags set, as DiffusionParams fields (diffusers' alias flags such as
    --num-inference-steps resolved by the request builder's table; two flags that set one
    field must agree), and field -> the flag that set it."""
    given = collect(args, args._params)
    spelled = {f"--{n.replace('_', '-')}": n for n in sorted(given, key=lambda n: n not in ALIASES)}  # aliases first
    fields = Fields()
    fields.put_flat({flag: given[n] for flag, n in spelled.items()},
                    {flag: ALIASES.get(n, n) for flag, n in spelled.items()})
    return fields.values, fields.names


def _knob_flags(args: argparse.Namespace) -> dict[str, Any]:
    """``--knob NAME=VALUE`` flags: the model's loop knobs by flat name (VALUE as JSON when it
    parses, else the text); resolved once the model is loaded (its ``pipeline.knobs``)."""
    import json

    knobs: dict[str, Any] = {}
    moved = [f"{name}={value}" for name in MOVED_TO_LOOPS if (value := vars(args).get(f"moved_{name}")) is not None]
    for given in moved:
        flag = "--" + given.partition("=")[0].replace("_", "-")
        print(f"warning: {flag} is deprecated (a loop knob now): pass --knob {given}", file=sys.stderr)
    for given in [*moved, *(args.knob or ())]:
        name, eq, text = given.partition("=")
        name = name.strip()
        if not eq or not name.isidentifier():
            raise ValueError(f"--knob {given}: pass NAME=VALUE, e.g. --knob stg_scale=2.0")
        if name in DiffusionParams.model_fields or name in ALIASES:
            raise ValueError(f"--knob {given}: {name} is a generation flag every model takes; pass "
                             f"--{ALIASES.get(name, name).replace('_', '-')}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        if name in knobs and knobs[name] != value:
            raise ValueError(f"--knob {given} disagrees with --knob {name}={json.dumps(knobs[name])}; "
                             "pass one of them")
        knobs[name] = value
    return knobs


def _cmd_generate(args: argparse.Namespace) -> int:
    from omniloop.api import preflight

    # every flag is checked before the model loads (which takes seconds): first those that
    # need no torch (api/preflight.py; the manifest's tasks, limits and shape rules), then the
    # deployment's (device and kernels: they import torch)
    prompt = require_prompt(args.prompt)
    if args.task is not None:
        args.task = parse_task(args.task, "--task").value  # the API's and the server's message for a bad task
    params, flags = _generation_flags(args)
    args.knobs = _knob_flags(args)
    try:
        DiffusionParams(**params)
    except ValidationError as e:
        raise flag_error(e, params, flags) from None
    declared = preflight.declared_model(args.model or DEFAULT_MODEL)
    if declared is not None:
        preflight.check_task(declared, args.task)
    _check_output(args, _declared_task(args, declared))
    if args.image is not None and not Path(args.image).is_file():
        raise FileNotFoundError(f"--image {args.image}: no such file")
    if args.last_image is not None and args.image is None:
        raise ValueError("--last-image needs --image (the first frame) too")
    if args.last_image is not None and not Path(args.last_image).is_file():
        raise FileNotFoundError(f"--last-image {args.last_image}: no such file")
    if args.control_image is not None and not Path(args.control_image).is_file():
        raise FileNotFoundError(f"--control-image {args.control_image}: no such file")
    for flag, path in (("--video", args.video), ("--mask", args.mask),
                       *(("--reference-image", r) for r in args.reference_images or ())):
        if path is not None and not Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
    if args.mask is not None and args.video is None:
        raise ValueError("--mask says which pixels of --video to generate; pass --video too")
    if declared is not None:
        preflight.check_shape(declared, args.task, params)
    preflight.check_model_exists(args.model or DEFAULT_MODEL)  # before the deployment's checks import torch
    deploy = _deploy_from_flags(args)
    deploy.check_device()
    if declared is None:  # a checkpoint folder: its variant's tasks, from its index (no weights)
        preflight.check_checkpoint_task(args.model or DEFAULT_MODEL, args.task)
    preflight.check_lora_files(deploy.lora_files)
    preflight.check_lora_refs(params.get("loras", []), deploy.lora_files)
    try:
        preflight.check_deploy_limits(deploy.limits, args.task, params, declared)
    except ValueError as e:  # the engine's LimitExceeded, in flag terms
        raise _in_flag_terms(e) from None
    return _load_and_generate(args, deploy, prompt, params)


def _load_and_generate(args: argparse.Namespace, deploy: DeployConfig, prompt: str, params: dict[str, Any]) -> int:
    from omniloop.api.generator import VideoGenerator

    t0 = time.perf_counter()
    with VideoGenerator.from_pretrained(args.model or DEFAULT_MODEL, deploy=deploy) as gen:  # closes a pool's ranks
        load_s = time.perf_counter() - t0
        return _generate_with(gen, args, prompt, params, load_s)


def _generate_with(gen: Any, args: argparse.Namespace, prompt: str, params: dict[str, Any], load_s: float) -> int:
    """The checks that need the loaded model, the run, and its one-line summary."""
    from omniloop.api.output_paths import AUDIO_FILES
    from omniloop.api.progress import ProgressBars

    task = _task(args, gen)
    _check_output(args, task)  # now knowing what the model makes, still before any work
    if task is TaskType.REASON:
        return _generate_text(args, gen, prompt, params, load_s)
    params = {**params, **args.knobs}
    sampling = collect(args, args._sampling)
    if sampling:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(sampling))
        raise ValueError(f"{flags} apply to --task reason (text out); drop them for task {task.value}")
    audio_only = _output_kinds(args, task)[0] is AUDIO_FILES
    if audio_only and args.image is not None:
        raise ValueError("--image conditions a video; drop it with --audio-only or a text-to-audio model")
    bars = None
    try:
        if audio_only:
            bars = None if args.no_progress else ProgressBars([])
            result = gen.generate_audio(prompt, task=args.task, output_path=args.output, on_event=bars, **params)
        else:
            request = gen.build_request(prompt, image=args.image, last_image=args.last_image,
                                        control_image=args.control_image, video=args.video, mask=args.mask,
                                        reference_images=args.reference_images or (), task=task, **params)
            bars = None if args.no_progress else ProgressBars(gen.pipeline.active_nodes(request))
            result = gen.run_video(request, output_path=args.output, on_event=bars)
    except FieldError as e:  # a --knob the model's loops lack, or its bad value
        raise ValueError(f"--knob {e}" if e.field in args.knobs else str(_in_flag_terms(e))) from None
    except ValueError as e:  # refused at admission: the family's checks or the deployment's limits
        raise _in_flag_terms(e) from None
    finally:
        if bars is not None:
            bars.close()
    if audio_only:
        what = f"{result.audio.shape[0]} ch, {result.seconds:.2f} s @ {result.sample_rate} Hz"
    elif result.path is not None and result.path.suffix == ".png":
        what = f"an image {result.frames.shape[2]}x{result.frames.shape[1]}"
    else:
        f, h, w, _ = result.frames.shape
        sound = "" if result.audio is None else \
            f", sound {result.audio.shape[1] / result.sample_rate:.2f} s @ {result.sample_rate} Hz"
        what = f"{f} frames {w}x{h} @ {result.fps} fps{sound}"
    print(f"wrote {result.path} ({what}, seed {result.seed}) in {result.metrics.run_s:.2f}s (load {load_s:.2f}s)")
    return 0


def _generate_text(args: argparse.Namespace, gen, prompt: str, params: dict, load_s: float) -> int:
    """--task reason: the AR loop's text on stdout (and in --output's .txt file)."""
    wrong = sorted(set(params) - {"seed"}) + (["image"] if args.image is not None else []) + \
        (["audio_only"] if args.audio_only else []) + (["knob"] if args.knobs else [])
    if wrong:
        flags = ", ".join("--" + w.replace("_", "-") for w in wrong)
        raise ValueError(f"{flags} do(es) not apply to --task reason (text out); drop them, or pass "
                         "--max-tokens/--temperature/--top-p/--top-k/--repetition-penalty/--seed")
    sampling = {**collect(args, args._sampling), **({"seed": params["seed"]} if "seed" in params else {})}
    try:
        SamplingParams(**sampling)
    except ValidationError as e:
        raise flag_error(e, sampling) from None
    try:
        result = gen.generate_text(prompt, output_path=args.output, **sampling)
    except ValueError as e:  # refused at admission (context limit, KV pool, inputs the model cannot see)
        raise _in_flag_terms(e) from None
    print(result.text)
    print(f"wrote {result.path} ({len(result.token_ids)} tokens, finish {result.finish_reason}, seed {result.seed}) "
          f"in {result.metrics.run_s:.2f}s (load {load_s:.2f}s)", file=sys.stderr)
    return 0


def _models_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the built-in models and the checkpoint families this omniloop loads",
                       description="The built-in models (--model NAME: shipped inside the package) with their tasks "
                       "and defaults, then the checkpoint families (--model DIR) and the layouts each loads.",
                       formatter_class=DefaultsHelpFormatter)
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    from omniloop.models.catalog import BUILTIN_MODELS, family_cards
    from omniloop.models.manifest import read_manifest

    print("built-in models (--model NAME; shipped inside the package, no download):")
    for name, path in sorted(BUILTIN_MODELS.items()):
        m = read_manifest(path)
        d = m.defaults
        shape = f"{d.get('width')}x{d.get('height')}, {d.get('num_frames')} frames, {d.get('steps')} steps"
        print(f"  {name:<18} {m.description or m.variant}")
        print(f"  {'':<18} tasks {', '.join(m.tasks)}; default {shape}")
    print("\nfamilies (--model DIR: a checkpoint directory of one of these layouts):")
    cards = family_cards()  # torch-free: each family folder's family.json; sorted by family
    for family in dict.fromkeys(c.family for c in cards):  # one entry a family, its layouts under it
        first, *others = [c for c in cards if c.family == family]
        print(f"  {family:<18} {first.description}")
        print(f"  {'':<18} {_layout_names(first)}")
        for card in others:  # another layout of the same family (Wan's and FAR's manifest layout)
            print(f"  {'':<18} or {_layout_names(card)}: {card.description}")
    return 0


def _layout_names(card: LayoutCard) -> str:
    """A layout's model_index.json classes; our own manifest layout by its file's name."""
    return ", ".join("omniloop_model.json" if c.startswith("omniloop:") else c for c in card.diffusers_classes)


def _comfy_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("comfy", help="ComfyUI workflows (API or UI format JSON) on omniloop",
                       formatter_class=DefaultsHelpFormatter)
    kinds = p.add_subparsers(dest="comfy_command", required=True)
    c = kinds.add_parser("check", help="coverage report: the nodes supported and refused, the compiled requests, "
                         "what runs differently from ComfyUI; exit 1 if a workflow is refused",
                         formatter_class=DefaultsHelpFormatter)
    c.add_argument("workflow", nargs="+", help="workflow .json files")
    c.add_argument("--models", default=None, metavar="DIR", help="a ComfyUI models folder with omniloop-models.json "
                   "(default: file names are not checked)")
    c.add_argument("--input", default=None, metavar="DIR", help="LoadImage's folder (default: names not checked)")
    c.add_argument("--exact", action="store_true", help="refuse what would run differently from ComfyUI")
    c.add_argument("--json", action="store_true", help="one JSON line per workflow instead of the report")
    c.set_defaults(func=_cmd_comfy_check)


def _cmd_comfy_check(args: argparse.Namespace) -> int:
    import json

    from omniloop.workflows.coverage import coverage
    from omniloop.workflows.model_folder import ModelFolder

    models = ModelFolder.load(args.models) if args.models else None
    refused = 0
    for path in map(Path, args.workflow):
        report = coverage(path.read_bytes(), path.name, models, Path(args.input) if args.input else None, args.exact)
        refused += report.compiled is None
        print(json.dumps(report.row()) if args.json else report.render() + "\n")
    return 1 if refused else 0


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate generated media", formatter_class=DefaultsHelpFormatter)
    kinds = p.add_subparsers(dest="eval_command", required=True)
    a = kinds.add_parser("adherence", help="shapes-world prompt adherence (color, shape, motion) as a JSON report",
                         formatter_class=DefaultsHelpFormatter)
    a.add_argument("--videos", default=None, help="directory of .mp4 files, one .mp4, or a glob")
    a.add_argument("--prompts", default=None, help='JSONL of {"video": path, "prompt": text} (default: '
                   '<video>.txt, else the prompt omniloop generate wrote into the mp4)')
    a.add_argument("--ground-truth", type=int, default=None, metavar="N",
                   help="self-check: render N held-out ground-truth clips and evaluate them")
    a.add_argument("--seed", type=int, default=0, help="held-out prompt seed for --ground-truth")
    a.add_argument("--size", type=int, default=128, help="height and width of --ground-truth clips")
    a.add_argument("--h264", action="store_true", help="pass --ground-truth clips through an H.264 round trip")
    a.add_argument("--output", default=None, help="also write the JSON report to this file")
    a.set_defaults(func=_cmd_eval_adherence)


def _cmd_eval_adherence(args: argparse.Namespace) -> int:
    from omniloop.eval.adherence import evaluate, file_pairs, ground_truth_pairs, load_pairs

    if args.ground_truth is not None:
        if args.ground_truth < 1:
            raise ValueError(f"--ground-truth {args.ground_truth}: pass a number of clips >= 1")
        pairs = ground_truth_pairs(args.ground_truth, seed=args.seed, height=args.size, width=args.size, h264=args.h264)
    elif args.videos or args.prompts:
        pairs = load_pairs(file_pairs(args.videos, args.prompts))
    else:
        raise ValueError("pass --videos DIR_OR_GLOB (with --prompts FILE.jsonl or .txt sidecars) or --ground-truth N")
    text = evaluate(pairs).to_json(indent=2)
    if args.output:
        Path(args.output).write_text(text + "\n")
    print(text)
    return 0


def _add_server_flags(p: argparse.ArgumentParser, *, drain_default: float) -> None:
    """The flags ``omniloop serve`` and ``omniloop dynamo-worker`` share, spelled once."""
    p.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                   help="checkpoint directory or built-in name (default: shapes-t2v, the embedded model); "
                   "omniloop serve takes it repeated (--model flux=/ckpt/FLUX.1-dev --model wan=/ckpt/Wan2.1): "
                   "several models on one server, the request's 'model' picks, the first is the default")
    p.add_argument("--served-model-name", default=None, help="the 'model' clients pass (default: the directory name)")
    p.add_argument("--deploy-config", default=None,
                   help="YAML file of deploy options, with an optional 'serve:' section")
    p.add_argument("--drain-timeout", "--drain-timeout-s", dest="drain_timeout_s", type=float, default=None,
                   metavar="SECONDS",
                   help=f"on SIGTERM, seconds in-flight requests may take before they are cancelled "
                   f"(default: {drain_default:g})")
    w = p.add_argument_group("warmup (run before the server reports ready; a failure exits non-zero)")
    w.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                   help=f"denoise steps of the warmup request; 0 disables it (default: {DEFAULT_WARMUP_STEPS})")
    w.add_argument("--warmup-size", default=None, metavar="WxH",
                   help="WIDTHxHEIGHT of the warmup request (default: the model's, clamped to what it and the limits allow)")
    w.add_argument("--warmup-frames", type=int, default=None, metavar="N",
                   help="frames of the warmup request (default: the model's, clamped like the size)")
    p.set_defaults(_deploy=add_schema_flags(p, DeployConfig, skip={"plugins"}, group="deployment"))


def _warmup_from_flags(args: argparse.Namespace) -> list[DiffusionParams] | None:
    """One warmup shape from the flags (unset fields: the model's default shape, clamped);
    None when no warmup flag is given (the config's warmup applies), [] for 0 steps."""
    if args.warmup_steps is None and args.warmup_size is None and args.warmup_frames is None:
        return None
    if args.warmup_steps == 0:
        return []
    width = height = None
    if args.warmup_size:
        try:
            width, height = (int(v) for v in args.warmup_size.split("x"))
        except ValueError:
            raise ValueError(f"--warmup-size {args.warmup_size!r}: pass WIDTHxHEIGHT, e.g. 832x480") from None
    fields = {"steps": args.warmup_steps, "width": width, "height": height, "num_frames": args.warmup_frames}
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        return [DiffusionParams(**given)]
    except ValidationError as e:
        raise flag_error(e, given, {"steps": "--warmup-steps", "width": "--warmup-size", "height": "--warmup-size",
                                    "num_frames": "--warmup-frames"}) from None


def _dynamo_parser(sub: argparse._SubParsersAction) -> None:
    import os

    p = sub.add_parser("dynamo-worker", help="serve a model as an NVIDIA Dynamo backend (needs the 'fleet' extra)",
                       formatter_class=DefaultsHelpFormatter)
    _add_server_flags(p, drain_default=DEFAULT_DRAIN_TIMEOUT_S)
    p.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"), help="Dynamo namespace")
    p.add_argument("--component", default="omniloop", help="Dynamo component (endpoints: <component>.videos/.images)")
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                   choices=["etcd", "file", "kubernetes", "mem"], help="'file' needs no etcd (DYN_FILE_KV sets the directory)")
    p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"), choices=["tcp", "nats"])
    p.add_argument("--modalities", default=None, help="videos,images (default: what the model's tasks allow)")
    p.set_defaults(func=_cmd_dynamo_worker)


def _cmd_dynamo_worker(args: argparse.Namespace) -> int:
    from omniloop.api.generator import DEFAULT_MODEL

    deploy = _deploy_from_flags(args)
    warmup = _warmup_from_flags(args)
    try:
        from omniloop.serve.dynamo.worker import WorkerConfig, run_worker
    except ImportError as e:
        print(f"error: {e}; install the fleet extra: pip install -e '.[fleet]' && pip install --no-deps ai-dynamo==1.6.1",
              file=sys.stderr)
        return 2
    if args.model and len(args.model) > 1:
        raise ValueError("--model: a Dynamo worker serves one model; run one worker per model")
    config = WorkerConfig(
        model=str(args.model[0] if args.model else DEFAULT_MODEL), served_model_name=args.served_model_name, namespace=args.namespace,
        component=args.component, discovery_backend=args.discovery_backend, request_plane=args.request_plane,
        modalities=tuple(args.modalities.split(",")) if args.modalities else None,
        drain_timeout_s=args.drain_timeout_s if args.drain_timeout_s is not None else DEFAULT_DRAIN_TIMEOUT_S,
        warmup=None if warmup is None else tuple(warmup), deploy=deploy,
    )
    return run_worker(config)


# ServeConfig fields the shared server flags set (spelled the same for the Dynamo worker)
_SHARED_SERVE_FIELDS = {"served_model_name", "drain_timeout_s", "warmup"}


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from omniloop.serve.config import ServeConfig

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (videos, images, events, metrics)",
                       formatter_class=DefaultsHelpFormatter)
    _add_server_flags(p, drain_default=DEFAULT_DRAIN_TIMEOUT_S)
    p.set_defaults(_serve=add_schema_flags(p, ServeConfig, skip=_SHARED_SERVE_FIELDS, group="server"))
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from omniloop.serve.config import ServeConfig, load_config_file

    base, serve = load_config_file(args.deploy_config) if args.deploy_config else (None, ServeConfig())
    options = {**collect(args, args._serve), "served_model_name": args.served_model_name,
               "drain_timeout_s": args.drain_timeout_s, "warmup": _warmup_from_flags(args)}
    options = {k: v for k, v in options.items() if v is not None}
    try:
        serve = ServeConfig.model_validate({**serve.model_dump(), **options})
    except ValidationError as e:
        raise flag_error(e, options, {"drain_timeout_s": "--drain-timeout"}) from None
    specs = args.model or _comfy_models(serve) or [DEFAULT_MODEL]
    if specs == [DEFAULT_MODEL] and serve.session_model is None:  # the default server also serves the interactive model
        serve = serve.model_copy(update={"session_model": _interactive_default()})
    models = served_models(specs)
    if len(models) > 1 and args.served_model_name:
        raise ValueError("--served-model-name names one model; with several, name each: --model NAME=PATH")
    jobs = _open_job_store(serve, models)  # torch-free: the store's and --model's refusals come at once
    try:
        given = collect(args, args._deploy)
        try:
            deploy = DeployConfig.from_options(base, **given)  # its checks import torch
        except ValidationError as e:
            raise flag_error(e, given) from None
        from omniloop.serve.server import run_server  # torch, fastapi and the families: seconds
    except BaseException:
        jobs.close()
        raise
    # one model: its own engine (NAME= is its served name); with --comfy-models a pool, which
    # takes the models a workflow's single files build (serve/comfy.py)
    if len(models) == 1 and (serve.comfy_models is None or args.served_model_name):
        (name, model), = models.items()
        if "=" in specs[0] and serve.served_model_name is None:
            serve = serve.model_copy(update={"served_model_name": name})
        return run_server(model, deploy, serve, log_level="info" if args.verbose else "warning", jobs=jobs)
    return run_server(models, deploy, serve, log_level="info" if args.verbose else "warning", jobs=jobs)


def _open_job_store(serve: Any, models: dict[str, str]) -> Any:
    """The server's job store, opened before the heavy imports: an unusable store is refused
    first, then a --model that is neither a directory nor a built-in name (naming the closest
    built-in), each in a fraction of a second instead of after torch and the families load."""
    from omniloop.api.preflight import check_model_exists
    from omniloop.serve.jobs import JobStore

    jobs = JobStore.open(serve)
    try:
        for model in models.values():
            check_model_exists(model)
    except BaseException:
        jobs.close()
        raise
    return jobs


def _comfy_models(serve: Any) -> list[str]:
    """``--comfy-models DIR`` without ``--model``: serve the checkpoints its map names."""
    if serve.comfy_models is None:
        return []
    from omniloop.workflows import ModelFolder

    folder = ModelFolder.load(serve.comfy_models)
    unplaced = sorted(name for name, checkpoint in folder.served.items() if checkpoint.path is None)
    if unplaced:
        raise ValueError(f"--comfy-models: served models {unplaced} have no \"path\" in omniloop-models.json; give "
                         "each its checkpoint folder, or serve them with --model NAME=PATH")
    return [f"{name}={checkpoint.path}" for name, checkpoint in folder.served.items()]


def served_models(specs: list[str]) -> dict[str, str]:
    """``--model [NAME=]MODEL`` flags -> {name: model}; an unnamed one is named after its
    directory (or built-in name). Two with one name are refused, naming it."""
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, model = spec.partition("=")
        if not sep:
            name, model = Path(spec).name or spec, spec
        if not name or not model:
            raise ValueError(f"--model {spec!r}: pass MODEL or NAME=MODEL")
        if name in models:
            raise ValueError(f"--model: two models named {name!r}; name them apart: --model NAME=PATH")
        models[name] = model
    return models


def _interactive_default() -> str | None:
    """The built-in interactive model when its weights are installed (else sessions run on the
    served model, and the server says so)."""
    from omniloop.models.catalog import BUILTIN_MODELS, INTERACTIVE_MODEL

    folder = BUILTIN_MODELS.get(INTERACTIVE_MODEL)
    if folder is not None and any((folder / "transformer").glob("*.safetensors")):
        return INTERACTIVE_MODEL
    print(f"omniloop serve: {INTERACTIVE_MODEL} is not installed (scripts/train_interactive.py install); "
          "sessions use the served model", file=sys.stderr)
    return None


# the top-level help's "what next": commands that run as written on a CPU, no download
START_HERE = """start here (the embedded shapes-t2v model, on a CPU, no download):
  omniloop generate "a red circle moving right"        # -> outputs/<request id>.mp4
  omniloop eval adherence --videos outputs              # did the clips follow their prompts?
  omniloop models                                       # the built-in models and checkpoint families
  omniloop serve                                        # the OpenAI-compatible server on 127.0.0.1:8000
each command's flags: omniloop COMMAND --help"""


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(prog="omniloop", description="omniloop generation runtime", epilog=START_HERE,
                              formatter_class=argparse.RawDescriptionHelpFormatter)  # subparsers: the same class
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level (model loading, the engine)")
    # not required: a bare ``omniloop`` prints this help and the first commands, not an argparse error
    sub = parser.add_subparsers(dest="command", metavar="{generate,models,eval,serve,dynamo-worker,comfy}")
    _generate_parser(sub)
    _models_parser(sub)
    _eval_parser(sub)
    _serve_parser(sub)
    _dynamo_parser(sub)
    _comfy_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:  # refused by the subcommand they were given to, with the closest flag it has
        refuse_unknown(parser, args, extras)
    if args.command is None:  # a bare ``omniloop`` (or only -v): the help, with the first commands to try
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except WarmupFailed as e:  # the model loaded but cannot run its warmup: not ready, ever
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT; writers leave no partial file
        print("interrupted", file=sys.stderr)
        return 130


# commands whose process ends with main(): nothing of theirs runs at interpreter exit
_QUICK_EXIT = frozenset({"generate", "models", "eval", "comfy"})


def entry() -> NoReturn:
    """The ``omniloop`` console script: ``main()``, then, for a command that is done once it
    returns (its files written and renamed, its engine closed), the process leaves without the
    interpreter's teardown of torch and the other loaded modules, which took 5-11 s after a
    generate on a 2-core machine under load (``benchmarks/bench_cli_threads.py``:
    ``startup_exit_s``). A server command exits normally."""
    try:
        code = main()
        sys.stdout.flush()  # a closed pipe shows here, not at teardown
    except SystemExit as e:  # argparse: --help (0) and usage errors (2)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BrokenPipeError:  # stdout's reader left (`omniloop eval adherence ... | head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the later flushes write nowhere
        code = 128 + 13  # as a process killed by SIGPIPE (`cat` in the same pipe)
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if command is None or command in _QUICK_EXIT:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
