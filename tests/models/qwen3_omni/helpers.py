"""Drive the Qwen3-Omni graph: requests, and transformers' ``generate`` as the oracle."""

from __future__ import annotations

from typing import Any

import torch

from omniloop.request import Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.models.qwen3_omni.checkpoint import IM_END

TEXT_TOKENS = 10
AUDIO_FRAMES = 12


def omni3_request(prompt: str, *, speech: bool = True, voice: str | None = None, seed: int = 5, chat: bool = True,
                  greedy: bool = True, **sampling: Any) -> OmniRequest:
    """``greedy``: temperature 0 (every AR stage greedy); else the model's defaults (the thinker's
    generation config: greedy; the talker and its code predictor: transformers' sampling)."""
    sampling.setdefault("max_tokens", TEXT_TOKENS)
    if greedy:
        sampling.setdefault("temperature", 0.0)
    return OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=prompt, role="user" if chat else None)],
                       sampling=SamplingParams(seed=seed, **sampling),
                       outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO] if speech else None, voice=voice),
                       node_params={"talker": {"max_tokens": AUDIO_FRAMES}} if speech else {})


def chat_ids(tokenizer, prompt: str) -> torch.Tensor:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"]


def hf_generate(hf, tokenizer, prompt: str, *, speaker: str = "Ethan", capture: dict | None = None,
                greedy: bool = True, seed: int = 5):
    """transformers' ``generate`` of a one-message chat: :func:`hf_generate_from` its ids."""
    return hf_generate_from(hf, tokenizer, {"input_ids": chat_ids(tokenizer, prompt)}, speaker=speaker, capture=capture,
                            greedy=greedy, seed=seed)


def hf_generate_from(hf, tokenizer, inputs: dict[str, Any], *, speaker: str = "Ethan", capture: dict | None = None,
                     greedy: bool = True, seed: int | None = 5):
    """transformers' ``generate`` of the processor's ``inputs`` (greedy thinker; the talker greedy
    or sampled with its defaults from the global generator seeded with ``seed``, None: not seeded;
    the code predictor follows the talker's ``do_sample``) -> (text ids, waveform [samples]);
    ``capture["codes"]``: the frames ``[T, groups]`` it hands code2wav."""
    ids = inputs["input_ids"]
    if capture is not None:
        decode = hf.code2wav.chunked_decode

        def spy(codes, **kw):
            capture["codes"] = codes[0].T.tolist()
            return decode(codes, **kw)

        hf.code2wav.chunked_decode = spy
    try:
        if seed is not None:
            torch.manual_seed(seed)
        seq, wav = hf.generate(**inputs, speaker=speaker, thinker_max_new_tokens=TEXT_TOKENS, thinker_do_sample=False,
                               thinker_eos_token_id=tokenizer.convert_tokens_to_ids(IM_END), talker_do_sample=not greedy,
                               talker_max_new_tokens=AUDIO_FRAMES)
    finally:
        if capture is not None:
            del hf.code2wav.chunked_decode
    return seq[0, ids.shape[1]:].tolist(), wav[0, 0]
