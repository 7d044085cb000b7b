"""Admission checks of a request's output geometry, shared by the families' validators: sizes
the latents tile, and frame counts a causal video VAE takes (``temporal``k+1). Each refusal
names the field and the nearest values to pass."""

from __future__ import annotations

from omniloop.request import InvalidRequest


def nearest_multiples(value: int, m: int) -> str:
    """The multiples of ``m`` around ``value`` (``value`` itself when it is one), to suggest."""
    lo = max(m, value // m * m)
    return f"{lo} or {lo + m}" if lo != value else str(value)


def check_size_multiple(height: int, width: int, multiple: int, why: str = "") -> None:
    """``diffusion.height`` / ``width`` must be multiples of ``multiple`` (``why``: appended to the message)."""
    for name, value in (("height", height), ("width", width)):
        if value % multiple:
            raise InvalidRequest(f"diffusion.{name}={value} must be a multiple of {multiple}{why}",
                                 hint=f"pass {nearest_multiples(value, multiple)}", fields=(f"diffusion.{name}",))


def check_frame_count(num_frames: int, temporal: int) -> None:
    """``diffusion.num_frames`` must be ``temporal``k+1 (the first frame alone, then whole latent frames)."""
    if (num_frames - 1) % temporal:
        k = (num_frames - 1) // temporal
        raise InvalidRequest(f"diffusion.num_frames={num_frames} must be {temporal}k+1",
                             hint=f"pass {temporal * k + 1} or {temporal * (k + 1) + 1}", fields=("diffusion.num_frames",))
