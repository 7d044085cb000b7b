"""What the Qwen2.5-Omni and Qwen3-Omni tests build and check the same way: the tiny byte-level
BPE tokenizer, the CPU pipeline of a saved folder, real WAV clips and the processor's audio
inputs (transformers' oracle), the audio tower's packed input, and the streamed-talker check."""

from __future__ import annotations

import dataclasses
import io
import wave
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

RATE = 16000


# -- checkpoints ------------------------------------------------------------------------


def tiny_bpe_tokenizer(folder: Path, *, specials: list[str], corpus: list[str], chat_template: str, eos_token: str,
                       pad_token: str):
    """Byte-level BPE (Qwen2's scheme) + the special tokens the omni config points at, saved to ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token, pad_token=pad_token)
    fast.chat_template = chat_template
    fast.save_pretrained(folder)
    return fast


def cpu_pipeline(folder: Path):
    """The folder's pipeline as a user loads it, fp32 on the CPU."""
    from omniloop.models.loader import load_pipeline
    from omniloop.models.model_spec import LoadOptions

    _, pipeline = load_pipeline(folder, LoadOptions(device=torch.device("cpu"), dtype=torch.float32))
    return pipeline


# -- audio ------------------------------------------------------------------------------


def wav_bytes(pcm: np.ndarray, rate: int = RATE) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def tone(n: int, seed: int = 0) -> np.ndarray:
    """``n`` int16 samples: a tone plus noise (every mel bin moves)."""
    g = np.random.default_rng(seed)
    return (np.sin(np.arange(n) / (5.0 + seed)) * 9000 + g.standard_normal(n) * 800).astype(np.int16)


def stdlib_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float32) / 32768.0


def hf_audio_inputs(folder, tokenizer, text: str, clips: list[bytes],
                    output_lengths: Callable[[torch.Tensor], torch.Tensor], pad: bool = False) -> dict:
    """The processor's inputs for ``[text, audio...]`` in one user message: the feature extractor
    padded to its window with the frame mask, each ``<|AUDIO|>`` repeated ``output_lengths``
    (the family's ``_get_feat_extract_output_lengths``) times. ``pad``: a masked left pad token."""
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor.from_pretrained(folder)
    feats = fe([stdlib_samples(c) for c in clips], sampling_rate=RATE, padding="max_length", return_attention_mask=True,
               return_tensors="pt")
    counts = output_lengths(feats["attention_mask"].sum(-1)).tolist()
    messages = [{"role": "user", "content": [{"type": "text", "text": text}, *[{"type": "audio"} for _ in clips]]}]
    pieces = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True).split("<|AUDIO|>")
    ids = tokenizer(pieces[0] + "".join("<|AUDIO|>" * n + rest for n, rest in zip(counts, pieces[1:])),
                    return_tensors="pt").input_ids
    mask = torch.ones_like(ids)
    if pad:
        ids = torch.cat([torch.tensor([[tokenizer.pad_token_id]]), ids], dim=1)
        mask = torch.cat([torch.zeros(1, 1, dtype=mask.dtype), mask], dim=1)
    return {"input_ids": ids, "attention_mask": mask, "input_features": feats["input_features"],
            "feature_attention_mask": feats["attention_mask"]}


def audio_tower_input(inputs: dict) -> tuple[torch.Tensor, list[int]]:
    """The processor's padded features -> our audio tower's input: ``[mel, sum(lengths)]`` (each
    audio's valid frames, concatenated) and the lengths."""
    lengths = inputs["feature_attention_mask"].sum(-1).tolist()
    flat = torch.cat([inputs["input_features"][i, :, :n] for i, n in enumerate(lengths)], dim=1)
    return flat, lengths


# -- streaming --------------------------------------------------------------------------


def log_steps(monkeypatch, log: list[str], stages: Sequence[tuple[type, str, str]]) -> None:
    """Each ``(class, name, method)``'s step method appends ``name`` to ``log`` when it runs."""
    for cls, name, method in stages:
        original = getattr(cls, method)

        def step(self, ctx, loops, _original=original, _name=name):
            log.append(_name)
            return _original(self, ctx, loops)

        monkeypatch.setattr(cls, method, step)


def check_the_talker_streams_alongside_the_thinker(pipeline, request, monkeypatch,
                                                   stages: Sequence[tuple[type, str, str]]):
    """The request through the real Engine with the graph's stream edges and without them: the
    streamed talker's first step runs before the thinker's last, the non-streamed one after it,
    and the answers are equal (text ids; samples bit for bit). Returns (plain, streamed) outputs."""
    from omniloop.engine.offline import run_request

    assert [s.edge for s in pipeline.spec.streams] == ["thinker_hidden", "codec_stream"]
    plain = dataclasses.replace(pipeline, spec=dataclasses.replace(pipeline.spec, streams=()))
    plain_log: list[str] = []
    streamed_log: list[str] = []
    log_steps(monkeypatch, plain_log, stages)
    want = run_request(plain, request)
    monkeypatch.undo()
    log_steps(monkeypatch, streamed_log, stages)
    got = run_request(pipeline, request)
    assert want.status.value == got.status.value == "completed", (want.error, got.error)
    last_thinker = max(i for i, n in enumerate(streamed_log) if n == "thinker")
    assert streamed_log.index("talker") < last_thinker  # streamed: the talker runs alongside
    assert plain_log.index("talker") > max(i for i, n in enumerate(plain_log) if n == "thinker")  # the baseline waits
    assert got.text.token_ids == want.text.token_ids
    assert torch.equal(got.audio.samples, want.audio.samples)  # every talker input row is the same sum: bit-equal
    return want, got
