"""Causal video (FAR, random weights) on the engine: chunk latency, frames per second, KV
bytes per session, and how many concurrent sessions hold real time, with step batching vs
one session at a time (JSON lines).

A session here is one T2V rollout started at t=0; it **holds real time** when it makes video
at least as fast as it plays: ``frames / (last chunk - submit) >= --realtime-fps`` (16).
"batched": the engine batches the sessions' steps (same chunk, same shapes: one forward);
"one_at_a_time": ``max_batch=1`` (steps never batch; the scheduler runs them in turn).

    python benchmarks/bench_causal.py                 # GPU: FAR-Wan2.1-1.3B architecture, 480x832x81, 4 steps
    python benchmarks/bench_causal.py --tiny          # CPU smoke: the 2-block toy at 32x64x17
    python benchmarks/bench_causal.py --shapes        # the interactive shapes model (CPU or GPU): live sessions

``--shapes``: sessions of the shipped ``shapes-interactive`` (64x64, its default steps per
chunk, one action per chunk sent as the chunk before it is emitted); when it is not installed,
the same architecture with the ``shapes-t2v`` weights it is trained from (``weights`` says
which: the timings do not depend on them). Time to first chunk (submit -> first chunk
emitted) and chunk latency (gaps between a session's chunks), p50/p95, for 1..N concurrent
sessions; ``--tiny`` with ``--shapes``: 4 chunks, 1 step (smoke). ``--text-encoder PACK``:
a MiniLM pack for machines without the wheel (the H200).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, jsonl_sink  # noqa: E402
from far_random import save_random_far  # noqa: E402
from omniloop.engine import Engine, EngineConfig, SchedulingPolicy  # noqa: E402
from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.request import (ArtifactEvent, DiffusionParams, OmniRequest, TaskType, TextPart,  # noqa: E402
                              VideoChunkArtifact)


def _request(rid: str, args) -> OmniRequest:
    return OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text=f"a red circle moving right {rid}")],
                       diffusion=DiffusionParams(steps=args.steps, height=args.height, width=args.width,
                                                 num_frames=args.frames, seed=hash(rid) % 1000, guidance_scale=1.0))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_sessions(pipeline, n: int, mode: str, args) -> dict:
    """``n`` sessions submitted together; per-chunk arrival times from the engine's events."""
    policy = SchedulingPolicy(max_batch=n if mode == "batched" else 1, max_running=max(n, 1))
    engine = Engine(pipeline, EngineConfig(max_queue=256, policy=policy))
    arrivals: dict[str, list[tuple[float, int]]] = {}

    def sink(event) -> None:
        if isinstance(event, ArtifactEvent) and event.partial and isinstance(event.artifact, VideoChunkArtifact):
            arrivals.setdefault(event.request_id, []).append((time.perf_counter(), event.artifact.num_frames))

    engine.event_sink = sink
    peak_kv = 0  # the most slab bytes one session held
    t0 = time.perf_counter()
    for i in range(n):
        engine.add_request(_request(f"{mode}{n}-{i}", args))
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
            held = [r.loop.kv.nbytes for r in engine.scheduler.running.values() if hasattr(r.loop, "kv")]
            peak_kv = max([peak_kv, *held])
    wall = time.perf_counter() - t0
    fps, ttfc, gaps, frames = [], [], [], 0
    for chunks in arrivals.values():
        times = [t for t, _ in chunks]
        count = sum(f for _, f in chunks)
        frames += count
        fps.append(count / (times[-1] - t0))
        ttfc.append(times[0] - t0)
        gaps += [b - a for a, b in zip(times, times[1:])]
    return {
        "metric": "sessions", "mode": mode, "sessions": n, "wall_s": wall,
        "fps_per_session_min": min(fps), "fps_per_session_median": statistics.median(fps),
        "aggregate_fps": frames / wall, "ttfc_s_median": statistics.median(ttfc), "ttfc_s_max": max(ttfc),
        "chunk_latency_p50_s": _pct(gaps, 0.5) if gaps else None, "chunk_latency_p95_s": _pct(gaps, 0.95) if gaps else None,
        "kv_bytes_per_session": peak_kv, "batched_steps": engine.stats.batched_steps, "steps": engine.stats.steps,
        "realtime": min(fps) >= args.realtime_fps,
    }


