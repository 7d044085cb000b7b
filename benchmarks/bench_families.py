"""Every family end to end, one run each, side by side (JSON lines; issue 34 item 5):

  diffusers            the diffusers pipeline as a user runs it (eager)
  diffusers_compiled   the same with ``transformer.compile_repeated_blocks(fullgraph=True)``
                       (every expert of Wan2.2), as diffusers documents regional compilation
  diffusers_cache_dit  the same (eager) with cache-dit's DBCache (``cache_dit.enable_cache``)
  ours_default         our engine with the deployment defaults (``"auto"`` kernels: the family's
                       fast path on CUDA, models/fast_path.py)
  ours_fp8             the defaults + ``quantization="fp8"`` (e4m3 block GEMMs; CUDA with FP8
                       tensor cores only: elsewhere a row says why it was skipped)
  ours_cache           the defaults + our DBCache plugin (ext/cache/dbcache.py)
  ours_eager           the CPU's kernels on the same device: sdpa, sequential CFG, no compile (what
                       the fast path buys; and the row that tells a fast-path numerics fault from
                       a model one)

for Wan2.1-T2V-1.3B 480x832x81 (50 steps, CFG 5), Wan2.2-T2V-A14B 720x1280x81 (40 steps, CFG
4 / 3, two experts; ``--layers N`` blocks per expert when memory or disk requires: the row
says so), FLUX.1-dev 1024x1024 (28 steps, guidance 3.5), LTX-2 512x768x121 with sound (40
steps) and Stable Audio Open (100 steps, 47 s). Random weights at the published
architectures (benchmarks/wan_random.py, flux_random.py, audio_random.py; small stand-in
text encoders of the real widths), bf16 on the GPU. Each timed row carries its agreement with
the plain diffusers run of the same seed: PSNR and max |diff| of the decoded output (pixels in
[0, 1] on uint8 levels, waveforms in [-1, 1]).

Times are end to end (prompt encode, denoise, decode; no text-embedding cache: diffusers has
none), after one untimed ``--warm-steps`` run of the same shape (compile, autotune, cuDNN
plans); ``--iters`` timed runs, median.

Caches: random weights make residual-difference caches skip nothing, so both DBCaches run one
forced schedule: threshold 1.0 ("always similar", the same rule in cache-dit and ours), the
first ``--cache-warmup`` steps computed, then at most ``--cache-max-continuous`` cached steps
in a row; ``Fn=--cache-fn`` first blocks always computed, ``Bn=0``. The rows give each side's
cached forwards, so "the same decisions" is checked, not assumed.

Memory: each side is built, timed and freed before the next (A14B with all layers does not
fit twice), and each family's temporary checkpoint is deleted before the next family.

    python benchmarks/bench_families.py --only wan21 --out $OUT/families_h100.jsonl     # GPU
    python benchmarks/bench_families.py --tiny                                           # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import agreement, emit  # noqa: E402
from omniloop.engine import Engine, EngineConfig  # noqa: E402
from omniloop.ext import install_plugins  # noqa: E402
from omniloop.models.fast_path import resolve_kernels  # noqa: E402
from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions, ModelSpec  # noqa: E402
from omniloop.request import DiffusionParams, OmniOutput, OmniRequest, OutputSpec, TaskType, TextPart  # noqa: E402

FAMILIES = ("wan21", "wan22_a14b", "flux", "ltx2", "stable_audio")
MODES = ("diffusers", "diffusers_compiled", "diffusers_cache_dit", "ours_default", "ours_fp8", "ours_cache", "ours_eager")
AUTO = frozenset({"attention_backend", "cfg_mode", "compile"})  # what a deployment leaves to the family
EAGER = {"attention_backend": "sdpa", "cfg_mode": "sequential", "compile": False}  # the CPU's choices, explicit
VIDEO_PROMPT = "a red circle moving right"
Decoded = dict[str, torch.Tensor]  # "video" [F, H, W, 3] / "image" [H, W, 3] in [0, 1]; "audio" [C, N] in [-1, 1]
# the caches skip nothing below 8 steps (ext/cache/taylorseer.MIN_STEPS: few-step sampling), so the
# smoke runs 8 to exercise the forced schedule on both sides
TINY_STEPS = 8
DATA_RANGE = {"video": 1.0, "image": 1.0, "audio": 2.0}


@dataclass
class Case:
    """One family's figure: how each side is built and how one generation runs."""

    family: str
    spec: ModelSpec  # its fast path decides what "auto" kernels the defaults get
    facts: dict  # architecture, shape, steps: on every row
    steps: int
    blocks: int  # transformer blocks per forward (the DBCache split needs Fn < blocks)
    diffusers: Callable[[], Any]  # a fresh diffusers pipeline on the device
    generate_ref: Callable[[Any, int], Decoded]  # (diffusers pipeline, steps) -> decoded output
    ours: Callable[[LoadOptions], Any]  # our Pipeline under these (resolved) options
    request: Callable[[str, int], OmniRequest]
    decoded: Callable[[OmniOutput], Decoded]
    repeated_blocks: list[str] | None = None  # a diffusers model that declares no ``_repeated_blocks``
    warm_steps: int = 2  # the warm run's steps: enough that every expert runs (compiles) in it
    cleanup: Callable[[], None] = lambda: None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ForcedSchedule:
    """One compute/skip schedule both DBCaches follow (random weights: see the module doc)."""

    fn: int
    warmup: int
    max_continuous: int

    def ours(self) -> dict:
        return {"dbcache": {"Fn": self.fn, "Bn": 0, "threshold": 1.0, "warmup_steps": self.warmup,
                            "max_continuous_cached_steps": self.max_continuous}}

    def cache_dit(self):
        from cache_dit import DBCacheConfig

        return DBCacheConfig(Fn_compute_blocks=self.fn, Bn_compute_blocks=0, residual_diff_threshold=1.0,
                             max_warmup_steps=self.warmup, max_continuous_cached_steps=self.max_continuous)


