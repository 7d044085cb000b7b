"""Cosmos3 on one resident transformer, side by side in one run (JSON lines):

  decode      reasoner decode tokens/s at batch 1 and 32 on the paged text KV vs a full
              re-prefill of the context per token (no KV: what a loop without a cache does);
              and a per-step breakdown row (``reasoner_decode_step``): ms per engine decode
              step, ms of it in the model forward, aten ops and host syncs per step; and
              ``reasoner_decode_gap``: every decode step of the ``reasoner_decode`` workload,
              engine ms vs the model's ms (both synced), a first run and the same run again
  concurrent  reasoner tokens/s while video requests denoise on the same module (the
              scheduler interleaves and batches both kinds), vs the reasoner alone
  mixed       a trace of chat and video requests arriving together: the step scheduler vs a
              request-level FIFO (p95 latency of the chat requests, makespan)
  resident    parameter bytes of the one module both loops run on (and peak device memory)
  video       a video generation alone (latents, CFG 6): end-to-end seconds and seconds per
              denoise step, at --video-shape / --video-steps (default 480x832x33, 8 steps)

    python benchmarks/bench_cosmos3.py          # GPU: diffusers' default Cosmos3OmniTransformer, random bf16
    python benchmarks/bench_cosmos3.py --tiny   # CPU: toy sizes (ratios only; the CI smoke test)

Random weights and a small offline BPE tokenizer (its ids are valid model ids); no EOS, so
every request runs its max_tokens. Videos request latents only (no VAE decode).
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import dims, emit, fill_unset, jsonl_sink  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from omniloop.engine import Engine, EngineConfig, SchedulingPolicy, StepWork  # noqa: E402
from omniloop.models.autoencoders.wan_vae import WanVAE, WanVAEConfig  # noqa: E402
from omniloop.models.families.cosmos3 import presets as P  # noqa: E402
from omniloop.models.families.cosmos3.model import Cosmos3Config, Cosmos3Transformer  # noqa: E402
from omniloop.models.families.cosmos3.spec import build_cosmos3, cosmos3_variant  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.pipeline.pipeline import Pipeline  # noqa: E402
from omniloop.pipeline.samplers.sampler_set import flow_sampler_set  # noqa: E402
from omniloop.pipeline.stages import chat_ids, chat_messages  # noqa: E402
from omniloop.request import DiffusionParams, Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart  # noqa: E402

WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, patch_size=2, in_channels=12,
                 out_channels=12, latents_mean=tuple([0.0] * 48), latents_std=tuple([1.0] * 48))
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rope_axes_dim=[4, 2, 2])
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tokenizer():
    """A byte-level BPE with Cosmos3's special tokens and a chat template, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["a red circle moving right", "a robot arm picks up a cube", "the video is of 24 fps", "hello world"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    with tempfile.TemporaryDirectory() as d:  # a save/load round trip: the same object the loader gives
        fast.save_pretrained(d)
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(d)


def random_transformer(config: Cosmos3Config, device, dtype) -> Cosmos3Transformer:
    with torch.device("meta"):
        model = Cosmos3Transformer(config)
    # cast on meta, then materialize: the weights exist once, in ``dtype`` (an fp32 build
    # cast afterwards would hold ~90 GB at the published size and inflate the peak figure)
    model = model.to(dtype).to_empty(device=device)
    model.time_embedder.float()  # kept fp32, like the loader
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith(("norm.weight", "_norm.weight")):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model.eval().requires_grad_(False)


