"""The fastest exact kernels, chosen at load: what ``"auto"`` means for ``attention_backend``,
``cfg_mode`` and ``compile`` (DeployConfig's defaults).

A family declares its fast path on CUDA (``ModelSpec.fast_path``): the attention backends to
try in order, whether CFG runs both branches in one batched forward, and whether each repeated
block is compiled. Only exact choices belong here (the same math; outputs within the parity
tests' tolerances): FP8, 8-bit attention and caches change the numbers and stay opt-in.
On a CPU, "auto" keeps what the CPU tests were written against: sdpa, sequential CFG, eager.

``LoadOptions.auto`` names the fields a deployment left to this choice (their values until
then are the CPU's). An explicit value always wins, and one this machine cannot run is refused here, at load,
naming the option and what to pass instead (never a silent fallback).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from omniloop.pipeline.policies.cfg import CFGMode

if TYPE_CHECKING:
    from omniloop.models.model_spec import LoadOptions

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class FastPath:
    """A family's exact fast path on CUDA (each choice measured: benchmarks/results)."""

    attention_backends: tuple[str, ...] = ("sdpa",)  # the first this GPU runs is taken
    cfg_mode: CFGMode = "sequential"  # "batched": cond + uncond stacked into one forward
    compile: bool = False  # torch.compile each repeated block (regional: one compile serves every block)
    # why compile is off although the family could compile (a measured fault not yet cleared): logged
    # when a deployment turns compile on explicitly on CUDA, so the choice is made knowingly
    compile_caveat: str = ""


def _backend_runs(name: str, device: torch.device) -> bool:
    """Whether attention backend ``name`` runs on ``device`` (an exact backend's requirements)."""
    if name in ("sdpa", "math"):
        return True
    if device.type != "cuda":
        return False
    major, _ = torch.cuda.get_device_capability(device)
    if name == "sdpa_cudnn":  # cuDNN's fused flash attention: Ampere and later
        return torch.backends.cudnn.is_available() and major >= 8
    if name == "sdpa_flash":
        return major >= 8
    return False


def compile_runs(device: torch.device) -> bool:
    """torch.compile's default backend (Inductor) needs Triton for CUDA kernels."""
    return device.type != "cuda" or importlib.util.find_spec("triton") is not None


def resolve_kernels(options: LoadOptions, fast: FastPath, *, family: str) -> LoadOptions:
    """``options`` with each field named in ``options.auto`` set to ``fast``'s choice for its
    device (one log line says what was chosen); explicit values checked against the machine."""
    device = options.device
    cuda = device.type == "cuda"
    attention, cfg_mode, compile_ = options.attention_backend, options.cfg_mode, options.compile
    if "attention_backend" in options.auto:
        runnable = [b for b in fast.attention_backends if _backend_runs(b, device)] if cuda else []
        attention = runnable[0] if runnable else "sdpa"
    if "cfg_mode" in options.auto:
        cfg_mode = fast.cfg_mode if cuda else "sequential"
    if "compile" in options.auto:
        compile_ = fast.compile and cuda and compile_runs(device)
        if fast.compile and cuda and not compile_:
            logger.warning("compile=auto: Triton is not installed, so %s's blocks run eager "
                           "(pip install triton for the compiled path)", family)
    elif compile_ and not compile_runs(device):
        raise ValueError(f"compile=True on {device} needs Triton (torch.compile's GPU kernels), which is not installed; "
                         "pip install triton, or pass compile=False (--no-compile)")
    elif compile_ and cuda and fast.compile_caveat:
        logger.warning("compile=True for %s on %s: %s", family, device, fast.compile_caveat)
    if options.auto:
        logger.info("%s on %s: attention_backend=%s, cfg_mode=%s, compile=%s (auto fields: %s; %s)", family, device,
                    attention, cfg_mode, compile_, ", ".join(sorted(options.auto)),
                    "the family's fastest exact path" if cuda else "a CPU keeps the eager reference")
    return dataclasses.replace(options, attention_backend=attention, cfg_mode=cfg_mode, compile=compile_,
                               auto=frozenset())