def shapes_pipeline(args, device: torch.device, dtype: torch.dtype):
    """(pipeline, weights label): the shipped interactive model, or its architecture from shapes-t2v."""
    import dataclasses
    import tempfile

    from omniloop.models.families.wan.weights import load_wan_dit
    from omniloop.models.loader import BUILTIN_DIR, BUILTIN_MODELS, INTERACTIVE_MODEL
    from omniloop.models.manifest import write_manifest
    from omniloop.train.recipes.far_checkpoint import save_far_dit
    from omniloop.train.recipes.interactive import (InteractiveRecipe, far_config, far_from_wan,
                                                    interactive_manifest)

    preloaded = {}
    if args.text_encoder:
        from omniloop.train.recipes.minilm_pack import load_packed_minilm

        preloaded["text_encoder"] = load_packed_minilm(Path(args.text_encoder), device=device, max_sequence_length=32)
    opts = LoadOptions(device=device, dtype=dtype)
    if INTERACTIVE_MODEL in BUILTIN_MODELS:
        return load_pipeline(INTERACTIVE_MODEL, opts, preloaded=preloaded)[1], INTERACTIVE_MODEL
    wan = load_wan_dit(BUILTIN_DIR / "shapes-t2v" / "transformer", dtype=torch.float32)
    root = Path(tempfile.mkdtemp(prefix="shapes_interactive_arch_"))
    save_far_dit(far_from_wan(wan, far_config(dataclasses.asdict(wan.config))), root / "transformer")
    r = InteractiveRecipe()
    write_manifest(root, interactive_manifest("shapes-interactive-arch", vae_subfolder=str(BUILTIN_DIR / "shapes-t2v" / "vae"),
                                              size=r.size, steps=r.sample_steps, shift=r.sample_shift, fps=8,
                                              max_sequence_length=32))
    return load_pipeline(root, opts, preloaded=preloaded)[1], "untrained: the shapes-t2v init (same architecture)"


def run_shapes_sessions(pipeline, n: int, args) -> dict:
    """``n`` live sessions submitted together, each steered by one action per chunk."""
    from omniloop.request import ActionPart, OutputSpec
    from omniloop.eval.shapes_actions import ACTION_NAMES

    policy = SchedulingPolicy(max_batch=n, max_running=n)
    engine = Engine(pipeline, EngineConfig(max_queue=256, policy=policy))
    arrivals: dict[str, list[float]] = {}
    submitted: dict[str, float] = {}

    def sink(event) -> None:
        if isinstance(event, ArtifactEvent) and event.partial and isinstance(event.artifact, VideoChunkArtifact):
            arrivals.setdefault(event.request_id, []).append(time.perf_counter())
            if engine.is_tracked(event.request_id):
                name = ACTION_NAMES[(event.artifact.index + len(event.request_id)) % 4]
                engine.send(event.request_id, ActionPart(name=name, values=[[0.0]]))

    engine.event_sink = sink
    chunk0 = {k: v for k, v in (("first_chunk_guidance_scale", args.first_chunk_guidance),
                                ("first_chunk_steps", args.first_chunk_steps)) if v is not None}
    for i in range(n):
        rid = f"shapes{n}-{i}"
        request = OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text="a red circle on a black background")],
                              diffusion=DiffusionParams(seed=i, steps=args.steps), outputs=OutputSpec(stream=True),
                              node_params={"rollout": {"open_ended": True, "max_chunks": args.chunks, **chunk0}})
        submitted[rid] = time.perf_counter()
        engine.add_request(request)
    t0 = time.perf_counter()
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
    wall = time.perf_counter() - t0
    ttfc = [times[0] - submitted[rid] for rid, times in arrivals.items()]
    gaps = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]
    fps = pipeline.defaults.fps or 8
    frames_per_chunk = pipeline.defaults.frames_per_latent
    steps = args.steps or pipeline.defaults.steps
    return {"metric": "shapes_sessions", "sessions": n, "chunks": args.chunks, "steps_per_chunk": steps,
            "first_chunk_guidance_scale": chunk0.get("first_chunk_guidance_scale",
                                                     pipeline.defaults.first_chunk_guidance_scale),
            "first_chunk_steps": chunk0.get("first_chunk_steps", pipeline.defaults.first_chunk_steps or steps), "wall_s": wall, "ttfc_s_p50": _pct(ttfc, 0.5), "ttfc_s_max": max(ttfc),
            "chunk_latency_p50_s": _pct(gaps, 0.5), "chunk_latency_p95_s": _pct(gaps, 0.95),
            "realtime_chunk_s": frames_per_chunk / fps,
            "realtime": _pct(gaps, 0.95) <= frames_per_chunk / fps, "batched_steps": engine.stats.batched_steps}


