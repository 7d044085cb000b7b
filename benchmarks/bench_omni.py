"""Qwen2.5-Omni at the published 7B architecture with random weights (issue 32 item 6): a spoken
answer (thinker -> talker -> token2wav) through our engine vs transformers'
``Qwen2_5OmniForConditionalGeneration.generate`` on the same weights, side by side in one run.

The checkpoint is built with transformers (random init in bf16 on the device), saved in its
``save_pretrained`` layout with a ``spk_dict.pt``, and loaded by our loader, as the family's
tests do at toy size. Measured:

* ``single``: one spoken answer at batch 1: time to the first audio chunk and the real-time
  factor (seconds of compute per second of audio). Ours streamed (``outputs.stream``: the
  talker starts at the thinker's first token, code2wav decodes window by window and emits
  audio deltas), and ours non-streamed (token2wav over the whole utterance, then BigVGAN: the
  transformers-equal graph), vs transformers' ``generate`` (non-streamed: its first audio is
  its whole audio).
* ``concurrent``: N spoken answers (streamed) added together (8 and 32 by default), the engine
  batching their thinker and talker steps and their code2wav windows (one token2wav ODE and one
  BigVGAN batch over every answer's ready window), vs the same answers one at a time; each record
  gives the engine's steps and batched steps per node (``steps_by_node``) and the first-audio p50.

Random weights emit no EOS at a useful time, so both sides run fixed lengths: exactly
``--text-tokens`` text tokens and ``--audio-tokens`` codec codes (ours: stop ids cleared on the
thinker and the talker; transformers: ``min_new_tokens == max_new_tokens`` for both). Greedy on
both sides (``temperature 0`` / ``do_sample=False``). The talker's codec head rows of the
non-speech codes (>= 8192: the specials and the ids token2wav's 8193-entry embedding cannot
read) are zeroed before the save, as a trained talker never emits them mid-speech.

    python benchmarks/bench_omni.py --out $OUT/omni_h100.jsonl      # GPU, bf16 (~5 min on an H100; --batches 8: no 32)
    python benchmarks/bench_omni.py --tiny                            # CPU smoke, the tests' tiny config
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import shutil
import signal
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ (common, bench_qwen2)
from bench_qwen2 import byte_tokenizer, no_eos, prompt, sync  # noqa: E402
from common import built_in, emit, fill_unset  # noqa: E402

from omniloop.engine.engine import Engine, EngineConfig  # noqa: E402
from omniloop.engine.scheduler import SchedulingPolicy  # noqa: E402
from omniloop.models.loader import load_pipeline  # noqa: E402
from omniloop.models.model_spec import LoadOptions  # noqa: E402
from omniloop.pipeline.pipeline import Pipeline  # noqa: E402
from omniloop.request import (  # noqa: E402
    ArtifactEvent, DiffusionParams, Modality, OmniEvent, OmniOutput, OmniRequest, OutputSpec, SamplingParams, TaskType,
    TextPart,
)

SECTIONS = ("transformers", "single", "concurrent")
SAMPLE_RATE = 24000
# The published Qwen2.5-Omni-7B config.json where transformers' Qwen2_5OmniConfig defaults
# differ from it (the talker's width, the vision tower's, untied thinker head, M-RoPE sections)
# or where the value decides the work; token2wav (DiT 22 x 1024, BigVGAN 1536 ch, upsample 240)
# is transformers' defaults, which are the published values.
# M-RoPE as config.json writes it (rope_theta + rope_scaling: what transformers 4.x reads and 5.x
# converts to rope_parameters); the sections split head_dim 128's 64 frequencies
MROPE = {"rope_theta": 1e6, "rope_scaling": {"type": "default", "rope_type": "default", "mrope_section": [16, 24, 24]}}
PUBLISHED_7B: dict[str, Any] = {
    "text": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                 num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
                 **MROPE, tie_word_embeddings=False, eos_token_id=151645, pad_token_id=151643),
    "audio": dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20, encoder_ffn_dim=5120, num_mel_bins=128,
                  output_dim=3584, n_window=100, max_source_positions=1500),
    "vision": dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                   fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14, spatial_merge_size=2,
                   temporal_patch_size=2),
    "thinker": dict(audio_token_index=151646, image_token_index=151655, video_token_index=151656,
                    audio_start_token_id=151647, audio_end_token_id=151648, vision_start_token_id=151652,
                    vision_end_token_id=151653),
    "talker": dict(vocab_size=8448, embedding_size=3584, hidden_size=896, intermediate_size=18944, num_hidden_layers=24,
                   num_attention_heads=12, num_key_value_heads=4, head_dim=128, max_position_embeddings=32768,
                   rms_norm_eps=1e-6, **MROPE),
}
SPEECH_CODES = 8192  # codes 0..8191 are speech; 8292.. are the codec's specials
VOICES = {"Chelsie": 151870, "Ethan": 151871}  # stand-in text ids for the voices' start tokens (any id < vocab)
REF_MEL_FRAMES = 300  # a 3 s reference mel per voice


# -- the checkpoint -------------------------------------------------------------------------


def omni_7b_config():
    from transformers import Qwen2_5OmniConfig

    p = PUBLISHED_7B
    return Qwen2_5OmniConfig(thinker_config=dict(text_config=p["text"], audio_config=p["audio"],
                                                 vision_config=p["vision"], **p["thinker"]),
                             talker_config=p["talker"])


def save_random_omni_7b(folder: Path, device: torch.device, dtype: torch.dtype):
    """Tokenizer + random ``Qwen2_5OmniForConditionalGeneration`` at the 7B architecture +
    ``spk_dict.pt`` saved to ``folder``; returns the transformers model (voices loaded)."""
    from transformers import Qwen2_5OmniForConditionalGeneration

    config = omni_7b_config()
    byte_tokenizer(folder, config.thinker_config.text_config.vocab_size)
    torch.manual_seed(0)
    model = built_in(device, dtype, lambda: Qwen2_5OmniForConditionalGeneration(config))
    with torch.no_grad():
        model.talker.codec_head.weight[SPEECH_CODES:] = 0  # [8448, 896]: non-speech codes never win
    model.save_pretrained(folder)
    dit = config.token2wav_config.dit_config
    g = torch.Generator().manual_seed(7)
    torch.save({name: {"bos_token": token, "cond": torch.randn(1, dit.enc_emb_dim, generator=g),  # [1, 192]
                       "ref_mel": torch.randn(1, REF_MEL_FRAMES, dit.mel_dim, generator=g) - 3.0}  # [1, T, 80] log-mel
                for name, token in VOICES.items()}, folder / "spk_dict.pt")
    model.load_speakers(folder / "spk_dict.pt")
    return model


def save_random_omni_tiny(folder: Path, device: torch.device, dtype: torch.dtype):
    """The family tests' tiny checkpoint (tests/models/qwen2_5_omni/checkpoint.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.models.qwen2_5_omni.checkpoint import save_omni_checkpoint

    return save_omni_checkpoint(folder, seed=0).to(device=device, dtype=dtype)


