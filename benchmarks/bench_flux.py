"""Flux image serving figures, side by side in one run (JSON lines):

  mixed   a burst of requests of mixed sizes / aspect ratios: packed step batching (every
          size in one forward) vs same-shape-only batching (sglang's rule) vs one request
          at a time; images/s over the burst's makespan
  lora    a burst where every request carries a different LoRA: one batched step for all
          (per-row deltas) vs one batch per adapter (vllm-omni's rule); images/s
  cache   a repeated-prompt trace through the text-embedding cache: hit rate, encoder calls
          and text-encode seconds, with the cache and without
  graphs  (CUDA) the small-image step path: one transformer forward eager vs replayed from a
          captured CUDA graph (what graphs could save there)
  graphs_engine  (CUDA) the same through the engine: a burst of same-size small requests
          (16 x 256x256, 16 x 512x512, 4 steps) with cuda_graphs on vs off: images/s after a
          warm burst (captures happen there; its makespan is reported too) and whether every
          output is bit-equal
  e2e     one request alone, end to end to a decoded image (text encode, --steps denoise steps,
          VAE decode) at --e2e-size (default 1024x1024), after one warm request: seconds,
          seconds per step, peak memory (``--steps 28`` is FLUX.1-dev's default)

    python benchmarks/bench_flux.py                  # H200: FLUX.1-dev architecture, random bf16 weights
    python benchmarks/bench_flux.py --tiny           # CPU smoke (CI): the 2-block toy
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import emit, fill_unset, jsonl_sink, timed  # noqa: E402
from flux_random import random_flux_pipeline, save_random_loras  # noqa: E402
from omniloop.cache.text_embeddings import CACHE_NAME as TEXT_CACHE  # noqa: E402
from omniloop.engine import Engine, EngineConfig, SchedulingPolicy  # noqa: E402
from omniloop.engine.scheduler import StepWork  # noqa: E402
from omniloop.models.families.flux.spec import flux_pipeline_spec, flux_variant  # noqa: E402
from omniloop.models.layers.cuda_graphs import CACHE_NAME as GRAPHS  # noqa: E402
from omniloop.models.layers.cuda_graphs import CudaGraphRunner  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.pipeline.pipeline import Pipeline  # noqa: E402
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart  # noqa: E402

MIXED_SIZES = [(512, 512), (256, 256), (512, 768), (768, 512), (384, 640), (640, 384), (256, 512), (768, 768)]
TINY_SIZES = [(32, 32), (32, 48), (48, 32), (16, 64), (64, 32), (48, 48)]


def request(rid: str, size: tuple[int, int], steps: int, *, prompt: str | None = None, loras=(), seed: int = 0,
            latents_only: bool = False):
    h, w = size
    outputs = OutputSpec(return_latents=True) if latents_only else OutputSpec(modalities=["image"])
    return OmniRequest(request_id=rid, task=TaskType.T2I, inputs=[TextPart(text=prompt or f"a photo, request {rid}")],
                       diffusion=DiffusionParams(height=h, width=w, steps=steps, seed=seed, loras=list(loras)),
                       outputs=outputs)


def run_burst(pipeline, reqs, *, max_batch: int, batch_key=None, latents: dict | None = None) -> dict:
    """Submit ``reqs`` at once and drive the engine to the last completion (``latents``:
    filled with each request's final latents, by request index)."""
    engine = Engine(pipeline, EngineConfig(max_queue=4096, nan_check=False,
                                           policy=SchedulingPolicy(max_batch=max_batch, max_running=len(reqs))))
    if batch_key is not None:  # a baseline's batching rule
        stage = pipeline.spec.node("denoise").stage
        original = stage.batch_key
        object.__setattr__(stage, "batch_key", lambda loop: batch_key(loop, original(loop)))
    sizes: list[int] = []
    schedule = engine.scheduler.schedule

    def plan():
        p = schedule()
        if isinstance(p.work, StepWork):
            sizes.append(len(p.work.request_ids))
        return p

    engine.scheduler.schedule = plan
    try:
        t0 = time.perf_counter()
        for r in reqs:
            engine.add_request(r)
        done = 0
        while engine.has_unfinished():
            for out in engine.step():
                assert out.status.value == "completed", out.error
                done += 1
                if latents is not None:
                    latents[[r.request_id for r in reqs].index(out.request_id)] = out.artifacts["latents"].latents
        seconds = time.perf_counter() - t0
    finally:
        if batch_key is not None:
            del stage.batch_key
    return {"requests": len(reqs), "makespan_s": round(seconds, 4), "images_per_s": round(done / seconds, 4),
            "batched_steps": len(sizes), "mean_batch": round(statistics.mean(sizes), 2) if sizes else 0.0}


def unpacked(pipeline: Pipeline) -> Pipeline:
    """The same deployment with packing off: steps batch only requests of one latent shape."""
    spec = flux_pipeline_spec(flux_variant({}), guidance_embeds=pipeline.components["transformer"].config.guidance_embeds,
                              pack=False)
    return Pipeline(spec=spec, components=pipeline.components, device=pipeline.device, dtype=pipeline.dtype,
                    defaults=pipeline.defaults, validate_request=pipeline.validate_request, caches=pipeline.caches)


def bench_mixed(pipeline, args, base, sink):
    sizes = TINY_SIZES if args.tiny else MIXED_SIZES
    rng = random.Random(0)
    burst = [rng.choice(sizes) for _ in range(args.requests)]
    warm = [request(f"warm{i}", s, 1) for i, s in enumerate(sorted(set(burst)))]
    run_burst(pipeline, warm, max_batch=args.max_batch)  # kernels, allocator, cost model
    modes = {"packed": (pipeline, args.max_batch), "same_shape": (unpacked(pipeline), args.max_batch),
             "one_at_a_time": (pipeline, 1)}
    results = {}
    for mode, (pipe, max_batch) in modes.items():
        reqs = [request(f"{mode}{i}", s, args.steps, seed=i) for i, s in enumerate(burst)]
        results[mode] = run_burst(pipe, reqs, max_batch=max_batch)
        emit({**base, "bench": "mixed_sizes", "mode": mode, "sizes": sorted(set(burst)), **results[mode]}, sink)
    emit({**base, "bench": "mixed_sizes", "mode": "ratios",
          "packed_vs_same_shape": round(results["packed"]["images_per_s"] / results["same_shape"]["images_per_s"], 3),
          "packed_vs_one_at_a_time": round(results["packed"]["images_per_s"] / results["one_at_a_time"]["images_per_s"], 3)},
         sink)


def bench_lora(pipeline, args, base, sink):
    cache = pipeline.caches["adapters"]
    files = save_random_loras(pipeline.components["transformer"], args.loras, args.lora_rank)
    for i, path in enumerate(files):
        cache.load(f"lora{i}", path)
    size = TINY_SIZES[0] if args.tiny else (512, 512)
    run_burst(pipeline, [request("warm", size, 1, loras=[("lora0", 1.0)])], max_batch=args.max_batch)

    def per_adapter(loop, key):  # one batch per adapter set
        return None if key is None else (key, tuple((r.name, r.strength) for r in loop.params.loras))

    results = {}
    for mode, rule in (("one_batch", None), ("batch_per_adapter", per_adapter)):
        reqs = [request(f"{mode}{i}", size, args.steps, loras=[(f"lora{i % len(files)}", 0.8)], seed=i)
                for i in range(args.loras)]
        results[mode] = run_burst(pipeline, reqs, max_batch=args.max_batch, batch_key=rule)
        emit({**base, "bench": "lora_burst", "mode": mode, "size": list(size), "rank": args.lora_rank,
              "adapters": len(files), **results[mode]}, sink)
    base_reqs = [request(f"nolora{i}", size, args.steps, seed=i) for i in range(args.loras)]
    plain = run_burst(pipeline, base_reqs, max_batch=args.max_batch)
    emit({**base, "bench": "lora_burst", "mode": "no_lora", "size": list(size), **plain}, sink)
    emit({**base, "bench": "lora_burst", "mode": "ratios",
          "one_batch_vs_per_adapter": round(results["one_batch"]["images_per_s"]
                                            / results["batch_per_adapter"]["images_per_s"], 3),
          "one_batch_vs_no_lora": round(results["one_batch"]["images_per_s"] / plain["images_per_s"], 3)}, sink)
    for i in range(len(files)):
        cache.unload(f"lora{i}")


def bench_cache(pipeline, args, base, sink):
    """A Zipf-like trace over a few prompts (repeats, n > 1 bursts), with and without the cache."""
    rng = random.Random(1)
    prompts = [f"prompt number {i}, a detailed scene" for i in range(args.distinct_prompts)]
    weights = [1 / (i + 1) for i in range(len(prompts))]
    trace = rng.choices(prompts, weights, k=args.trace)
    size = TINY_SIZES[0] if args.tiny else (256, 256)
    encoders = [pipeline.components["text_encoder"], pipeline.components["text_encoder_2"]]
    for mode in ("cached", "uncached"):
        cache = pipeline.caches.pop(TEXT_CACHE)
        if mode == "cached":
            from omniloop.cache.text_embeddings import TextEmbeddingCache

            pipeline.caches[TEXT_CACHE] = TextEmbeddingCache(cache.budget_bytes)
        calls, seconds = [0], [0.0]
        originals = [e.encode for e in encoders]

        def counted(fn):
            def encode(prompts, **kw):
                t0 = time.perf_counter()
                out = fn(prompts, **kw)
                if out.embeds.is_cuda:
                    torch.cuda.synchronize()
                seconds[0] += time.perf_counter() - t0
                calls[0] += len(prompts)
                return out
            return encode

        for e, fn in zip(encoders, originals):
            e.encode = counted(fn)
        try:  # arrivals in waves: repeats within a wave (n > 1) and across waves (later requests)
            reqs = [request(f"{mode}{i}", size, 1, prompt=p, seed=i) for i, p in enumerate(trace)]
            waves = [run_burst(pipeline, reqs[i:i + args.wave], max_batch=args.max_batch)
                     for i in range(0, len(reqs), args.wave)]
            result = {"requests": len(reqs), "makespan_s": round(sum(w["makespan_s"] for w in waves), 4)}
            result["images_per_s"] = round(len(reqs) / result["makespan_s"], 4)
        finally:
            for e in encoders:
                del e.encode
        stats = pipeline.caches[TEXT_CACHE].summary() if mode == "cached" else {}
        emit({**base, "bench": "text_cache", "mode": mode, "trace": len(trace), "distinct_prompts": len(set(trace)),
              "prompts_encoded": calls[0], "encode_s": round(seconds[0], 4), "hit_rate": round(stats.get("hit_rate", 0.0), 4),
              "hits": stats.get("hits", 0), "misses": stats.get("misses", 0), **result}, sink)
        if mode == "cached":
            pipeline.caches.pop(TEXT_CACHE)
        pipeline.caches[TEXT_CACHE] = cache


def bench_graphs(pipeline, args, base, sink):
    """One packed forward of one small image, eager vs a CUDA-graph replay of the same call."""
    if pipeline.device.type != "cuda":
        emit({**base, "bench": "cuda_graphs", "skipped": "needs a CUDA device"}, sink)
        return
    from omniloop.models.families.flux.model import FluxInputs
    from omniloop.models.families.flux.stages import image_ids
    from omniloop.models.layers.packed import Segments

    model, dev, dtype = pipeline.components["transformer"], pipeline.device, pipeline.dtype
    cfg = model.config
    for h, w in ((256, 256), (512, 512)):
        lh, lw = h // 8, w // 8
        n_img, n_txt = (lh // 2) * (lw // 2), 512
        inputs = FluxInputs(
            image=torch.randn(n_img, cfg.in_channels, device=dev, dtype=dtype),
            text=torch.randn(n_txt, cfg.joint_attention_dim, device=dev, dtype=dtype),
            pooled=torch.randn(1, cfg.pooled_projection_dim, device=dev, dtype=dtype),
            timestep=torch.full((1,), 0.5, device=dev), guidance=torch.full((1,), 3.5, device=dev),
            image_ids=image_ids(lh, lw, dev), text_ids=torch.zeros(n_txt, 3, device=dev),
            image_segments=Segments((n_img,)), text_segments=Segments((n_txt,)))
        with torch.inference_mode():
            eager = timed(lambda: model(inputs), warmup=3, iters=10, cuda=True)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    model(inputs)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                model(inputs)
            replay = timed(graph.replay, warmup=3, iters=10, cuda=True)
        e, r = statistics.median(eager), statistics.median(replay)
        emit({**base, "bench": "cuda_graphs", "size": [h, w], "tokens": n_img + n_txt, "eager_s": round(e, 5),
              "graph_s": round(r, 5), "graph_speedup": round(e / r, 3)}, sink)


def with_graphs(pipeline: Pipeline, runner: CudaGraphRunner) -> Pipeline:
    """The same deployment (components shared) with its step's forward through ``runner``
    (what ``cuda_graphs=True`` builds)."""
    spec = flux_pipeline_spec(flux_variant({}), guidance_embeds=pipeline.components["transformer"].config.guidance_embeds,
                              graphs=runner)
    return Pipeline(spec=spec, components=pipeline.components, device=pipeline.device, dtype=pipeline.dtype,
                    defaults=pipeline.defaults, validate_request=pipeline.validate_request,
                    caches={**pipeline.caches, GRAPHS: runner})


def bench_graphs_engine(pipeline, args, base, sink):
    """Bursts of same-size small requests through the engine, cuda_graphs off vs on. Each mode
    first runs a warm burst of the same prompts and composition (graphs are captured there,
    the text cache filled), then the timed one; outputs of the two modes compared bit for bit."""
    skipped = {}
    if pipeline.device.type != "cuda":  # the CPU smoke still drives both modes (the runner runs eager there)
        skipped = {"skipped": "CUDA graphs need a CUDA device (cuda_graphs=True is refused on a CPU)"}
    sizes = [(32, 32), (48, 48)] if args.tiny else [(256, 256), (512, 512)]
    if args.tiny:
        args.graph_requests = min(args.graph_requests, 4)
    for size in sizes:
        runner = CudaGraphRunner(max_tokens=args.graph_max_tokens)
        results, outs = {}, {}
        for mode, pipe in (("eager", pipeline), ("graphs", with_graphs(pipeline, runner))):
            def burst(tag):
                return [request(f"{tag}{i}", size, args.steps, prompt=f"a photo, request {i}", seed=i, latents_only=True)
                        for i in range(args.graph_requests)]
            warm = run_burst(pipe, burst(f"{mode}-warm"), max_batch=args.max_batch)
            outs[mode] = {}
            results[mode] = run_burst(pipe, burst(mode), max_batch=args.max_batch, latents=outs[mode])
            emit({**base, "bench": "cuda_graphs_engine", "mode": mode, "size": list(size), **skipped,
                  "warm_makespan_s": warm["makespan_s"], **results[mode],
                  **({"graphs": runner.summary()} if mode == "graphs" else {})}, sink)
        diffs = [(outs["eager"][i].float() - outs["graphs"][i].float()).abs().max().item() for i in outs["eager"]]
        emit({**base, "bench": "cuda_graphs_engine", "mode": "ratios", "size": list(size), **skipped,
              "graphs_vs_eager": round(results["graphs"]["images_per_s"] / results["eager"]["images_per_s"], 3),
              "outputs_equal": all(torch.equal(outs["eager"][i], outs["graphs"][i]) for i in outs["eager"]),
              "max_abs_diff": max(diffs), "graph_max_tokens": args.graph_max_tokens}, sink)
        runner.clear()  # free the graphs' pools before the next size


def graphs_or_reason(pipeline, args, base, sink):
    """A capture that fails is a figure too (the reason the step path stays eager): the
    error is recorded instead of ending the run after the other benches' lines."""
    try:
        bench_graphs(pipeline, args, base, sink)
    except Exception as e:  # noqa: BLE001 - e.g. an operation CUDA graphs cannot capture
        emit({**base, "bench": "cuda_graphs", "capture_failed": f"{type(e).__name__}: {e}"[:2000]}, sink)


def bench_e2e(pipeline, args, base, sink):
    h, w = (int(x) for x in args.e2e_size.split("x"))
    run_burst(pipeline, [request("warm", (h, w), args.steps)], max_batch=1)
    cuda = pipeline.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    result = run_burst(pipeline, [request("alone", (h, w), args.steps)], max_batch=1)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    emit({**base, "bench": "e2e", "height": h, "width": w, "seconds": round(seconds, 3),
          "seconds_per_step": round(seconds / args.steps, 4), "makespan_s": result.get("makespan_s"),
          "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None}, sink)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on the 2-block toy")
    p.add_argument("--only", default="mixed,lora,cache,graphs,graphs_engine")
    p.add_argument("--graph-requests", type=int, default=16, help="requests per burst in graphs_engine")
    p.add_argument("--graph-max-tokens", type=int, default=32768,
                   help="graphs_engine: the runner's token threshold (the deploy default is 16384; 16 x 512x512 "
                        "with 512 text tokens each is 24,576, so the figure covers it)")
    p.add_argument("--requests", type=int, default=None, help="mixed burst size (default 16; tiny 6)")
    p.add_argument("--steps", type=int, default=None, help="denoise steps per request (default 4; tiny 2)")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--loras", type=int, default=8, help="requests (and distinct adapters) in the LoRA burst")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--trace", type=int, default=48, help="requests in the repeated-prompt trace")
    p.add_argument("--distinct-prompts", type=int, default=8)
    p.add_argument("--wave", type=int, default=4, help="requests arriving together in the trace")
    p.add_argument("--attention-backend", default="sdpa")
    p.add_argument("--e2e-size", default=None, help="HxW of the e2e request (default 1024x1024; tiny 64x64)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.tiny:
        device, dtype, size = torch.device("cpu"), torch.float32, "tiny"
        fill_unset(args, dict(requests=6, steps=2, e2e_size="64x64"))
        args.loras, args.trace = min(args.loras, 4), min(args.trace, 16)
        torch.set_num_threads(1)
    else:
        device, dtype, size = torch.device("cuda"), torch.bfloat16, "dev"
        fill_unset(args, dict(requests=16, steps=4, e2e_size="1024x1024"))
    options = LoadOptions(device=device, dtype=dtype, attention_backend=args.attention_backend)
    t0 = time.perf_counter()
    _, pipeline = random_flux_pipeline(size, options)
    base = {"model": f"flux-{size}-random", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "steps": args.steps, "attention_backend": args.attention_backend,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    with jsonl_sink(args.out) as sink:
        emit({**base, "bench": "setup", "build_s": round(time.perf_counter() - t0, 2),
              "transformer_params": sum(p.numel() for p in pipeline.components["transformer"].parameters())}, sink)
        benches = {"mixed": bench_mixed, "lora": bench_lora, "cache": bench_cache, "graphs": graphs_or_reason,
                   "graphs_engine": bench_graphs_engine, "e2e": bench_e2e}
        with torch.inference_mode():
            for name in args.only.split(","):
                benches[name](pipeline, args, base, sink)


if __name__ == "__main__":
    main()