def build(args, device, dtype):
    tok = tokenizer()
    overrides = TINY if args.tiny else {}
    config = Cosmos3Config.from_diffusers_config({**P.COSMOS3_TRANSFORMER, **overrides,
                                                  "vocab_size": len(tok) if args.tiny else 151936})
    model = random_transformer(config, device, dtype)
    with torch.device("meta"):
        vae = WanVAE(WanVAEConfig(**WAN22_VAE))  # only its config is read: videos return latents
    components = {"transformer": model, "tokenizer": tok, "vae": vae,
                  "sampler": flow_sampler_set("flow_unipc", shift=5.0)}
    options = LoadOptions(device=device, dtype=dtype, kv_cache_gb=args.kv_cache_gb,
                          cuda_graphs=getattr(args, "cuda_graphs", False))  # refused off CUDA
    built = build_cosmos3(cosmos3_variant({"_class_name": "Cosmos3OmniPipeline"}), {}, components, options)
    # random weights: no EOS, every request runs its max_tokens
    return Pipeline(spec=built.spec, components=built.components, device=built.device, dtype=built.dtype,
                    defaults=built.defaults.replace(text=dataclasses.replace(built.defaults.text_or_default(), eos_token_ids=())), validate_request=built.validate_request,
                    caches=built.caches)  # the CUDA-graph runner (cuda_graphs=True) lives there