def samples_per_code(hf) -> int:
    """Codes -> mel frames (``repeats``) -> samples (BigVGAN's upsampling): 480 for the 7B (50
    codes a second of 24 kHz audio)."""
    t2w = hf.config.token2wav_config
    return t2w.dit_config.repeats * math.prod(t2w.bigvgan_config.upsample_rates)


def parameters(hf) -> dict[str, int]:
    """Parameters per part (the thinker's audio and vision towers apart: ours does not run them)."""
    counts = {"thinker_lm": 0, "thinker_encoders": 0, "talker": 0, "token2wav": 0}
    for name, p in hf.named_parameters():
        part = name.split(".")[0]
        if part == "thinker":
            part = "thinker_encoders" if ".audio_tower." in name or ".visual." in name else "thinker_lm"
        counts[part] += p.numel()
    return counts


# -- transformers ----------------------------------------------------------------------------


@contextmanager
def part_times(hf, device: torch.device) -> Iterator[dict[str, float]]:
    """Seconds spent in the thinker's and the talker's ``generate`` and in token2wav, per call of
    ``hf.generate`` (each wrapped on the instance, synchronized)."""
    seconds: dict[str, float] = {}
    parts = {"thinker": (hf.thinker, "generate"), "talker": (hf.talker, "generate"), "token2wav": (hf.token2wav, "forward")}
    for name, (module, attr) in parts.items():
        def timed(*a, _fn=getattr(module, attr), _name=name, **kw):
            sync(device)
            t0 = time.perf_counter()
            out = _fn(*a, **kw)
            sync(device)
            seconds[_name] = seconds.get(_name, 0.0) + time.perf_counter() - t0
            return out

        setattr(module, attr, timed)
    try:
        yield seconds
    finally:
        for module, attr in parts.values():
            delattr(module, attr)


