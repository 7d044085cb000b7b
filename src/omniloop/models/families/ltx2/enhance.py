"""LTX-2's prompt enhancement: the Gemma 3 text encoder run as a causal LM (ComfyUI's
``TextGenerateLTX2Prompt``), a loop of one generated token per ``step``.

    init:     the Gemma 3 turn text (``enhance_prompts.gemma3_chat``) tokenized with BOS,
              its prefill -> logits of the first token (a per-request KV cache)
    step:     sample (repetition / presence penalty, temperature, top-k, top-p, min-p; greedy
              when ``sampling="off"``) -> stop at ``<eos>`` / ``<end_of_turn>`` -> one decode forward
    finalize: the decoded text (special tokens dropped, stripped) on the ``enhanced_prompt``
              edge; ``LTX2TextEncode`` encodes it in place of the request's prompt

The LM head is the token embedding: Gemma 3 ties them (``tie_word_embeddings``), so the text
encoder LTX-2 loads (a ``Gemma3ForConditionalGeneration`` folder or a ComfyUI Gemma 3 file,
``Gemma3TextModel``, which holds no ``lm_head``) is a whole causal LM, as ComfyUI uses it.
Everything mutable (KV cache, generator, ids) lives in the ``EnhanceState``; the model is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from omniloop.models.families.ltx2.enhance_prompts import gemma3_chat
from omniloop.pipeline.loops.ar_sampling import top_k_top_p
from omniloop.pipeline.stage import LoopStageBase
from omniloop.pipeline.state import LoopState, RequestState, StageContext, StepResult
from omniloop.request import TaskType, TextArtifact


class EnhanceParams(BaseModel):
    """``node_params["enhance_prompt"]``: asking for it rewrites the prompt before encoding
    (ComfyUI ``TextGenerateLTX2Prompt``'s widgets, its defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_length: int = Field(default=512, ge=1, le=32768, description="new tokens at most")
    sampling: Literal["on", "off"] = Field(default="on", description="off: greedy")
    temperature: float = Field(default=0.7, ge=0.01, le=2.0)
    top_k: int = Field(default=64, ge=0, le=1000, description="0 disables top-k")
    top_p: float = Field(default=0.95, ge=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.05, ge=0.0, le=5.0)
    presence_penalty: float = Field(default=0.0, ge=0.0, le=5.0)
    seed: int = Field(default=0, ge=0, le=2**64 - 1)


@dataclass(frozen=True)
class GemmaCausalLM:
    """A Gemma 3 language model and its (tied) output head."""

    text_model: torch.nn.Module  # transformers Gemma3TextModel
    config: Any  # its Gemma3TextConfig (the KV cache's layer types)
    head: torch.Tensor  # [vocab, hidden]: the token embedding
    softcap: float | None  # final_logit_softcapping (None in Gemma 3's released configs)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "GemmaCausalLM":
        from transformers import Gemma3ForConditionalGeneration, Gemma3TextModel

        if isinstance(model, Gemma3ForConditionalGeneration):
            text = model.model.language_model
        elif isinstance(model, Gemma3TextModel):
            text = model
        else:
            raise ValueError(f"prompt enhancement runs a Gemma 3 text encoder; this model is {type(model).__name__}")
        return cls(text, text.config, text.embed_tokens.weight, text.config.final_logit_softcapping)

    def logits(self, ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """``ids [1, L]`` appended to ``cache`` -> fp32 logits of the next token ``[vocab]``."""
        hidden = self.text_model(input_ids=ids, past_key_values=cache, use_cache=True).last_hidden_state[0, -1]
        logits = (hidden @ self.head.T).float()
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


@dataclass(kw_only=True)
class EnhanceState(LoopState):
    params: EnhanceParams
    generator: torch.Generator
    cache: Any  # transformers DynamicCache of this request
    prompt_ids: list[int]
    stop_ids: frozenset[int]
    logits: torch.Tensor | None = None  # [vocab] fp32 of the next token
    output_ids: list[int] = field(default_factory=list)
    stopped: bool = False  # ended by <eos> / <end_of_turn> (else by max_length)


def next_token(logits: torch.Tensor, seen: list[int], output: list[int], p: EnhanceParams,
               generator: torch.Generator) -> int:
    """Repetition penalty (``seen``: prompt + output ids), presence penalty (``output`` ids: minus
    the penalty), then greedy, or temperature -> top-k -> top-p -> min-p and a draw with the
    request's generator."""
    if output and p.presence_penalty:
        ids = torch.tensor(sorted(set(output)), device=logits.device)
        logits = logits.index_add(0, ids, torch.full((len(ids),), -p.presence_penalty, device=logits.device))
    if seen and p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(seen)), device=logits.device)
        picked = logits[ids]
        logits = logits.index_copy(0, ids, torch.where(picked > 0, picked / p.repetition_penalty,
                                                       picked * p.repetition_penalty))
    if p.sampling == "off":
        return int(torch.argmax(logits))
    probs = top_k_top_p(logits / p.temperature, p.top_k, p.top_p).softmax(-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class LTX2PromptEnhance(LoopStageBase[EnhanceState]):
    text_encoder: str = "text_encoder"
    inputs = {}
    outputs = {"enhanced_prompt": TextArtifact}
    params_schema = EnhanceParams

    @property
    def components(self) -> tuple[str, ...]:
        return (self.text_encoder,)

    @torch.inference_mode()
    def init(self, ctx: StageContext, state: RequestState) -> EnhanceState:
        from transformers import DynamicCache

        encoder = ctx.component(self.text_encoder)  # GemmaLayerStates: .model, .tokenizer
        lm, tokenizer = GemmaCausalLM.of(encoder.model), encoder.tokenizer
        params: EnhanceParams = state.node_params.get(ctx.node) or EnhanceParams()
        chat = gemma3_chat(state.request.prompt or "", image=state.request.task is TaskType.I2V)
        ids = tokenizer(chat, add_special_tokens=True).input_ids
        turn_end = tokenizer.convert_tokens_to_ids("<end_of_turn>")  # the unk id when the vocabulary lacks it
        stops = {tokenizer.eos_token_id, None if turn_end == tokenizer.unk_token_id else turn_end}
        loop = EnhanceState(node=ctx.node, request_id=state.request_id, steps_target=params.max_length,
                            params=params, generator=torch.Generator(lm.head.device).manual_seed(params.seed),
                            cache=DynamicCache(config=lm.config), prompt_ids=list(ids),
                            stop_ids=frozenset(s for s in stops if isinstance(s, int)))
        loop.logits = lm.logits(torch.tensor([ids], device=lm.head.device), loop.cache)
        return loop

    @torch.inference_mode()
    def step(self, ctx: StageContext, loop: EnhanceState) -> StepResult:
        assert loop.logits is not None, "step after the loop finished"
        token = next_token(loop.logits, loop.prompt_ids + loop.output_ids, loop.output_ids, loop.params,
                           loop.generator)
        loop.steps_done += 1
        if token in loop.stop_ids:
            loop.steps_target, loop.stopped = loop.steps_done, True
        else:
            loop.output_ids.append(token)
        if loop.done:
            loop.logits = None
            return StepResult(done=True)
        lm = GemmaCausalLM.of(ctx.component(self.text_encoder).model)
        loop.logits = lm.logits(torch.tensor([[token]], device=lm.head.device), loop.cache)
        return StepResult(done=False)

    def finalize(self, ctx: StageContext, loop: EnhanceState, state: RequestState) -> None:
        tokenizer = ctx.component(self.text_encoder).tokenizer
        text = tokenizer.decode(loop.output_ids, skip_special_tokens=True).strip()
        ctx.write(state, "enhanced_prompt", TextArtifact(text=text, token_ids=list(loop.output_ids),
                                                          prompt_tokens=len(loop.prompt_ids),
                                                          finish_reason="stop" if loop.stopped else "length"))
        self.release(loop)

    def release(self, loop: EnhanceState) -> None:
        loop.cache = None
        loop.logits = None