# -- helpers ---------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Drop what the last side left: compiled graphs (they reference its modules) and cached blocks."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def pixels(x: Any) -> torch.Tensor:
    """uint8 frames (ours) or diffusers' float [0, 1] output -> float [0, 1] on uint8 levels (as
    diffusers' own PIL output rounds), so both sides compare at the same quantization."""
    t = torch.as_tensor(x)
    return t.float() / 255.0 if t.dtype == torch.uint8 else torch.round(t.float().clamp(0, 1) * 255) / 255.0


def audio(x: Any) -> torch.Tensor:
    return torch.as_tensor(x).float().cpu()


def run_engine(pipeline, request: OmniRequest) -> tuple[OmniOutput, dict]:
    """One request through a fresh engine, to its output; and what it added to each plugin's
    forward counts (a plugin's totals are the deployment's, summed over every request)."""
    engine = Engine(pipeline, EngineConfig(nan_check=False))
    before = engine.plugin_metrics()
    rid = engine.add_request(request)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid)
    assert out.status.value == "completed", out.error
    after = engine.plugin_metrics()
    added = {name: {k: m[k] - before[name][k] for k in ("skipped", "forwards")} for name, m in after.items()
             if "forwards" in m}  # the interceptors (observers count no forwards)
    return out, added


def timed(run: Callable[[int], tuple[Decoded, dict]], case: Case, args) -> tuple[Decoded, dict, list[float]]:
    """One untimed warm run of ``args.warm_steps`` steps, then ``args.iters`` timed runs."""
    run(warm_steps(case, args))
    times, decoded, info = [], {}, {}
    for _ in range(args.iters):
        sync(args.device)
        t0 = time.perf_counter()
        decoded, info = run(case.steps)
        sync(args.device)
        times.append(time.perf_counter() - t0)
    return decoded, info, times


def warm_steps(case: Case, args) -> int:
    return min(args.warm_steps or case.warm_steps, case.steps)


def transformers(pipe) -> list[torch.nn.Module]:
    """The DiTs of a diffusers pipeline: Wan2.2's two experts, else the one transformer."""
    experts = [pipe.transformer]
    if "transformer_2" in pipe.components and pipe.transformer_2 is not None:
        experts.append(pipe.transformer_2)
    return experts


# -- the sides -------------------------------------------------------------------------------