def chat(rid: str, words: int, max_tokens: int) -> OmniRequest:
    text = " ".join(["a red circle moving right"] * max(1, words // 5))
    return OmniRequest(task=TaskType.REASON, request_id=rid, inputs=[TextPart(text=text)],
                       sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0))


def video(rid: str, args) -> OmniRequest:
    h, w, f = args.video_shape
    return OmniRequest(task=TaskType.T2V, request_id=rid, inputs=[TextPart(text="a red circle moving right")],
                       diffusion=DiffusionParams(height=h, width=w, num_frames=f, steps=args.video_steps,
                                                 guidance_scale=6.0, seed=1),
                       outputs=OutputSpec(modalities=[Modality.LATENT]))


def run(pipeline, requests, *, arrivals=None, **policy):
    """Run ``requests`` (each added at its arrival offset in seconds); -> finish times,
    (seconds, tokens) of the reasoner's decode steps, denoise request-steps, makespan."""
    engine = Engine(pipeline, EngineConfig(max_queue=1024, policy=SchedulingPolicy(**policy)))
    device = pipeline.device
    last: dict = {}
    schedule = engine.scheduler.schedule

    def record():  # the plan, and whether a reason step is a decode step (not a prefill chunk)
        plan = last["plan"] = schedule()
        work = plan.work
        last["decode"] = isinstance(work, StepWork) and work.node == "reason" and not any(
            engine._requests[r].loop.prefilling for r in work.request_ids)
        return plan

    engine.scheduler.schedule = record
    pending = sorted(zip(arrivals or [0.0] * len(requests), range(len(requests))))
    done, decode_s, decode_tokens, denoise_steps = {}, 0.0, 0, 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            engine.add_request(requests[pending.pop(0)[1]])
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        s0 = time.perf_counter()
        outs = engine.step()
        sync(device)
        work = last["plan"].work
        if last["decode"]:
            decode_s, decode_tokens = decode_s + time.perf_counter() - s0, decode_tokens + len(work.request_ids)
        elif isinstance(work, StepWork) and work.node == "denoise":
            denoise_steps += len(work.request_ids)
        for out in outs:
            done[out.request_id] = time.perf_counter() - t0
            assert out.error is None, out.error
    return done, (decode_s, decode_tokens, denoise_steps), time.perf_counter() - t0


def bench_decode(pipeline, args, base, sink):
    """Paged decode vs re-prefill at every batch for the default prompt, and at batch 1 for the
    longer prompts of ``--long-prompt-words`` (a re-prefill's cost grows with the context, a
    paged decode step's barely: the ratio is a function of the context length)."""
    cases = [(b, args.prompt_words) for b in args.batches] + [(1, w) for w in args.long_prompt_words]
    for batch, words in cases:
        bench_decode_case(pipeline, args, base, sink, batch, words)


def bench_decode_case(pipeline, args, base, sink, batch: int, words: int):
    model = pipeline.components["transformer"]
    device = pipeline.device
    requests = [chat(f"c{i}", words, args.max_tokens) for i in range(batch)]
    # both sides warm on their own timed workload first: every context length the timed run
    # meets has been seen once (a fresh length's first forward pays one-time costs: allocator
    # segments, kernel selection, graph captures), as in a server that has run a while
    run(pipeline, [chat(f"w{i}", words, args.max_tokens) for i in range(batch)], max_batch=batch,
        max_running=batch)
    _, (secs, tokens, _), _ = run(pipeline, requests, max_batch=batch, max_running=batch)
    paged = tokens / secs
    chat_prompt = len(chat_ids(pipeline.components["tokenizer"], chat_messages(requests[0])))
    # the baseline: each new token re-runs the whole context through the model (no KV),
    # from the same context length the paged run starts from
    prompt = torch.randint(0, model.config.vocab_size, (batch, chat_prompt), device=device)
    for attempt in ("warm", "timed"):
        ids = prompt
        sync(device)
        t0 = time.perf_counter()
        for _ in range(args.reprefill_tokens):
            nxt = model.lm_logits(model.forward_text(ids)[:, -1:]).argmax(-1)  # [B, 1]
            ids = torch.cat([ids, nxt], dim=1)
        sync(device)
    reprefill = batch * args.reprefill_tokens / (time.perf_counter() - t0)
    emit({**base, "bench": "reasoner_decode", "batch": batch, "prompt_tokens": chat_prompt,
          "reprefill_prompt_tokens": chat_prompt, "reprefill_tokens": args.reprefill_tokens,
          "max_tokens": args.max_tokens, "paged_tokens_per_s": round(paged, 1),
          "reprefill_tokens_per_s": round(reprefill, 1), "speedup": round(paged / reprefill, 1)}, sink)


class OpCounter(TorchDispatchMode):
    """Counts the aten ops one step dispatches (each is a kernel launch on a GPU, or a few)
    and its host syncs: scalar reads (``.item()``, ``int(t)``) and device-to-host copies
    (``.tolist()``, ``.cpu()``; only visible on a GPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in ("aten.item", "aten._local_scalar_dense"):  # item under inference_mode, else its inner op
            self.syncs += 1
        elif name in ("aten._to_copy", "aten.copy_") and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            self.syncs += any(isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args)
        return out


def decode_engine(pipeline, batch: int, args) -> Engine:
    """An engine whose ``batch`` chat requests have all finished prefill (every step now decodes)."""
    engine = Engine(pipeline, EngineConfig(max_queue=1024, policy=SchedulingPolicy(max_batch=batch, max_running=batch)))
    ids = [f"s{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(chat(rid, args.prompt_words, args.step_tokens))
    while True:
        loops = [engine._requests[r].loop for r in ids]
        if all(getattr(lp, "prefilling", True) is False for lp in loops):
            return engine
        engine.step()


def bench_decode_step(pipeline, args, base, sink):
    """Where a decode step's time goes: ms per engine step (median), ms of it in the model's
    text forward, and the aten ops / host syncs one step dispatches."""
    model = pipeline.components["transformer"]
    device = pipeline.device
    for batch in args.batches:
        engine = decode_engine(pipeline, batch, args)
        for _ in range(3):  # warm
            engine.step()
        step_s = []
        for _ in range(args.step_repeats):
            sync(device)
            t0 = time.perf_counter()
            engine.step()
            sync(device)
            step_s.append(time.perf_counter() - t0)
        forward_s, inner = [], model.forward_text

        def timed(*a, **k):  # an instance attribute: Cosmos3Reasoner calls self.model.forward_text
            sync(device)
            t0 = time.perf_counter()
            out = inner(*a, **k)
            sync(device)
            forward_s.append(time.perf_counter() - t0)
            return out

        model.forward_text = timed
        try:
            for _ in range(args.step_repeats):
                engine.step()
        finally:
            del model.forward_text
        with OpCounter() as counter:
            engine.step()
        context = engine._requests["s0"].loop.context_len
        ms = 1e3 * statistics.median(step_s)
        # replayed CUDA graphs never call forward_text: no forward share to report
        fwd = 1e3 * statistics.median(forward_s) if forward_s else None
        emit({**base, "bench": "reasoner_decode_step", "batch": batch, "context_tokens": context,
              "ms_per_step": round(ms, 2), "forward_ms": None if fwd is None else round(fwd, 2),
              "outside_forward_ms": None if fwd is None else round(ms - fwd, 2),
              "tokens_per_s": round(batch / (ms / 1e3), 1), "ops_per_step": sum(counter.ops.values()),
              "layers": model.config.num_hidden_layers,
              "host_syncs_per_step": counter.syncs,
              "top_ops": dict(counter.ops.most_common(6))}, sink)
        while engine.has_unfinished():  # let the requests end (and free their KV)
            engine.step()


class ModelTimer:
    """Synced wall time of every reasoner forward (``forward_text`` start to ``lm_logits``
    end) while installed: the model's share of an engine step, with the device drained at
    both ends (the engine itself never syncs)."""

    def __init__(self, model, device) -> None:
        self.model, self.device, self.seconds, self._t0 = model, device, [], 0.0

    def __enter__(self):
        inner_text, inner_logits = self.model.forward_text, self.model.lm_logits

        def forward_text(*a, **k):  # instance attributes: Cosmos3Reasoner calls self.model.<name>
            sync(self.device)
            self._t0 = time.perf_counter()
            return inner_text(*a, **k)

        def lm_logits(*a, **k):
            out = inner_logits(*a, **k)
            sync(self.device)
            self.seconds.append(time.perf_counter() - self._t0)
            return out

        self.model.forward_text, self.model.lm_logits = forward_text, lm_logits
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward_text, self.model.lm_logits

    def take(self) -> float:
        """Seconds of the forwards since the last take (0 when none ran)."""
        out, self.seconds = sum(self.seconds), []
        return out


def decode_step_times(pipeline, requests, batch: int) -> list[tuple[float, float]]:
    """(engine seconds, model seconds) of every decode step of a fresh engine running
    ``requests`` from arrival to end (what ``reasoner_decode`` times), both synced."""
    engine = Engine(pipeline, EngineConfig(max_queue=1024, policy=SchedulingPolicy(max_batch=batch, max_running=batch)))
    for r in requests:
        engine.add_request(r)
    device, out = pipeline.device, []
    with ModelTimer(pipeline.components["transformer"], device) as timer:
        while engine.has_unfinished():
            loops = [r.loop for r in engine.scheduler.running.values()]
            decode = bool(loops) and all(lp is not None and not lp.prefilling for lp in loops)
            sync(device)
            timer.take()
            t0 = time.perf_counter()
            for o in engine.step():
                assert o.error is None, o.error
            sync(device)
            if decode:
                out.append((time.perf_counter() - t0, timer.take()))
    return out


def bench_decode_gap(pipeline, args, base, sink):
    """Engine ms per decode step vs the model's ms in it (both synced), over every decode
    step of the ``reasoner_decode`` workload: a first run (context lengths the process has
    not seen) and the same run again (same shapes). Mean vs median and the slowest step
    tell a per-token cost (in every step) from a one-time one (first steps, new shapes)."""
    for batch in args.batches:
        for attempt in ("first", "again"):
            requests = [chat(f"g{i}", args.prompt_words, args.max_tokens) for i in range(batch)]
            steps = decode_step_times(pipeline, requests, batch)
            eng = [1e3 * e for e, _ in steps]
            mod = [1e3 * m for _, m in steps]
            gap = [e - m for e, m in zip(eng, mod)]
            slowest = max(range(len(eng)), key=eng.__getitem__)
            emit({**base, "bench": "reasoner_decode_gap", "batch": batch, "run": attempt, "decode_steps": len(steps),
                  "engine_ms_mean": round(statistics.mean(eng), 2), "engine_ms_median": round(statistics.median(eng), 2),
                  "model_ms_mean": round(statistics.mean(mod), 2), "model_ms_median": round(statistics.median(mod), 2),
                  "outside_ms_mean": round(statistics.mean(gap), 2), "outside_ms_median": round(statistics.median(gap), 2),
                  "first_step_ms": round(eng[0], 2), "slowest_step": slowest, "slowest_step_ms": round(eng[slowest], 2),
                  "slowest_step_model_ms": round(mod[slowest], 2),
                  "tokens_per_s": round(batch * len(eng) / (sum(eng) / 1e3), 1)}, sink)
        bench_decode_profile(pipeline, args, base, sink, batch)


def bench_decode_profile(pipeline, args, base, sink, batch: int, top: int = 15) -> None:
    """The same workload once more under cProfile: the host functions with the most own time
    (ms per decode step, calls per step), to name what the engine spends outside the model.
    cProfile slows Python calls, so this row's times are relative, not figures."""
    import cProfile
    import pstats

    requests = [chat(f"p{i}", args.prompt_words, args.max_tokens) for i in range(batch)]
    prof = cProfile.Profile()
    prof.enable()
    steps = decode_step_times(pipeline, requests, batch)
    prof.disable()
    n = max(1, len(steps))
    stats = pstats.Stats(prof).stats  # {(file, line, func): (cc, nc, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    emit({**base, "bench": "reasoner_decode_profile", "batch": batch, "decode_steps": len(steps),
          "engine_ms_mean": round(1e3 * statistics.mean(e for e, _ in steps), 2) if steps else None,
          "top_own_ms_per_step": [{"fn": f"{Path(f).name}:{line}:{fn}", "own_ms": round(1e3 * st[2] / n, 3),
                                   "cum_ms": round(1e3 * st[3] / n, 3), "calls": round(st[1] / n, 1)}
                                  for (f, line, fn), st in rows]}, sink)