def main_shapes(args) -> None:
    import os

    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if args.tiny:
        args.chunks, args.steps = 4, 1
    with jsonl_sink(args.out) as sink:
        t0 = time.perf_counter()
        pipeline, weights = shapes_pipeline(args, device, dtype)
        emit({"metric": "setup", "model": "shapes-interactive", "weights": weights, "device": str(device),
              "dtype": str(dtype), "threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0],
              "size": f"{pipeline.defaults.width}x{pipeline.defaults.height}", "seconds": time.perf_counter() - t0,
              "gpu": torch.cuda.get_device_name() if cuda else None}, sink)
        run_shapes_sessions(pipeline, 1, args)  # warm-up
        for n in [int(c) for c in (args.sessions or "1,2").split(",")]:
            emit({**run_shapes_sessions(pipeline, n, args), "load_avg_1m": os.getloadavg()[0]}, sink)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke mode: the toy model at 32x64x17")
    p.add_argument("--sessions", default=None, help="comma-separated session counts (default 1,2,4; tiny 1,2)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--realtime-fps", type=float, default=16.0)
    p.add_argument("--model", default=None, help="an AnyFlowFARPipeline folder (default: random weights, saved first)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--shapes", action="store_true", help="the interactive shapes model's live sessions")
    p.add_argument("--chunks", type=int, default=17, help="--shapes: chunks per session (1 frame, then 4 each)")
    p.add_argument("--first-chunk-guidance", type=float, default=None, help="--shapes: chunk 0's guidance (the model's)")
    p.add_argument("--first-chunk-steps", type=int, default=None, help="--shapes: chunk 0's steps (the model's)")
    p.add_argument("--text-encoder", default=None, help="--shapes: a MiniLM pack folder (no wheel on the machine)")
    args = p.parse_args()
    if args.shapes:
        if "--steps" not in sys.argv:
            args.steps = None  # the model's default steps per chunk
        return main_shapes(args)
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda" if cuda else "cpu")
    args.height, args.width, args.frames = (32, 64, 17) if args.tiny else (480, 832, 81)
    if args.tiny:
        args.steps = min(args.steps, 1)
    counts = [int(c) for c in (args.sessions or ("1,2" if args.tiny else "1,2,4")).split(",")]
    with jsonl_sink(args.out) as sink:
        t0 = time.perf_counter()
        folder = Path(args.model) if args.model else save_random_far(size="tiny" if args.tiny else "full",
                                                                     device="cuda" if cuda else "cpu")
        dtype = torch.bfloat16 if cuda else torch.float32
        opts = LoadOptions(device=device, dtype=dtype, attention_backend="sdpa_cudnn" if cuda else "sdpa",
                           chunk_kv_budget_bytes=(48 << 30) if cuda else None)  # ~4 GB of slabs per 480p session
        pipeline = load_pipeline(folder, opts)[1]
        emit({"metric": "setup", "device": str(device), "dtype": str(dtype), "seconds": time.perf_counter() - t0,
              "size": f"{args.width}x{args.height}x{args.frames}", "steps": args.steps,
              "partition": list(pipeline.components["transformer"].config.chunk_partition), "gpu": torch.cuda.get_device_name() if cuda else None},
             sink)
        run_sessions(pipeline, 1, "batched", args)  # warm-up: kernels, cuDNN plans, allocator
        for mode in ("batched", "one_at_a_time"):
            for n in counts:
                if mode == "one_at_a_time" and n == 1:
                    continue  # the same run as batched with one session
                emit(run_sessions(pipeline, n, mode, args), sink)


if __name__ == "__main__":
    main()
