"""Declarative parallelism (design §6.3.4): the axis spec and its pre-flight checks, the
DeviceMesh it compiles to, and the pieces that parallelize a model from outside (sequence
parallel attention, tensor-parallel linears, CFG/data-parallel forwards, tiled VAE decode).

Only the spec is imported here (``DeployConfig`` holds one); the rest lives in its modules:
``preflight``, ``plan``, ``mesh``, ``sequence``, ``sp_attention``, ``tensor``, ``rows``,
``vae``, ``apply``.
"""

from omniloop.parallel.spec import AXES, ParallelSpec

__all__ = ["AXES", "ParallelSpec"]
