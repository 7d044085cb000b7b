"""Drive the omni graph: requests, transformers' generate as the oracle, a node-by-node run."""

from __future__ import annotations

from typing import Any, Container

import torch

from omniloop.pipeline.pipeline import Pipeline
from omniloop.pipeline.state import RequestState
from omniloop.request import DiffusionParams, Modality, OmniRequest, OutputSpec, SamplingParams, TaskType, TextPart
from tests.models.qwen2_5_omni.checkpoint import CODEC_EOS, CODEC_PAD

TEXT_TOKENS = 10
AUDIO_TOKENS = 24


def omni_request(prompt: str, *, speech: bool = True, seed: int = 5, voice: str | None = None,
                 greedy: bool = True, **sampling: Any) -> OmniRequest:
    sampling.setdefault("max_tokens", TEXT_TOKENS)
    if greedy:
        sampling.setdefault("temperature", 0.0)
    return OmniRequest(task=TaskType.REASON, inputs=[TextPart(text=prompt)],
                       sampling=SamplingParams(seed=seed, **sampling), diffusion=DiffusionParams(seed=seed),
                       outputs=OutputSpec(modalities=[Modality.TEXT, Modality.AUDIO] if speech else None, voice=voice),
                       node_params={"talker": {"max_tokens": AUDIO_TOKENS}} if speech else {})


def hf_generate(hf, tokenizer, prompt: str, *, seed: int = 5, speaker: str = "Chelsie", greedy: bool = True,
                capture: dict | None = None):
    """transformers' ``generate`` on ``prompt`` -> (text ids, waveform [samples]).

    NOTE: transformers 5.x drops an all-ones attention mask inside ``generate``, and its talker
    adds the codec start/pad embeddings to its prompt and derives its positions only when it
    gets a mask; so an unpadded prompt takes a path the released model never ran (transformers
    4.x always passed the mask). A one-token left pad keeps the mask (its position is masked
    out): transformers then runs the talker as the checkpoint was trained, which is what we
    implement. ``capture``: the talker's codes land in ``capture["codes"]``."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    padded = torch.cat([torch.tensor([[tokenizer.pad_token_id]]), ids], dim=1)
    mask = torch.ones_like(padded)
    mask[0, 0] = 0
    if capture is not None:
        forward = hf.token2wav.forward

        def spy(code, conditioning, reference_mel, **kw):
            capture["codes"] = code[0].tolist()
            return forward(code, conditioning, reference_mel, **kw)

        hf.token2wav.forward = spy
    try:
        torch.manual_seed(seed)
        seq, wav = hf.generate(padded, attention_mask=mask, speaker=speaker, thinker_max_new_tokens=TEXT_TOKENS,
                               thinker_do_sample=False, talker_do_sample=not greedy,
                               talker_max_new_tokens=AUDIO_TOKENS, talker_eos_token_id=[CODEC_PAD, CODEC_EOS])
    finally:
        if capture is not None:
            del hf.token2wav.forward
    return seq[0, padded.shape[1]:].tolist(), wav


@torch.inference_mode()
def run_nodes(pipeline: Pipeline, request: OmniRequest, only: Container[str] | None = None) -> RequestState:
    """Every active node in order (``only``: those named), each loop to its end (the engine's
    work, one request): the state keeps every edge (``codec``, ``thinker_states``) for the tests
    to read; a stream edge's chunks wait on its channel until the consumer runs (the
    non-streamed order)."""
    state = pipeline.admit(request)
    for name in pipeline.spec.order:
        node = pipeline.spec.node(name)
        if not node.active(state.request) or (only is not None and name not in only):
            continue
        ctx = pipeline.contexts[name]
        if node.is_loop:
            loop = node.stage.init(ctx, state)
            while not loop.done:
                result = node.stage.step(ctx, loop)
                assert result.error is None, result.error
                for port, chunk in result.chunks or ():  # what the engine does with stream chunks
                    if ctx.outputs.get(port, port) in state.channels:
                        state.channels[ctx.outputs.get(port, port)].put(chunk)
            node.stage.finalize(ctx, loop, state)
            for edge in node.stream_output_edges():
                if edge in state.channels:
                    state.channels[edge].close()
        else:
            node.stage.forward(ctx, state)
    return state