def run_transformers(hf, tokenizer, args, device: torch.device) -> dict:
    """One spoken answer through ``generate``. A one-token left pad keeps the attention mask,
    so its talker takes the path the released model runs (see the family tests' hf_generate)."""
    ids = tokenizer(prompt(args.prompt_tokens, 0), return_tensors="pt").input_ids
    padded = torch.cat([torch.tensor([[tokenizer.pad_token_id]]), ids], dim=1).to(device)
    mask = torch.ones_like(padded)
    mask[0, 0] = 0
    with part_times(hf, device) as parts:
        sync(device)
        t0 = time.perf_counter()
        seq, wav = hf.generate(padded, attention_mask=mask, speaker="Chelsie", thinker_do_sample=False,
                               thinker_max_new_tokens=args.text_tokens, thinker_min_new_tokens=args.text_tokens,
                               talker_do_sample=False, talker_max_new_tokens=args.audio_tokens,
                               talker_min_new_tokens=args.audio_tokens)
        sync(device)
        total = time.perf_counter() - t0
    assert seq.shape[1] - padded.shape[1] == args.text_tokens, seq.shape
    assert wav.numel() == args.audio_tokens * args.samples_per_code, (wav.numel(), args.audio_tokens)
    audio_s = wav.numel() / SAMPLE_RATE
    return {"first_audio_s": round(total, 4), "total_s": round(total, 4), "audio_s": round(audio_s, 3),
            "rtf": round(total / audio_s, 4), "part_s": {k: round(v, 4) for k, v in parts.items()}}


# -- ours ------------------------------------------------------------------------------------


def fixed_lengths(pipeline: Pipeline) -> Pipeline:
    """No stop ids on the thinker (the pipeline's text defaults) nor on the talker (its node's):
    every answer runs its max_tokens and its talker max_tokens."""
    pipeline = no_eos(pipeline)
    nodes = tuple(dataclasses.replace(n, defaults={**n.defaults, "text": dataclasses.replace(n.defaults["text"], eos_token_ids=())})
                  if n.name == "talker" else n for n in pipeline.spec.nodes)
    return dataclasses.replace(pipeline, spec=dataclasses.replace(pipeline.spec, nodes=nodes))


def codec_capacity(pipeline: Pipeline, capacity: int) -> Pipeline:
    """The talker -> code2wav stream (``codec_stream``) bounded at ``capacity`` codes."""
    streams = tuple(dataclasses.replace(s, capacity=capacity) if s.edge == "codec_stream" else s
                    for s in pipeline.spec.streams)
    return dataclasses.replace(pipeline, spec=dataclasses.replace(pipeline.spec, streams=streams))


def spoken_request(rid: str, args, offset: int, *, stream: bool) -> OmniRequest:
    return OmniRequest(task=TaskType.REASON, request_id=rid, inputs=[TextPart(text=prompt(args.prompt_tokens, offset))],
                       sampling=SamplingParams(max_tokens=args.text_tokens, temperature=0.0, seed=offset),
                       diffusion=DiffusionParams(seed=offset),
                       outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO], stream=stream),
                       node_params={"talker": {"max_tokens": args.audio_tokens}})


@dataclasses.dataclass
class Served:
    """One engine run: seconds from the first add to each request's first audio delta (its end
    when not streamed) and to its end; the outputs; the engine's step counts."""

    wall_s: float
    first_audio_s: dict[str, float]  # from the request's own add (staggered arrivals: not the first add)
    done_s: dict[str, float]
    outputs: dict[str, OmniOutput]
    steps: int
    batched_steps: int
    node_steps: dict[str, int]  # engine steps per loop node
    node_batched_steps: dict[str, int]  # of them, those that ran more than one request
    codes_at_first_audio: dict[str, int]  # the talker's codes when the request's first audio delta came out
    steps_to_first_audio: dict[str, int]  # engine steps from the request's add to its first audio delta