def diffusers_sides(case: Case, modes: list[str], args, schedule: ForcedSchedule, report) -> None:
    """Plain, then compiled on the same pipeline; cache-dit on a fresh one (eager)."""
    if {"diffusers", "diffusers_compiled"} & set(modes):
        pipe = case.diffusers()
        for mode in ("diffusers", "diffusers_compiled"):
            if mode not in modes:
                continue
            info = {}
            if mode == "diffusers_compiled":
                try:
                    info = compile_diffusers(pipe, case, args)
                except ValueError as e:  # diffusers: the model declares no repeated blocks
                    report.fail(mode, e)
                    continue
            report(mode, lambda steps, pipe=pipe, extra=info: (case.generate_ref(pipe, steps), extra))
        del pipe
        free(args.device)
    if "diffusers_cache_dit" in modes:
        if importlib.util.find_spec("cache_dit") is None:
            report.skip("diffusers_cache_dit", "cache-dit is not installed (pip install cache-dit)")
            return
        import cache_dit

        pipe = case.diffusers()
        try:
            cache_dit.enable_cache(pipe, cache_config=schedule.cache_dit())
        except Exception as e:  # a pipeline cache-dit does not support: its row says so, the others run
            report.fail("diffusers_cache_dit", e)
            del pipe
            free(args.device)
            return

        def run(steps, pipe=pipe):
            decoded = case.generate_ref(pipe, steps)
            # cache-dit's stats of the last call, on each DiT: the steps whose middle blocks came from
            # the cache (a batched-CFG forward counts once for both branches; with separate CFG the
            # uncond forwards are counted apart, in _cfg_cached_steps)
            dits = transformers(pipe)
            return decoded, {"cached_steps": sum(len(t._cached_steps) for t in dits),
                             "cached_uncond_steps": sum(len(t._cfg_cached_steps) for t in dits),
                             "schedule": dataclasses.asdict(schedule)}

        report("diffusers_cache_dit", run)
        cache_dit.disable_cache(pipe)
        del pipe
        free(args.device)


def compile_diffusers(pipe, case: Case, args) -> dict:
    """Regional compilation as diffusers documents it; a model that declares no repeated blocks
    gets them named first (what diffusers' docs tell a model author to do)."""
    info: dict = {"compile": "compile_repeated_blocks(fullgraph=True)"}
    kwargs: dict = {"fullgraph": True}
    if args.device.type != "cuda":  # CPU smoke: Dynamo traces the blocks (fullgraph checked), no Inductor build
        kwargs["backend"] = "eager"
        info["compile_backend"] = "eager (CPU smoke)"
    for dit in transformers(pipe):
        if not dit._repeated_blocks:
            dit._repeated_blocks = case.repeated_blocks
            info["repeated_blocks_set"] = case.repeated_blocks
        dit.compile_repeated_blocks(**kwargs)
    return info


def ours_sides(case: Case, modes: list[str], args, schedule: ForcedSchedule, report) -> None:
    """The defaults, then the cache plugin on the same loaded pipeline; FP8 loaded anew. The
    "auto" kernels are resolved as ``load_pipeline`` resolves them (the in-memory builds do not
    pass through it), and each row names them."""
    options = resolve_kernels(LoadOptions(device=args.device, dtype=args.dtype, auto=AUTO, text_cache_bytes=0),
                              case.spec.fast_path, family=case.spec.family)
    kernels = {"attention_backend": options.attention_backend, "cfg_mode": options.cfg_mode, "compile": options.compile}
    if {"ours_default", "ours_cache"} & set(modes):
        base = case.ours(options)
        base.compiled = options.compile
        if "ours_default" in modes:
            report("ours_default", lambda steps: ours_run(case, base, steps), kernels)
        if "ours_cache" in modes:
            try:
                cached = install_plugins(base, schedule.ours(), compile=base.compiled)
            except ValueError as e:  # a family whose DiT takes no block interceptor (its loop is not run_blocks)
                report.skip("ours_cache", str(e))
            else:
                report("ours_cache", lambda steps: ours_run(case, cached, steps, plugin="dbcache"),
                       {"schedule": dataclasses.asdict(schedule), **kernels})
        del base
        free(args.device)
    if "ours_eager" in modes:
        eager = case.ours(dataclasses.replace(options, auto=frozenset(), **EAGER))  # explicit: nothing resolved
        eager.compiled = False
        report("ours_eager", lambda steps: ours_run(case, eager, steps), dict(EAGER))
        del eager
        free(args.device)
    if "ours_fp8" in modes:
        if args.device.type != "cuda":
            report.skip("ours_fp8", f"quantization='fp8' needs a CUDA GPU with FP8 tensor cores; this run is on "
                                    f"{args.device.type}")
            return
        try:
            fp8 = case.ours(dataclasses.replace(options, quantization="fp8"))
        except ValueError as e:  # a GPU without FP8 tensor cores: refused at load, naming the option
            report.skip("ours_fp8", str(e))
            return
        fp8.compiled = options.compile
        report("ours_fp8", lambda steps: ours_run(case, fp8, steps), {"quantization": "fp8", **kernels})
        del fp8
        free(args.device)


