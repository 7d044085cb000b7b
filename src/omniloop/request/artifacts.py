"""Typed, named artifacts. Every artifact records the graph node that produced it.

Output artifacts (video, image, audio, text, tensors, latents) end up in
``OmniOutput.artifacts``; pipeline-internal edge artifacts (embeddings, conditioning
latents) subclass the same base in ``omniloop.pipeline.edges``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omniloop.request.enums import Modality

if TYPE_CHECKING:  # torch loads with the first artifact, not with the request types (the CLI parses flags without it)
    import torch


@dataclass(kw_only=True)
class Artifact:
    node: str = ""  # producing graph node, stamped by the runtime when stored

    @property
    def kind(self) -> str:
        return type(self).__name__

    def describe(self) -> dict[str, Any]:
        """A JSON-safe summary (no payload)."""
        return {"kind": self.kind, "node": self.node}


@dataclass(kw_only=True)
class VideoArtifact(Artifact):
    frames: torch.Tensor  # [F, H, W, 3] uint8
    fps: int

    def __post_init__(self) -> None:
        import torch

        assert self.frames.ndim == 4 and self.frames.shape[-1] == 3, f"frames must be [F,H,W,3], got {tuple(self.frames.shape)}"
        assert self.frames.dtype == torch.uint8, f"frames must be uint8, got {self.frames.dtype}"

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    def describe(self) -> dict[str, Any]:
        f, h, w, _ = self.frames.shape
        return {**super().describe(), "num_frames": int(f), "height": int(h), "width": int(w), "fps": self.fps}


@dataclass(kw_only=True)
class VideoChunkArtifact(VideoArtifact):
    """One streamed chunk of a video being made: frames ``[first_frame, first_frame + F)``."""

    index: int  # chunk index, from 0
    first_frame: int  # index of this chunk's first frame in the whole video
    num_chunks: int | None = None  # chunks in the whole video (None: a live session)
    action: str | None = None  # the session action that conditioned this chunk, if any
    prompt: str | None = None  # the session's prompt, once it changed it

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "index": self.index, "first_frame": self.first_frame,
                "num_chunks": self.num_chunks, "action": self.action, "prompt": self.prompt}


@dataclass(kw_only=True)
class ImageArtifact(Artifact):
    image: torch.Tensor  # [H, W, 3] uint8

    def describe(self) -> dict[str, Any]:
        h, w, _ = self.image.shape
        return {**super().describe(), "height": int(h), "width": int(w)}


@dataclass(kw_only=True)
class AudioArtifact(Artifact):
    samples: torch.Tensor  # [channels, num_samples] float32 in [-1, 1]
    sample_rate: int
    # a spoken answer cut by its length bound (the deployment's max_audio_tokens): "length"; else None
    finish_reason: str | None = None

    def describe(self) -> dict[str, Any]:
        c, n = self.samples.shape
        return {**super().describe(), "channels": int(c), "num_samples": int(n), "sample_rate": self.sample_rate}


@dataclass(frozen=True)
class TokenLogProb:
    """One generated token's log-probability under the model (``log_softmax`` of its raw
    logits, before temperature / top-k / top-p / repetition penalty), with the most likely
    tokens at that position when asked for (``OutputSpec.top_logprobs``)."""

    token_id: int
    token: str  # its text (the tokenizer's decode of the one id)
    logprob: float
    top: tuple["TokenLogProb", ...] = ()  # best first; empty unless top_logprobs > 0

    def to_dict(self) -> dict[str, Any]:
        return {"token_id": self.token_id, "token": self.token, "logprob": self.logprob,
                "top": [t.to_dict() for t in self.top]}


@dataclass(kw_only=True)
class TextArtifact(Artifact):
    text: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # tokens of the prompt it continued (usage accounting)
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string) or "length" (max_tokens)
    log_probs: list[TokenLogProb] | None = None  # one per token_ids entry (OutputSpec.return_log_probs)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "text": self.text, "num_tokens": len(self.token_ids)}


@dataclass(kw_only=True)
class TensorArtifact(Artifact):
    tensor: torch.Tensor

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "shape": list(self.tensor.shape), "dtype": str(self.tensor.dtype)}


@dataclass(kw_only=True)
class TrajectoryArtifact(TensorArtifact):
    """A denoise loop's trajectory (``OutputSpec.return_trajectory``): ``tensor`` [S, B, C, ...]
    fp32, the latents after each of the S steps that ran (the last: the final latents), with
    what a training objective replays them against. With ``return_log_probs``, per step the
    log-density of the transition the (stochastic) sampler drew, for this request: ``log_probs``
    [S] the mean over its latent elements (Flow-GRPO's figure), ``log_prob_sums`` [S] the sum
    (the exact log-density), ``stochastic`` [S] whether the step drew noise (a windowed
    schedule's ODE steps record 0). A loop over several modalities keeps the first's latents
    and scores the transition of all of them."""

    start: torch.Tensor  # [B, C, ...] the latents the first step took (the initial noise from a seed)
    timesteps: torch.Tensor  # [S] the model timesteps of the steps that ran (CPU)
    sigmas: torch.Tensor  # [S + 1] their noise levels, then the terminal one (CPU fp32)
    log_probs: torch.Tensor | None = None  # [S] fp32
    log_prob_sums: torch.Tensor | None = None  # [S] fp32
    stochastic: torch.Tensor | None = None  # [S] bool

    @property
    def num_steps(self) -> int:
        return int(self.tensor.shape[0])

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "steps": self.num_steps, "log_probs": self.log_probs is not None}


@dataclass(kw_only=True)
class ChunkTrajectoryArtifact(TensorArtifact):
    """One chunk's denoise trajectory in a rollout asked for ``return_trajectory``:
    ``tensor`` [S + 1, B, C, f, h, w] fp32 -- the chunk's starting noise, then the latents
    after each of its S inner steps (the last: the clean chunk its context pass encodes)."""

    index: int  # chunk index, from 0
    action: str | None = None  # the session action that conditioned the chunk, if any

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "index": self.index, "action": self.action}


@dataclass(kw_only=True)
class LatentsArtifact(Artifact):
    latents: torch.Tensor  # [B, C, ...] in the model's latent space
    modality: Modality = Modality.VIDEO
    step: int | None = None  # denoise step these latents follow (None: final)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "modality": self.modality.value, "shape": list(self.latents.shape), "step": self.step}