def serve(pipeline: Pipeline, requests: list[OmniRequest], args, *, stagger_steps: int = 0,
          check: Callable[[OmniOutput, Any], None] | None = None) -> Served:
    """``requests`` added to a fresh engine that may batch all of them, run to the end: together,
    or (``stagger_steps``) request ``i`` once the engine has run ``i * stagger_steps`` steps (a
    new answer arriving while the others speak). Times are from the first add (``wall_s``,
    ``done_s``) and from each request's own add (``first_audio_s``). ``check``: each answer's check
    (default :func:`check_answer`; bench_qwen3_omni.py passes its own)."""
    first: dict[str, float] = {}
    codes: dict[str, int] = {}
    added: dict[str, float] = {}
    added_step: dict[str, int] = {}
    steps: dict[str, int] = {}
    engines: list[Engine] = []

    def on_event(event: OmniEvent) -> None:
        rid = event.request_id
        if isinstance(event, ArtifactEvent) and event.name == "audio_delta" and rid not in first:  # samples on the host
            first[rid] = time.perf_counter() - added[rid]
            talker = engines[0].scheduler.find(rid)
            loop = talker.state.loops.get("talker") if talker is not None else None
            codes[rid] = len(loop.output_ids) if loop is not None else -1
            steps[rid] = engines[0].stats.steps - added_step[rid]

    n = len(requests)
    engine = Engine(pipeline, EngineConfig(max_queue=1024, policy=SchedulingPolicy(max_batch=n, max_running=n)),
                    event_sink=on_event)
    engines.append(engine)
    done: dict[str, float] = {}
    outputs: dict[str, OmniOutput] = {}
    pending = list(requests)
    with torch.inference_mode():
        sync(pipeline.device)
        t0 = time.perf_counter()
        while pending or engine.has_unfinished():
            while pending and (engine.stats.steps >= (n - len(pending)) * stagger_steps or not engine.has_unfinished()):
                added[pending[0].request_id] = time.perf_counter()
                added_step[pending[0].request_id] = engine.stats.steps
                engine.add_request(pending.pop(0))
            for out in engine.step():
                sync(pipeline.device)
                done[out.request_id] = time.perf_counter() - t0
                outputs[out.request_id] = out
    for rid, out in outputs.items():
        (check or check_answer)(out, args)
        first.setdefault(rid, done[rid] - (added[rid] - t0))  # not streamed: the first audio is the whole audio
    stats = engine.stats
    return Served(wall_s=max(done.values()), first_audio_s=first, done_s=done, outputs=outputs, steps=stats.steps,
                  batched_steps=stats.batched_steps, node_steps=dict(stats.node_steps),
                  node_batched_steps=dict(stats.node_batched_steps), codes_at_first_audio=codes,
                  steps_to_first_audio=steps)


def steps_by_node(runs: list[Served]) -> dict[str, dict[str, int]]:
    """Per loop node: engine steps and those that batched several requests (summed over ``runs``)."""
    out: dict[str, dict[str, int]] = {}
    for run in runs:
        for node, n in run.node_steps.items():
            counts = out.setdefault(node, {"steps": 0, "batched": 0})
            counts["steps"] += n
            counts["batched"] += run.node_batched_steps.get(node, 0)
    return out


def check_answer(out: OmniOutput, args) -> None:
    """The same work as transformers': exactly the text tokens and the codes asked for."""
    assert out.error is None, out.error
    assert out.text is not None and len(out.text.token_ids) == args.text_tokens, out.text
    assert out.audio is not None and out.audio.samples.shape[-1] == args.audio_tokens * args.samples_per_code, (
        out.audio.samples.shape, args.audio_tokens)


def audio_seconds(served: Served) -> float:
    return sum(o.audio.samples.shape[-1] for o in served.outputs.values() if o.audio is not None) / SAMPLE_RATE


def run_single(pipeline: Pipeline, args, *, stream: bool) -> dict:
    served = serve(pipeline, [spoken_request("solo", args, 0, stream=stream)], args)
    out, audio_s = served.outputs["solo"], audio_seconds(served)
    return {"first_audio_s": round(served.first_audio_s["solo"], 4), "total_s": round(served.wall_s, 4),
            "audio_s": round(audio_s, 3), "rtf": round(served.wall_s / audio_s, 4),
            "node_s": {k: round(v, 4) for k, v in out.metrics.node_s.items()}}