def ours_run(case: Case, pipeline, steps: int, plugin: str | None = None) -> tuple[Decoded, dict]:
    out, metrics = run_engine(pipeline, case.request(f"{case.family}-{time.perf_counter_ns()}", steps))
    info = {}
    if plugin is not None:  # counted per (CFG branch, step): cached steps are per branch, as cache-dit's
        skipped, forwards = metrics[plugin]["skipped"], metrics[plugin]["forwards"]
        branches = max(1, forwards // steps)
        info = {"cached_steps": skipped // branches, "branches": branches, "cached_forwards": skipped, "forwards": forwards}
    return case.decoded(out), info


class Reporter:
    """Times each side, compares it with the plain diffusers output and emits its row."""

    def __init__(self, case: Case, args, sink) -> None:
        self.case, self.args, self.sink = case, args, sink
        self.base = {"bench": "families", "family": case.family, **case.facts, "device": args.device_name,
                     "dtype": str(args.dtype).removeprefix("torch."), "torch": torch.__version__,
                     "iters": args.iters, "warm_steps": warm_steps(case, args)}
        if case.notes:
            self.base["notes"] = case.notes
        self.reference: Decoded | None = None
        self.medians: dict[str, float] = {}

    def __call__(self, mode: str, run: Callable[[int], tuple[Decoded, dict]], extra: dict | None = None) -> None:
        resident = None
        if self.args.device.type == "cuda":  # peak over the warm and timed runs: resident weights + activations
            torch.cuda.reset_peak_memory_stats(self.args.device)
            # what is allocated before the side runs: its weights, and anything an earlier side left
            resident = round(torch.cuda.memory_allocated(self.args.device) / 2**30, 2)
        try:
            decoded, info, times = timed(run, self.case, self.args)
        except Exception as e:  # one side failing (a compile error, OOM) must not lose the others' figures
            self.fail(mode, e)
            free(self.args.device)
            return
        row = {**self.base, "mode": mode, "status": "ok", "median_s": round(statistics.median(times), 3),
               "times_s": [round(t, 3) for t in times], "peak_gb": peak_gb(self.args.device), "resident_gb": resident,
               **(extra or {}), **info}
        if mode == "diffusers":
            self.reference = decoded
        row["agreement_vs_diffusers"] = self._agreement(decoded)
        # each output's mean level: a black (or once non-finite, cast to 0) picture shows as ~0 here
        row["output_mean"] = {key: round(float(t.float().mean()), 4) for key, t in decoded.items()}
        self.medians[mode] = row["median_s"]
        emit(row, self.sink)

    def fail(self, mode: str, error: Exception) -> None:
        emit({**self.base, "mode": mode, "status": "failed", "reason": f"{type(error).__name__}: {error}"[:2000]}, self.sink)

    def skip(self, mode: str, reason: str) -> None:
        emit({**self.base, "mode": mode, "status": "skipped", "reason": reason}, self.sink)

    def _agreement(self, decoded: Decoded) -> dict | str:
        if self.reference is None:
            return "no plain diffusers run in --modes"
        out = {}
        for key, ref in self.reference.items():
            got = decoded[key]
            out[key] = (agreement(got, ref, data_range=DATA_RANGE[key]) if got.shape == ref.shape
                        else f"shapes differ: {list(got.shape)} vs {list(ref.shape)}")
        return out

    def summary(self) -> None:
        m = self.medians
        ratios = {f"{a}_over_{b}": round(m[b] / m[a], 3)
                  for a, b in (("ours_default", "diffusers"), ("ours_default", "diffusers_compiled"),
                               ("ours_default", "ours_eager"),
                               ("ours_fp8", "diffusers_compiled"), ("ours_cache", "diffusers_cache_dit"))
                  if a in m and b in m}
        emit({**self.base, "mode": "speedups", "speedup": ratios}, self.sink)


# -- the families ----------------------------------------------------------------------------


def wan_case(args, family: str) -> Case:
    from diffusers import WanPipeline

    from wan_random import save_random_wan, save_random_wan22

    from omniloop.models.families.wan.spec import WAN

    tiny, dev = args.tiny, args.device
    a14b = family == "wan22_a14b"
    if a14b:
        h, w, f = (32, 32, 5) if tiny else (720, 1280, 81)
        steps, guidance = args.steps or (TINY_STEPS if tiny else 40), {"guidance_scale": 4.0, "guidance_scale_2": 3.0}
        folder = save_random_wan22(args.tmp / family, size="tiny" if tiny else "a14b", layers=args.layers,
                                   device=str(dev), dtype=args.dtype)
    else:
        h, w, f = (32, 32, 5) if tiny else (480, 832, 81)
        steps, guidance = args.steps or (TINY_STEPS if tiny else 50), {"guidance_scale": 5.0}
        folder = save_random_wan(args.tmp / family, size="tiny" if tiny else "full", device=str(dev))
    arch = "Wan2.2-T2V-A14B" if a14b else "Wan2.1-T2V-1.3B"
    layers = args.layers if a14b and args.layers else (2 if tiny else 40 if a14b else 30)
    facts = {"arch": arch + (" (tiny)" if tiny else ""), "shape": [h, w, f], "steps": steps, **guidance,
             "layers": layers, "published_layers": 40 if a14b else 30}

    def diffusers():
        pipe = WanPipeline.from_pretrained(folder, torch_dtype=args.dtype).to(dev)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def generate_ref(pipe, n):
        g = torch.Generator("cpu").manual_seed(0)  # ours draws its initial noise on the CPU too
        video = pipe(VIDEO_PROMPT, height=h, width=w, num_frames=f, num_inference_steps=n, generator=g,
                     output_type="np", **guidance).frames[0]
        return {"video": pixels(video)}

    def request(rid, n):  # the low-noise expert's scale is a knob of the denoise loop
        knobs = {"denoise": {"guidance_scale_2": guidance["guidance_scale_2"]}} if a14b else {}
        return OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text=VIDEO_PROMPT)], node_params=knobs,
                           diffusion=DiffusionParams(steps=n, height=h, width=w, num_frames=f, seed=0,
                                                     guidance_scale=guidance["guidance_scale"]))

    # warm: 4 steps reach the low-noise expert (flow_shift 12, boundary 0.875: the 4th step's t is 800)
    return Case(family, WAN, facts, steps, layers, diffusers, generate_ref, lambda o: load_pipeline(folder, o)[1], request,
                lambda out: {"video": pixels(out.video.frames.cpu())}, warm_steps=4 if a14b else 2,
                cleanup=lambda: shutil.rmtree(folder, True),
                notes=["1-layer UMT5 stand-in text encoder of the real width (4096)"]
                + ([f"{layers} of 40 blocks per expert (--layers)"] if a14b and args.layers else []))


