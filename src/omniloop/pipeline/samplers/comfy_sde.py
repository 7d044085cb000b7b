"""What ComfyUI's k-diffusion samplers share (``comfy/k_diffusion/sampling.py``, read for behaviour;
this code is ours): the half log-SNR of a sigma and back, the ancestral split of a step, the
Brownian-tree noise of the SDE samplers, and the sampler nodes' noise options (``eta``,
``s_noise``, the prompt's seed). Not a sampler: each sampler file keeps its own update.

The half log-SNR is ComfyUI's ``sigma_to_half_log_snr`` / ``half_log_snr_to_sigma``: on a CONST
(flow) model ``lambda = -logit(sigma)`` (``alpha = 1 - sigma``), on any other ``lambda = -log sigma``
(k-diffusion's ``t_fn`` / ``sigma_fn``, which ``dpmpp_2m`` and ``res_multistep`` apply to a flow
model's sigmas too). Each is one torch op on a 0-d float32 sigma, as there, so steps round as there.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from omniloop.pipeline.samplers.base import SchedulerConfigError

__all__ = ["BrownianNoise", "ancestral_step", "check_noise_options", "flow_half_log_snr", "flow_sigma", "seed_or_draw",
           "ve_half_log_snr", "ve_sigma"]


def flow_half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """CONST's half log-SNR ``log((1 - sigma) / sigma)`` (``-logit``)."""
    return sigma.logit().neg()


def flow_sigma(half_log_snr: torch.Tensor) -> torch.Tensor:
    """The inverse of ``flow_half_log_snr``: ``sigmoid(-lambda)``."""
    return half_log_snr.neg().sigmoid()


def ve_half_log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """A non-CONST model's half log-SNR ``-log sigma`` (k-diffusion's ``t_fn``)."""
    return sigma.log().neg()


def ve_sigma(half_log_snr: torch.Tensor) -> torch.Tensor:
    """The inverse of ``ve_half_log_snr``: ``exp(-t)`` (k-diffusion's ``sigma_fn``)."""
    return half_log_snr.neg().exp()


def ancestral_step(sigma_from: torch.Tensor, sigma_to: torch.Tensor, eta: float) -> tuple[torch.Tensor, Any]:
    """k-diffusion's ``get_ancestral_step``: (sigma_down, sigma_up) of a step, ``(sigma_to, 0.)`` at eta 0."""
    if not eta:
        return sigma_to, 0.0
    up = eta * (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2) ** 0.5
    sigma_up = up if up < sigma_to else sigma_to  # Python's min(sigma_to, up): the first unless the second is less
    return (sigma_to ** 2 - sigma_up ** 2) ** 0.5, sigma_up


def check_noise_options(eta: object, s_noise: object, node: str | None = None) -> None:
    """ComfyUI's sampler nodes take ``eta`` and ``s_noise`` in [0, 100]; ``node`` names the one
    whose range it is in the error."""
    for key, value in (("eta", eta), ("s_noise", s_noise)):
        if not (isinstance(value, (int, float)) and 0.0 <= value <= 100.0):
            where = f" ({node}'s range)" if node else ""
            raise SchedulerConfigError(f"{key} must be in [0, 100]{where}, got {value!r}")


def seed_or_draw(seed: int | None) -> int:
    """The prompt's seed (its noise's), or one drawn from torch's global generator when none is given."""
    return int(torch.randint(0, 2**62, []).item()) if seed is None else int(seed)


@dataclass(kw_only=True)
class BrownianNoise:
    """One request's ``BrownianTreeNoiseSampler`` (built at its run's first noised step, on the sample)."""

    tree: Any  # torchsde.BrownianTree over [t0, t1], its state [b, ...] on ``device``
    device: torch.device

    @classmethod
    def build(cls, like: torch.Tensor, run_sigmas: torch.Tensor, sigma_max: torch.Tensor, seed: int,
              on_cpu: bool) -> "BrownianNoise":
        """The tree over ``[min positive sigma of run_sigmas, sigma_max]`` (ComfyUI's span of the
        run: its sigmas before the first one's offset), seeded (``entropy``) with the prompt's
        seed, its state the shape of ``like`` (``w0`` zeros), on the CPU or on ``like``'s device."""
        try:
            import torchsde
        except ImportError as e:  # pragma: no cover - the test extra installs it
            raise ImportError("ComfyUI's SDE samplers draw their noise with torchsde: pip install 'omniloop[audio]'"
                              ) from e
        sigma_min = run_sigmas[run_sigmas > 0].min()
        device = torch.device("cpu") if on_cpu else like.device
        w0 = torch.zeros(like.shape, dtype=torch.float32, device=device)
        tree = torchsde.BrownianTree(sigma_min.to(device), w0, sigma_max.to(device), entropy=seed)
        return cls(tree=tree, device=device)

    def __call__(self, sigma: torch.Tensor, sigma_next: torch.Tensor, out_device: torch.device) -> torch.Tensor:
        """The unit-variance increment between ``sigma_next`` < ``sigma`` (ComfyUI's sign: the
        tree's ``W(sigma_next) - W(sigma)`` read backwards), float32 on ``out_device``."""
        lo, hi = sigma_next.to(self.device).float(), sigma.to(self.device).float()
        with warnings.catch_warnings():  # torchsde warns when a float32 end sits a rounding below its own
            warnings.filterwarnings("ignore", message="Should have t[ab]", category=UserWarning)
            w = self.tree(lo, hi).to(device=out_device, dtype=torch.float32) * -1
        return w / (sigma_next - sigma).abs().sqrt()