def run_one_at_a_time(pipeline: Pipeline, args, n: int) -> dict:
    """``n`` streamed answers, each run to its end before the next is added."""
    runs = [serve(pipeline, [spoken_request(f"s{i}", args, i, stream=True)], args) for i in range(n)]
    wall = sum(r.wall_s for r in runs)
    audio = sum(audio_seconds(r) for r in runs)
    return {"requests": n, "wall_s": round(wall, 4), "audio_s": round(audio, 3),
            "audio_s_per_s": round(audio / wall, 3), "answers_per_s": round(n / wall, 4),
            "first_audio_s_p50": round(statistics.median(r.first_audio_s[f"s{i}"] for i, r in enumerate(runs)), 4),
            "steps_by_node": steps_by_node(runs)}


def run_concurrent(pipeline: Pipeline, args, n: int) -> dict:
    """``n`` streamed answers added together (or staggered, ``--stagger-steps``): their steps batch across requests."""
    served = serve(pipeline, [spoken_request(f"c{i}", args, i, stream=True) for i in range(n)], args,
                   stagger_steps=args.stagger_steps)
    audio = audio_seconds(served)
    firsts, ends = sorted(served.first_audio_s.values()), sorted(served.done_s.values())
    node_s: dict[str, float] = {}
    for out in served.outputs.values():
        for node, s in out.metrics.node_s.items():
            node_s[node] = node_s.get(node, 0.0) + s
    return {"requests": n, "wall_s": round(served.wall_s, 4), "audio_s": round(audio, 3),
            "audio_s_per_s": round(audio / served.wall_s, 3), "answers_per_s": round(n / served.wall_s, 4),
            "first_audio_s_p50": round(statistics.median(firsts), 4), "first_audio_s_max": round(firsts[-1], 4),
            "stagger_steps": args.stagger_steps, "codes_at_first_audio": sorted(served.codes_at_first_audio.values()),
            "steps_to_first_audio": sorted(served.steps_to_first_audio.values()),
            "latency_s_p50": round(statistics.median(ends), 4), "latency_s_max": round(ends[-1], 4),
            "steps": served.steps, "batched_steps": served.batched_steps, "steps_by_node": steps_by_node([served]),
            "node_s_sum": {k: round(v, 3) for k, v in node_s.items()}}


def ours_records(pipeline: Pipeline, args, base: dict, sink, *, single: Callable[..., dict],
                 one_at_a_time: Callable[[Pipeline, Any, int], dict], concurrent: Callable[[Pipeline, Any, int], dict]) -> None:
    """Our engine's records of an omni family (its ``single`` / ``one_at_a_time`` / ``concurrent``
    runs), after a warm streamed answer: ``--only single``: one answer streamed and not, the
    fastest of ``--iters``; ``--only concurrent``: ``--serial`` answers one at a time, then each
    ``--batches`` size added together, with its speed-up over one at a time."""
    single(pipeline, args, stream=True)  # warm
    if "single" in args.only:
        for stream in (True, False):
            runs = [single(pipeline, args, stream=stream) for _ in range(args.iters)]
            emit({**base, "metric": "ours", "batch": 1, "streamed": stream, **min(runs, key=lambda r: r["total_s"])}, sink)
    if "concurrent" in args.only:
        serial = one_at_a_time(pipeline, args, args.serial)
        emit({**base, "metric": "ours_one_at_a_time", "streamed": True, **serial}, sink)
        for n in (int(b) for b in args.batches.split(",")):
            rec = concurrent(pipeline, args, n)
            emit({**base, "metric": "ours_concurrent", "streamed": True, **rec,
                  "speedup_vs_one_at_a_time": round(rec["audio_s_per_s"] / serial["audio_s_per_s"], 2)}, sink)


