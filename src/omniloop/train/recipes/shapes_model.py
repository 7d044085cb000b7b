"""What the shapes-world models are, as served: geometry, sampler, defaults, manifests.

One definition for the recipes (validation builds its pipeline from these manifests), the
export (writes them next to the weights) and the built-in placeholders.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omniloop.models.manifest import SCHEMA_VERSION, ComponentEntry, FileRecord, ModelLimits, ModelManifest

TEACHER_NAME = "shapes-t2v"
STUDENT_NAME = "shapes-t2v-4step"
VARIANT = "wan-minilm-t2v"
DESCRIPTIONS = {
    TEACHER_NAME: "text-to-video of simple colored shapes and their motions (the 'shapes world'): a Wan-architecture "
                  "DiT + causal VAE trained by omniloop's recipes, 50 steps with CFG",
    STUDENT_NAME: "the 4-step distilled student of shapes-t2v (guidance baked in, one forward a step; shares its VAE)",
}
# The largest request the served models take: 4x the trained 128x128 area and twice its
# 17 frames (~7x the tokens; about a minute of a 2-vCPU CPU for the 50-step teacher).
# Its shape rules: the Wan VAE's 8x spatial stride times the DiT's 2x2 patch, and 4k+1 frames.
SERVED_LIMITS = ModelLimits(max_height=256, max_width=256, max_frames=33, size_multiple=16, frame_step=4)


@dataclass(frozen=True, kw_only=True)
class ShapesModelSettings:
    """Generation settings of the shipped pair (teacher and 4-step student)."""

    height: int = 128
    width: int = 128
    num_frames: int = 17
    fps: int = 8
    max_sequence_length: int = 32
    shift: float = 3.0  # flow shift of both samplers
    sampler: str = "flow_unipc"  # the teacher's default sampler
    steps: int = 50
    guidance_scale: float = 5.0
    negative_prompt: str = ""
    # The student's grid before the sampler's shift (what DiffusionParams.sigmas takes);
    # with shift 3 the student steps at sigma 1.0, 0.9, 0.75, 0.5 -> 0.
    student_sigmas: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)
    # what a model trained on clips and images serves; one trained on clips alone (no image
    # store / image trajectories) ships without "t2i" (see ``video_only``)
    tasks: tuple[str, ...] = field(default=("t2v", "t2i"))

    def __post_init__(self) -> None:
        if len(self.student_sigmas) < 1 or any(a <= b for a, b in zip(self.student_sigmas, self.student_sigmas[1:])):
            raise ValueError(f"student_sigmas must be strictly descending, got {self.student_sigmas}")
        if self.student_sigmas[0] != 1.0:
            raise ValueError(f"student_sigmas must start at 1.0 (pure noise), got {self.student_sigmas}")

    def video_only(self) -> tuple[str, ...]:
        """The tasks of a model that never trained on single frames: no T2I (issue 15: the
        session-5 models answered image requests with empty backgrounds)."""
        return tuple(t for t in self.tasks if t != "t2i")

    def _geometry(self) -> dict[str, Any]:
        return {"height": self.height, "width": self.width, "num_frames": self.num_frames, "fps": self.fps,
                "max_sequence_length": self.max_sequence_length, "negative_prompt": self.negative_prompt}

    def teacher_manifest(self, name: str = TEACHER_NAME, *, files: dict[str, FileRecord] | None = None,
                         provenance: dict[str, Any] | None = None,
                         tasks: tuple[str, ...] | None = None) -> ModelManifest:
        return _manifest(name, tuple(tasks or self.tasks), "vae", self.sampler, self.shift,
                         {"steps": self.steps, "guidance_scale": self.guidance_scale, **self._geometry()},
                         files, provenance)

    def student_manifest(self, name: str = STUDENT_NAME, *, vae_subfolder: str = "vae",
                         files: dict[str, FileRecord] | None = None,
                         provenance: dict[str, Any] | None = None,
                         tasks: tuple[str, ...] | None = None) -> ModelManifest:
        """Guidance is baked in (scale 1: one forward per step); the fixed sigmas are defaults.
        ``tasks``: what the student was distilled for (default: the teacher's tasks)."""
        defaults = {"steps": len(self.student_sigmas), "sigmas": list(self.student_sigmas), "guidance_scale": 1.0,
                    **self._geometry()}
        return _manifest(name, tuple(tasks or self.tasks), vae_subfolder, "flow_euler", self.shift, defaults, files,
                         provenance)


def _manifest(name: str, tasks: tuple[str, ...], vae_subfolder: str, sampler: str, shift: float,
              defaults: dict[str, Any], files: dict[str, FileRecord] | None,
              provenance: dict[str, Any] | None) -> ModelManifest:
    return ModelManifest(
        schema_version=SCHEMA_VERSION,
        name=name,
        family="wan",
        variant=VARIANT,
        tasks=list(tasks),
        description=DESCRIPTIONS.get(name, ""),
        components={
            "transformer": ComponentEntry(kind="WanDiT", subfolder="transformer"),
            "vae": ComponentEntry(kind="WanVAE", subfolder=vae_subfolder),
            "text_encoder": ComponentEntry(kind="minilm"),
            "sampler": ComponentEntry(kind=sampler, config={"shift": shift, "num_train_timesteps": 1000}),
        },
        defaults=defaults,
        limits=SERVED_LIMITS,
        files=files or {},
        provenance=provenance or {},
    )