def flux_case(args) -> Case:
    from flux_random import diffusers_flux_pipeline, random_flux_pipeline

    from omniloop.models.families.flux.spec import FLUX

    size, h = ("tiny", 32) if args.tiny else ("dev", 1024)
    steps = args.steps or (TINY_STEPS if args.tiny else 28)
    facts = {"arch": "FLUX.1-dev" + (" (tiny)" if args.tiny else ""), "shape": [h, h], "steps": steps,
             "guidance_scale": 3.5, "layers": "2+2" if args.tiny else "19+38"}
    plain = LoadOptions(device=args.device, dtype=args.dtype, text_cache_bytes=0)

    def diffusers():
        pipe = diffusers_flux_pipeline(random_flux_pipeline(size, plain)[1])
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def generate_ref(pipe, n):
        image = pipe("a red circle", height=h, width=h, num_inference_steps=n, guidance_scale=3.5,
                     generator=torch.Generator("cpu").manual_seed(0), output_type="np").images[0]
        return {"image": pixels(image)}

    def request(rid, n):
        return OmniRequest(task=TaskType.T2I, request_id=rid, inputs=[TextPart(text="a red circle")],
                           diffusion=DiffusionParams(steps=n, height=h, width=h, seed=0, guidance_scale=3.5),
                           outputs=OutputSpec(modalities=["image"]))

    return Case("flux", FLUX, facts, steps, 4 if args.tiny else 57, diffusers, generate_ref,
                lambda options: random_flux_pipeline(size, options)[1], request,
                lambda out: {"image": pixels(out.image.image.cpu())},
                notes=["1-layer T5 / CLIP stand-in text encoders of the real widths"])