def bench_concurrent(pipeline, args, base, sink):
    chats = [chat(f"c{i}", args.prompt_words, args.max_tokens) for i in range(args.n_chat)]
    videos = [video(f"v{i}", args) for i in range(args.n_video)]
    run(pipeline, [video("warm", args)], max_batch=args.max_batch, max_running=64)
    # the chats' own workload once first (every context length they meet), as bench_decode warms:
    # the 2026-12-01 H200 row timed a cold "alone" run against a warm "with video" one
    run(pipeline, [chat(f"w{i}", args.prompt_words, args.max_tokens) for i in range(args.n_chat)],
        max_batch=args.max_batch, max_running=64)
    _, (alone_s, alone_tok, _), _ = run(pipeline, chats, max_batch=args.max_batch, max_running=64)
    _, (s, tok, steps), makespan = run(pipeline, chats + videos, max_batch=args.max_batch, max_running=64)
    emit({**base, "bench": "reasoner_with_denoise", "n_chat": args.n_chat, "n_video": args.n_video,
          "video_shape": list(args.video_shape), "video_steps": args.video_steps,
          "reasoner_alone_tokens_per_s": round(alone_tok / alone_s, 1),
          "reasoner_with_video_tokens_per_s": round(tok / s, 1), "denoise_request_steps": steps,
          "makespan_s": round(makespan, 3)}, sink)