# -- the run ---------------------------------------------------------------------------------


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke: the family tests' tiny checkpoint, short answers")
    p.add_argument("--only", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    p.add_argument("--batches", default=None,
                   help="concurrent spoken answers, comma separated (default 8,32; tiny: 2,4): pass 8 alone to skip the 32")
    p.add_argument("--text-tokens", type=int, default=None, help="text tokens of every answer (7B: 32, tiny: 8)")
    p.add_argument("--audio-tokens", type=int, default=None,
                   help="codec codes of every answer, 50 a second (7B: 250 = 5 s, tiny: 24)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (7B: 64, tiny: 8)")
    p.add_argument("--iters", type=int, default=2, help="batch-1 runs per side (the fastest is reported: warm)")
    p.add_argument("--serial", type=int, default=None, help="answers run one at a time for the baseline (default 4; tiny: 2)")
    p.add_argument("--codec-capacity", type=int, default=None,
                   help="codes the talker may run ahead of code2wav (the codec_stream edge's capacity; default the "
                        "family's, 64): --tiny with a small one (8) reaches the backpressure the 7B answers reach")
    p.add_argument("--stagger-steps", type=int, default=0,
                   help="concurrent answers arrive one per this many engine steps (default 0: all together); "
                        "first audio is timed from each answer's own arrival")
    p.add_argument("--note", default=None, help="a note field on every JSON line")
    p.add_argument("--kv-cache-gb", type=float, default=None, help="each KV pool's size (default: the loader's)")
    p.add_argument("--device", default=None, help="cuda (default when there is one; cpu with --tiny) or cpu")
    p.add_argument("--out", default=None, help="append the JSON lines here too")
    args = p.parse_args(argv)
    small = {"text_tokens": 8, "audio_tokens": 24, "prompt_tokens": 8, "batches": "2,4", "serial": 2} if args.tiny else \
        {"text_tokens": 32, "audio_tokens": 250, "prompt_tokens": 64, "batches": "8,32", "serial": 4}
    fill_unset(args, {**small, "device": "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"})
    return args


def main(argv=None) -> int:
    args = parse(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = Path(tempfile.mkdtemp(prefix="omni_bench_"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a run cut short (timeout) still deletes the folder
    sink = open(args.out, "a") if args.out else None
    import transformers

    base = {"bench": "omni", "arch": "tiny" if args.tiny else "qwen2.5-omni-7b", "prompt_tokens": args.prompt_tokens,
            "text_tokens": args.text_tokens, "audio_tokens": args.audio_tokens, "greedy": True,
            "fixed_lengths": "both sides run exactly text_tokens text tokens and audio_tokens codec codes (ours: stop "
                             "ids cleared; transformers: min_new_tokens = max_new_tokens): random weights emit no "
                             "EOS at a useful time",
            "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "transformers": transformers.__version__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            **({"note": args.note} if args.note else {})}
    try:
        t0 = time.perf_counter()
        save = save_random_omni_tiny if args.tiny else save_random_omni_7b
        hf = save(folder, device, dtype)
        sync(device)
        args.samples_per_code = samples_per_code(hf)
        emit({**base, "metric": "setup", "save_s": round(time.perf_counter() - t0, 1), "parameters": parameters(hf),
              "samples_per_code": args.samples_per_code,
              "weights": "random (transformers' init), talker codec_head rows >= 8192 zeroed" if not args.tiny else
              "the tests' tiny checkpoint"}, sink)
        if "transformers" in args.only:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder)
            with torch.inference_mode():
                run_transformers(hf, tokenizer, args, device)  # warm (kernels, token2wav's fp32 cast)
                runs = [run_transformers(hf, tokenizer, args, device) for _ in range(args.iters)]
            emit({**base, "metric": "transformers_generate", "batch": 1, "streamed": False,
                  **min(runs, key=lambda r: r["total_s"])}, sink)
        del hf  # one model on the device at a time
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if {"single", "concurrent"} & set(args.only):
            t0 = time.perf_counter()
            _, pipeline = load_pipeline(folder, LoadOptions(device=device, dtype=dtype, kv_cache_gb=args.kv_cache_gb))
            sync(device)
            emit({**base, "metric": "load_s", "value": round(time.perf_counter() - t0, 2)}, sink)
            pipeline = fixed_lengths(pipeline)
            if args.codec_capacity is not None:
                pipeline = codec_capacity(pipeline, args.codec_capacity)
            ours_records(pipeline, args, base, sink, single=run_single, one_at_a_time=run_one_at_a_time,
                         concurrent=run_concurrent)
    finally:
        if sink:
            sink.close()
        shutil.rmtree(folder, ignore_errors=True)  # the 7B checkpoint is ~22 GB of the device's disk
    return 0


if __name__ == "__main__":
    sys.exit(main())