def ltx2_case(args) -> Case:
    from audio_random import random_ltx2
    from bench_audio import NEGATIVE, PROMPT, ltx2_request

    from omniloop.models.families.ltx2.spec import LTX2

    size = "tiny" if args.tiny else "published"
    shape = SimpleNamespace(height=64 if args.tiny else 512, width=64 if args.tiny else 768,
                            frames=9 if args.tiny else 121)
    steps = args.steps or (TINY_STEPS if args.tiny else 40)
    facts = {"arch": "LTX-2" + (" (tiny)" if args.tiny else ""), "shape": [shape.height, shape.width, shape.frames],
             "steps": steps, "sound": True, "layers": 2 if args.tiny else 48}
    plain = LoadOptions(device=args.device, dtype=args.dtype, cfg_mode="batched", text_cache_bytes=0)

    def diffusers():
        ref, _ = random_ltx2(size, plain)
        ref.set_progress_bar_config(disable=True)
        return ref

    def generate_ref(pipe, n):
        tokens = pipe.tokenizer.model_max_length
        video, sound = pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=shape.height, width=shape.width,
                            num_frames=shape.frames, num_inference_steps=n, max_sequence_length=tokens,
                            generator=torch.Generator().manual_seed(11), output_type="np", return_dict=False)
        return {"video": pixels(video[0]), "audio": audio(sound[0])}

    return Case("ltx2", LTX2, facts, steps, 2 if args.tiny else 48, diffusers, generate_ref,
                lambda options: random_ltx2(size, options)[1],
                lambda rid, n: ltx2_request(rid, shape, n), _video_and_audio,
                notes=["Gemma 3 stand-in text encoder: the real width (3840), 1 decoder layer",
                       "cache-dit 1.5.3 replaces LTX2VideoTransformer3DModel.forward by the LTX-2.0 forward of an older "
                       "diffusers, which takes none of the arguments diffusers 0.42's pipeline passes (sigma, "
                       "use_cross_timestep, ...); past that, its one-forward-per-step context does not model the "
                       "pipeline's extra STG and modality-isolation forwards of other batch sizes (tried: caching then "
                       "mixes their residuals): its row fails until cache-dit catches up",
                       "our LTX-2 DiT runs its blocks in its own loop (no block interceptor): no DBCache row"])


def _video_and_audio(out: OmniOutput) -> Decoded:
    return {"video": pixels(out.video.frames.cpu()), "audio": audio(out.audio.samples)}


def stable_audio_case(args) -> Case:
    from audio_random import random_stable_audio
    from bench_audio import NEGATIVE, PROMPT

    from omniloop.models.families.stable_audio.spec import STABLE_AUDIO

    size = "tiny" if args.tiny else "published"
    steps = args.steps or (TINY_STEPS if args.tiny else 100)
    seconds = 2.0 if args.tiny else 47.0  # the model's longest clip (sample_size x hop / rate); tiny: 32 x 8 / 128
    facts = {"arch": "Stable Audio Open 1.0" + (" (tiny)" if args.tiny else ""), "audio_seconds": seconds,
             "steps": steps, "guidance_scale": 7.0, "layers": 2 if args.tiny else 24}
    plain = LoadOptions(device=args.device, dtype=args.dtype, text_cache_bytes=0)

    def diffusers():
        ref, _ = random_stable_audio(size, plain)
        ref.set_progress_bar_config(disable=True)
        return ref

    def generate_ref(pipe, n):
        wave = pipe(PROMPT, negative_prompt=NEGATIVE, audio_end_in_s=seconds, num_inference_steps=n, guidance_scale=7.0,
                    generator=torch.Generator().manual_seed(7)).audios[0]
        return {"audio": audio(wave)}

    def request(rid, n):
        return OmniRequest(request_id=rid, task=TaskType.T2A, inputs=[TextPart(text=PROMPT)],
                           diffusion=DiffusionParams(steps=n, seed=7, duration_s=seconds, guidance_scale=7.0,
                                                     negative_prompt=NEGATIVE),
                           outputs=OutputSpec(modalities=["audio"]))

    return Case("stable_audio", STABLE_AUDIO, facts, steps, 2 if args.tiny else 24, diffusers, generate_ref,
                lambda options: random_stable_audio(size, options)[1], request,
                lambda out: {"audio": audio(out.audio.samples)}, repeated_blocks=["StableAudioDiTBlock"],
                notes=["T5-base text encoder at its real size"])


