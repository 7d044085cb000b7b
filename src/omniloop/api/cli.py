"""The ``omniloop`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from omniloop.api.schema_flags import add_schema_flags, collect
from omniloop.deploy import DeployConfig
from omniloop.request import DiffusionParams, TaskType


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a video (with sound when the model makes it), an image or audio")
    p.add_argument("prompt", help="what to generate")
    p.add_argument("--model", default=None, help="checkpoint directory or built-in name (default: the embedded model)")
    p.add_argument("--output", default="outputs/",
                   help="mp4 (or .wav/.flac/.mp3 for audio) file or directory to write (default: outputs/)")
    p.add_argument("--audio-only", action="store_true",
                   help="write only the sound as a wav (text-to-audio models always do)")
    p.add_argument("--task", choices=[t.value for t in TaskType], default=None, help="task (default: t2v, or i2v with --image)")
    p.add_argument("--image", default=None, help="first-frame image for i2v")
    p.add_argument("--deploy-config", default=None, help="YAML file of deploy options")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.set_defaults(_params=add_schema_flags(p, DiffusionParams, skip={"plugin_params"}, group="generation"))
    p.set_defaults(_deploy=add_schema_flags(p, DeployConfig, skip={"plugins", "limits"}, group="deployment"))
    p.set_defaults(func=_cmd_generate)


def _progress_sink(enabled: bool):
    if not enabled:
        return None, lambda: None
    from tqdm import tqdm

    bars: dict[str, tqdm] = {}

    def on_event(event) -> None:
        if event.type == "progress":
            bar = bars.get(event.node)
            if bar is None:
                bar = bars[event.node] = tqdm(total=event.total, desc=event.node, unit="step", file=sys.stderr)
            bar.n = event.step
            bar.refresh()

    return on_event, lambda: [b.close() for b in bars.values()]


def _cmd_generate(args: argparse.Namespace) -> int:
    from omniloop.api.generator import DEFAULT_MODEL, VideoGenerator

    deploy = DeployConfig.from_yaml(args.deploy_config) if args.deploy_config else None
    t0 = time.perf_counter()
    gen = VideoGenerator.from_pretrained(args.model or DEFAULT_MODEL, deploy=deploy, **collect(args, args._deploy))
    load_s = time.perf_counter() - t0
    on_event, close = _progress_sink(not args.no_progress)
    audio_only = args.audio_only or (args.task in (None, TaskType.T2A.value) and gen.tasks == [TaskType.T2A.value])
    try:
        if audio_only:
            if args.image is not None:
                raise ValueError("--image conditions a video; drop it with --audio-only or a text-to-audio model")
            result = gen.generate_audio(args.prompt, task=args.task, output_path=args.output, on_event=on_event,
                                        **collect(args, args._params))
        else:
            result = gen.generate_video(
                args.prompt, image=args.image, task=args.task, output_path=args.output, on_event=on_event,
                **collect(args, args._params),
            )
    finally:
        close()
    if audio_only:
        what = f"{result.audio.shape[0]} ch, {result.seconds:.2f} s @ {result.sample_rate} Hz"
    else:
        f, h, w, _ = result.frames.shape
        sound = "" if result.audio is None else f", sound {result.audio.shape[1] / result.sample_rate:.2f} s @ {result.sample_rate} Hz"
        what = f"{f} frames {w}x{h} @ {result.fps} fps{sound}"
    print(f"wrote {result.path} ({what}, seed {result.seed}) in {result.metrics.run_s:.2f}s (load {load_s:.2f}s)")
    return 0


def _eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="evaluate generated media")
    kinds = p.add_subparsers(dest="eval_command", required=True)
    a = kinds.add_parser("adherence", help="shapes-world prompt adherence (color, shape, motion) as a JSON report")
    a.add_argument("--videos", default=None, help="directory of .mp4 files, one .mp4, or a glob")
    a.add_argument("--prompts", default=None, help='JSONL of {"video": path, "prompt": text} (default: <video>.txt)')
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


def _dynamo_parser(sub: argparse._SubParsersAction) -> None:
    import os

    p = sub.add_parser("dynamo-worker", help="serve a model as an NVIDIA Dynamo backend (needs the 'fleet' extra)")
    p.add_argument("--model", required=True, help="checkpoint directory or built-in model name")
    p.add_argument("--served-model-name", default=None, help="the 'model' clients pass (default: the directory name)")
    p.add_argument("--namespace", default=os.environ.get("DYN_NAMESPACE", "dynamo"), help="Dynamo namespace")
    p.add_argument("--component", default="omniloop", help="Dynamo component (endpoints: <component>.videos/.images)")
    p.add_argument("--discovery-backend", default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
                   choices=["etcd", "file", "kubernetes", "mem"], help="'file' needs no etcd (DYN_FILE_KV sets the directory)")
    p.add_argument("--request-plane", default=os.environ.get("DYN_REQUEST_PLANE", "tcp"), choices=["tcp", "nats"])
    p.add_argument("--modalities", default=None, help="videos,images (default: what the model's tasks allow)")
    p.add_argument("--drain-timeout", type=float, default=25.0,
                   help="on SIGTERM, seconds in-flight requests may take before they are cancelled (default 25)")
    p.add_argument("--warmup-steps", type=int, default=1, help="denoise steps of the warmup request; 0 disables it")
    p.add_argument("--warmup-size", default=None, help="WIDTHxHEIGHT of the warmup request (default: the model's)")
    p.add_argument("--warmup-frames", type=int, default=None, help="frames of the warmup request (default: the model's)")
    p.add_argument("--deploy-config", default=None, help="YAML file of deploy options")
    p.set_defaults(_deploy=add_schema_flags(p, DeployConfig, skip={"plugins"}, group="deployment"))
    p.set_defaults(func=_cmd_dynamo_worker)


def _cmd_dynamo_worker(args: argparse.Namespace) -> int:
    try:
        from omniloop.serve.dynamo.worker import WorkerConfig, run_worker
    except ImportError as e:
        print(f"error: {e}; install the fleet extra: pip install -e '.[fleet]' && pip install --no-deps ai-dynamo==1.6.1",
              file=sys.stderr)
        return 2
    deploy = DeployConfig.from_options(DeployConfig.from_yaml(args.deploy_config) if args.deploy_config else None,
                                       **collect(args, args._deploy))
    warmup = None
    if args.warmup_steps:
        width = height = None
        if args.warmup_size:
            try:
                width, height = (int(v) for v in args.warmup_size.split("x"))
            except ValueError:
                raise ValueError(f"--warmup-size {args.warmup_size!r}: pass WIDTHxHEIGHT, e.g. 832x480") from None
        warmup = DiffusionParams(steps=args.warmup_steps, width=width, height=height, num_frames=args.warmup_frames)
    config = WorkerConfig(
        model=args.model, served_model_name=args.served_model_name, namespace=args.namespace, component=args.component,
        discovery_backend=args.discovery_backend, request_plane=args.request_plane,
        modalities=tuple(args.modalities.split(",")) if args.modalities else None,
        drain_timeout_s=args.drain_timeout, warmup=warmup, deploy=deploy,
    )
    return run_worker(config)


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    from omniloop.serve.config import ServeConfig

    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server (videos, images, events, metrics)")
    p.add_argument("--model", default=None, help="checkpoint directory or built-in name (default: the embedded model)")
    p.add_argument("--deploy-config", default=None, help="YAML file of deploy options, with an optional 'serve:' section")
    p.set_defaults(_serve=add_schema_flags(p, ServeConfig, group="server"))
    p.set_defaults(_deploy=add_schema_flags(p, DeployConfig, skip={"plugins"}, group="deployment"))
    p.set_defaults(func=_cmd_serve)


def _cmd_serve(args: argparse.Namespace) -> int:
    from omniloop.api.generator import DEFAULT_MODEL
    from omniloop.serve.config import ServeConfig, load_config_file
    from omniloop.serve.server import run_server

    deploy, serve = load_config_file(args.deploy_config) if args.deploy_config else (None, ServeConfig())
    deploy = DeployConfig.from_options(deploy, **collect(args, args._deploy))
    serve = ServeConfig.model_validate({**serve.model_dump(), **collect(args, args._serve)})
    return run_server(args.model or DEFAULT_MODEL, deploy, serve, log_level="info" if args.verbose else "warning")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omniloop", description="omniloop generation runtime")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _eval_parser(sub)
    _serve_parser(sub)
    _dynamo_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
