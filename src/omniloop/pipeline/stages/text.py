"""``TextEncode``: prompt (and negative prompt when guidance needs one) -> TextEmbeddings,
through one encoder (Wan's UMT5) or several (Flux: CLIP's pooled vector + T5's sequence;
LTX-2 later: Gemma + connectors).

Each ``TextEncoderSpec`` names a component, which of its outputs to take (the token
``sequence`` or the ``pooled`` vector) and the ``TextEmbeddings`` field it fills. A
component read by several specs is called once. With the deployment's text-embedding
cache (``StageContext.caches["text_embeddings"]``) each (prompt, encoder, adapter set)
is encoded once and shared by every request that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Sequence

import torch

from omniloop.cache.text_embeddings import CACHE_NAME, EmbeddingKey, EmbeddingRow, TextEmbeddingCache
from omniloop.models.layers.lora import LoraPlan, lora_rows
from omniloop.pipeline.adapters import adapter_cache, request_adapters
from omniloop.pipeline.edges import POOLED_FIELD, PROMPT_FIELD, BranchPair, TextEmbeddings
from omniloop.pipeline.defaults import GenerationDefaults, admitted
from omniloop.pipeline.policies.cfg import loops_guide
from omniloop.pipeline.stage import StageBase
from omniloop.pipeline.state import RequestState, StageContext



@dataclass(frozen=True)
class TextEncoderSpec:
    """One encoder output that lands in ``TextEmbeddings``."""

    component: str = "text_encoder"
    output: Literal["sequence", "pooled"] = "sequence"
    field: str = PROMPT_FIELD  # "prompt" (the primary sequence), "pooled", or a name of ``extra``

    def __post_init__(self) -> None:
        if self.output not in ("sequence", "pooled"):
            raise ValueError(f"TextEncoderSpec.output must be 'sequence' or 'pooled', got {self.output!r}")


@dataclass
class TextEncode(StageBase):
    # the one-encoder shorthand: ``component``'s sequence into ``prompt`` (Wan)
    component: str = "text_encoder"
    encoders: tuple[TextEncoderSpec, ...] = ()
    # "cfg": encode the negative prompt when the request's guidance needs an uncond branch;
    # "embedded": never (the scale rides inside the forward: Flux's guidance embedding)
    guidance: Literal["cfg", "embedded"] = "cfg"
    outputs = {"text": TextEmbeddings}

    def __post_init__(self) -> None:
        if not self.encoders:
            self.encoders = (TextEncoderSpec(self.component),)
        fields = [s.field for s in self.encoders]
        if PROMPT_FIELD not in fields:
            raise ValueError(f"TextEncode needs an encoder spec filling field {PROMPT_FIELD!r}; got fields {fields}")
        if self.guidance not in ("cfg", "embedded"):
            raise ValueError(f"TextEncode.guidance must be 'cfg' or 'embedded', got {self.guidance!r}")
        if len(set(fields)) != len(fields):
            raise ValueError(f"TextEncode encoder specs fill the same field twice: {fields}")

    @property
    def components(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.component for s in self.encoders))

    def forward(self, ctx: StageContext, state: RequestState) -> None:
        self.forward_many(ctx, [state])

    @torch.inference_mode()
    def forward_many(self, ctx: StageContext, states: Sequence[RequestState]) -> None:
        """One encoder call per component for the prompts (and negative prompts) of every
        request that the cache does not hold; each request's rows are what encoding its own
        prompts alone gives (fixed-length padding). Nothing is written before every call
        succeeded (the engine then retries each request alone)."""
        wanted = [self._prompts(ctx, state) for state in states]
        held: list[tuple[EmbeddingKey, str]] = []  # cache references taken so far
        cache: TextEmbeddingCache | None = ctx.caches.get(CACHE_NAME)
        try:
            rows = {c: self._encode(ctx, c, states, wanted, cache, held) for c in self.components}
        except BaseException:
            for key, owner in held:
                assert cache is not None, "references are taken in the cache only"
                cache.release(key, owner)
            raise
        for i, state in enumerate(states):
            ctx.write(state, "text", self._embeddings(ctx, rows, i, len(wanted[i]) == 2))
            if cache is not None:
                mine = [(k, o) for k, o in held if o == state.request_id]
                state.releases.append(partial(_release_all, cache, mine))

    # -- encoding -------------------------------------------------------------------------
    def _encode(
        self, ctx: StageContext, component: str, states: Sequence[RequestState], wanted: list[list[str]],
        cache: TextEmbeddingCache | None, held: list[tuple[EmbeddingKey, str]],
    ) -> list[list[EmbeddingRow]]:
        """Per request, per prompt: the rows of ``component``, from the cache or one call."""
        encoder = ctx.component(component)
        out: list[list[EmbeddingRow | None]] = [[None] * len(p) for p in wanted]
        todo: dict[Any, list[tuple[int, int]]] = {}  # one encoding per distinct (key or prompt)
        ident = cache.identity(encoder, component) if cache is not None else component
        loras = adapter_cache(ctx.caches)
        for i, (state, prompts) in enumerate(zip(states, wanted)):
            refs = state.request.diffusion.loras
            adapters = loras.signature(refs, component) if loras is not None and refs else ""
            for j, text in enumerate(prompts):
                if cache is None:
                    todo.setdefault((text, adapters), []).append((i, j))
                    continue
                key = cache.key(text, ident, adapters)
                if key in todo:  # the same prompt twice in this group (n > 1, a shared negative): one encoding
                    todo[key].append((i, j))
                    cache.count_hit()
                    self._event(ctx, "hit", state.request_id)
                    continue
                row = cache.acquire(key, state.request_id)
                if row is not None:
                    held.append((key, state.request_id))
                    out[i][j] = row
                    self._event(ctx, "hit", state.request_id, row.nbytes)
                else:
                    todo.setdefault(key, []).append((i, j))
                    self._event(ctx, "miss", state.request_id)
        if todo:
            firsts = [places[0][0] for places in todo.values()]
            texts = [wanted[i][j] for (i, j), *_ in todo.values()]
            rows = [request_adapters(ctx, states[i]).get(component) for i in firsts]  # text-encoder LoRAs
            with lora_rows(LoraPlan(rows)):
                encoded = encoder.encode(texts, device=ctx.device)
            for n, (key, places) in enumerate(todo.items()):
                row = EmbeddingRow(
                    embeds=encoded.embeds[n:n + 1].to(ctx.dtype).clone(),
                    length=int(encoded.lengths[n]),
                    pooled=None if encoded.pooled is None else encoded.pooled[n:n + 1].to(ctx.dtype).clone(),
                )
                for i, j in places:
                    out[i][j] = row
                if cache is not None:
                    owners = dict.fromkeys(states[i].request_id for i, _ in places)
                    for owner in owners:
                        cached, evicted = cache.insert(key, row, owner)
                        if cached:
                            held.append((key, owner))
                            self._event(ctx, "alloc", owner, row.nbytes)
                        if evicted:
                            self._event(ctx, "evict", owner, evicted)
        return out  # type: ignore[return-value]

    def _embeddings(self, ctx: StageContext, rows: dict[str, list[list[EmbeddingRow]]], i: int,
                    guided: bool) -> TextEmbeddings:
        pairs: dict[str, BranchPair] = {}
        lengths: list[int] = []
        for spec in self.encoders:
            cond, *uncond = rows[spec.component][i]
            pick = (lambda r: r.embeds) if spec.output == "sequence" else (lambda r, c=spec.component: _pooled(r, c))
            pairs[spec.field] = BranchPair(pick(cond), pick(uncond[0]) if guided else None)
            if spec.field == PROMPT_FIELD:
                lengths = [cond.length]
        prompt, pooled = pairs.pop(PROMPT_FIELD), pairs.pop(POOLED_FIELD, None)
        return TextEmbeddings(
            prompt=prompt.cond, negative=prompt.uncond, prompt_lengths=lengths,
            pooled=pooled.cond if pooled else None, negative_pooled=pooled.uncond if pooled else None,
            extra=pairs,
        )

    @staticmethod
    def _event(ctx: StageContext, kind: str, request_id: str, nbytes: int = 0) -> None:
        chain = ctx.hooks.chain if ctx.hooks is not None else None
        if chain is not None and chain.cache_event is not None:
            from omniloop.ext.hooks import CacheEvent

            chain.cache_event(CacheEvent(CACHE_NAME, kind, ctx.node, request_id, nbytes=nbytes))

    def resolve(self, ctx: StageContext, state: RequestState, produced: frozenset[str],
                defaults: GenerationDefaults) -> None:
        """Admission (after the loops resolved their scales): the negative prompt, when a loop
        guides (``loops_guide``) and the request gives none, is the node's default."""
        if self._guided(state) and state.request.diffusion.negative_prompt is None:
            state.resolve_diffusion(negative_prompt=defaults.negative_prompt)

    def _guided(self, state: RequestState) -> bool:
        return self.guidance == "cfg" and loops_guide(state.node_params)

    def _prompts(self, ctx: StageContext, state: RequestState) -> list[str]:
        """[prompt] or [prompt, negative prompt] (when a loop's resolved guidance needs one)."""
        prompts = [state.request.prompt or ""]
        if self._guided(state):
            prompts.append(admitted(state.request.diffusion.negative_prompt, "negative_prompt", ctx.node))
        return prompts


def _pooled(row: EmbeddingRow, component: str) -> torch.Tensor:
    if row.pooled is None:
        raise ValueError(f"text encoder {component!r} has no pooled output; read its 'sequence' instead")
    return row.pooled


def _release_all(cache: TextEmbeddingCache, held: list[tuple[EmbeddingKey, str]]) -> None:
    """A finished request's references to cached embedding rows (key, owner), given back."""
    for key, owner in held:
        cache.release(key, owner)