def build_case(family: str, args) -> Case:
    if family in ("wan21", "wan22_a14b"):
        return wan_case(args, family)
    return {"flux": flux_case, "ltx2": ltx2_case, "stable_audio": stable_audio_case}[family](args)


def missing_packages(family: str) -> str | None:
    """Why a family cannot run here (checked before any GPU work), or None."""
    if family == "stable_audio" and importlib.util.find_spec("torchsde") is None:
        return ("Stable Audio's sampler (ours and diffusers') draws its noise with torchsde: pip install "
                "'omniloop[audio]', or carry the torchsde-0.2.6 and trampoline-0.1.2 wheels")
    return None


# -- main --------------------------------------------------------------------------------------


def bench_family(family: str, args, sink) -> None:
    reason = missing_packages(family)
    if reason is not None:
        emit({"bench": "families", "family": family, "mode": "all", "status": "skipped", "reason": reason}, sink)
        return
    case = build_case(family, args)
    try:
        report = Reporter(case, args, sink)
        fn = min(args.cache_fn, case.blocks - 1)
        warmup = args.cache_warmup if args.cache_warmup is not None else (8 if case.steps >= 40 else max(1, case.steps // 5))
        schedule = ForcedSchedule(fn=fn, warmup=warmup, max_continuous=args.cache_max_continuous)
        with torch.inference_mode():
            diffusers_sides(case, [m for m in args.modes if m.startswith("diffusers")], args, schedule, report)
            ours_sides(case, [m for m in args.modes if m.startswith("ours")], args, schedule, report)
        report.summary()
    finally:
        case.cleanup()
        del case
        free(args.device)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(FAMILIES), help=f"families, comma-separated: {','.join(FAMILIES)}")
    p.add_argument("--modes", default=",".join(MODES), help=f"sides, comma-separated: {','.join(MODES)}")
    p.add_argument("--tiny", action="store_true", help="CPU smoke: toy sizes of every architecture")
    p.add_argument("--steps", type=int, default=None, help="denoise steps for every family (default: each one's own)")
    p.add_argument("--warm-steps", type=int, default=None,
                   help="steps of the untimed warm run before each side (default 2; Wan2.2 4: both experts run)")
    p.add_argument("--iters", type=int, default=1, help="timed runs per side (median)")
    p.add_argument("--layers", type=int, default=None, help="Wan2.2-A14B: blocks per expert (published: 40)")
    p.add_argument("--cache-fn", type=int, default=8, help="DBCache Fn (first blocks always computed), both sides")
    p.add_argument("--cache-warmup", type=int, default=None,
                   help="DBCache steps computed first, both sides (default 8 from 40 steps, else steps // 5)")
    p.add_argument("--cache-max-continuous", type=int, default=2,
                   help="DBCache cached steps in a row at most, both sides (then one computed step)")
    p.add_argument("--device", default=None, help="default: cuda when there is one (not with --tiny), else cpu")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines here")
    args = p.parse_args(argv)
    args.only, args.modes = args.only.split(","), args.modes.split(",")
    for name, given, known in (("--only", args.only, FAMILIES), ("--modes", args.modes, MODES)):
        if unknown := sorted(set(given) - set(known)):
            p.error(f"{name}: unknown {unknown}; pass some of {','.join(known)}")
    args.device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    args.dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    args.device_name = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    sink = args.out.open("a") if args.out else None
    args.tmp = Path(tempfile.mkdtemp(prefix="bench_families_"))
    try:
        for family in (f for f in FAMILIES if f in args.only):
            bench_family(family, args, sink)
    finally:
        shutil.rmtree(args.tmp, ignore_errors=True)
        if sink is not None:
            sink.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
