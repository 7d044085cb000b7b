"""FAR causal Wan family (diffusers' AnyFlowFARPipeline). Importing it registers it."""

from omniloop.models.families.far import spec as _spec  # noqa: F401