def bench_video(pipeline, args, base, sink):
    """One video request alone, after one warm request of the same shape (kernels, autotune)."""
    run(pipeline, [video("warm", args)], max_batch=1, max_running=1)
    done, _, makespan = run(pipeline, [video("alone", args)], max_batch=1, max_running=1)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and not args.tiny else None
    emit({**base, "bench": "video_alone", "video_shape": list(args.video_shape), "video_steps": args.video_steps,
          "guidance_scale": 6.0, "seconds": round(done["alone"], 3),
          "seconds_per_step": round(done["alone"] / args.video_steps, 3), "peak_allocated_bytes": peak}, sink)


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def bench_mixed(pipeline, args, base, sink):
    trace, arrivals = [], []
    for i in range(args.trace_videos):
        trace.append(video(f"v{i}", args)), arrivals.append(i * args.trace_gap_s * 4)
    for i in range(args.trace_chats):
        trace.append(chat(f"c{i}", args.prompt_words, args.trace_tokens)), arrivals.append(i * args.trace_gap_s)
    results = {}
    for name, policy in (("fifo", dict(kind="fifo", max_running=1, max_batch=1)),
                         ("step_scheduler", dict(kind="srpt", max_running=len(trace), max_batch=args.max_batch))):
        runs = []
        for _ in range(args.trace_repeats):
            done, _, makespan = run(pipeline, trace, arrivals=arrivals, **policy)
            lat = {r.request_id: done[r.request_id] - a for r, a in zip(trace, arrivals)}
            chat_lat = [v for k, v in lat.items() if k.startswith("c")]
            video_lat = [v for k, v in lat.items() if k.startswith("v")]
            runs.append({"p50_chat_s": pct(chat_lat, 0.5), "p95_chat_s": pct(chat_lat, 0.95),
                         "p95_video_s": pct(video_lat, 0.95), "makespan_s": makespan})
        results[name] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        emit({**base, "bench": "mixed_trace", "policy": name, "n_chat": args.trace_chats, "n_video": args.trace_videos,
              "repeats": len(runs), **{k: round(v, 4) for k, v in results[name].items()}}, sink)
    emit({**base, "bench": "mixed_trace", "metric": "p95_chat_fifo_over_step_scheduler",
          "value": round(results["fifo"]["p95_chat_s"] / results["step_scheduler"]["p95_chat_s"], 2)}, sink)


def bench_resident(pipeline, base, sink):
    model = pipeline.components["transformer"]
    assert pipeline.components["reasoner"].model is model
    reason = pipeline.contexts["reason"].component("reasoner")
    shared = {p.data_ptr() for p in reason.parameters()} == {p.data_ptr() for p in model.parameters()}
    record = {**base, "bench": "resident", "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "params": sum(p.numel() for p in model.parameters()), "reasoner_shares_weights": shared}
    if pipeline.device.type == "cuda":
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["kv_pool_bytes"] = pipeline.components["text_kv"].nbytes
    emit(record, sink)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--only", default="decode,concurrent,mixed,resident")
    p.add_argument("--out", default=None)
    p.add_argument("--cuda-graphs", action="store_true", help="the reasoner's decode steps replay CUDA graphs")
    p.add_argument("--video-shape", type=dims, default=None, help="HxWxF of the video requests (video mode and the traces)")
    p.add_argument("--video-steps", type=int, default=None)
    p.add_argument("--long-prompt-words", default="", help="comma list: decode vs re-prefill at batch 1 for these "
                   "longer prompts too (words; ~2.7 tokens each)")
    args = p.parse_args(argv)
    args.long_prompt_words = [int(w) for w in args.long_prompt_words.split(",") if w]
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda:
        args.tiny = True
        torch.set_num_threads(1)
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:  # ~2 GPU minutes in all on an H200
        fill_unset(args, dict(kv_cache_gb=24.0, batches=(1, 32), max_batch=32,
                              prompt_words=200, max_tokens=64, reprefill_tokens=6, step_tokens=32, step_repeats=10,
                              video_shape=(480, 832, 33), video_steps=8, n_video=2, n_chat=16,
                              trace_videos=2, trace_chats=12, trace_tokens=32, trace_gap_s=0.2, trace_repeats=1))
    else:
        fill_unset(args, dict(kv_cache_gb=0.05, batches=(1, 4), max_batch=8,
                              prompt_words=100, max_tokens=12, reprefill_tokens=6, step_tokens=12, step_repeats=3,
                              video_shape=(32, 32, 5), video_steps=3, n_video=2, n_chat=4,
                              trace_videos=1, trace_chats=4, trace_tokens=8, trace_gap_s=0.0, trace_repeats=3))
    pipeline = build(args, device, dtype)
    base = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype).removeprefix("torch."),
            "model": "cosmos3-published-arch-random" if cuda else "cosmos3-tiny-random", "cuda_graphs": args.cuda_graphs}
    only = set(args.only.split(","))
    with jsonl_sink(args.out) as sink:
        with torch.inference_mode():
            if "decode" in only:
                bench_decode(pipeline, args, base, sink)
                bench_decode_step(pipeline, args, base, sink)
                bench_decode_gap(pipeline, args, base, sink)
            if "concurrent" in only:
                bench_concurrent(pipeline, args, base, sink)
            if "mixed" in only:
                bench_mixed(pipeline, args, base, sink)
            if "video" in only:
                bench_video(pipeline, args, base, sink)
            if "resident" in only:
                bench_resident(pipeline, base, sink)
            if args.cuda_graphs:
                emit({**base, "bench": "cuda_graphs", **pipeline.caches["cuda_graphs"].summary()}, sink)
    return 0


if __name__ == "__main__":
    sys.exit(main())
