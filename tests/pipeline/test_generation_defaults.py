"""GenerationDefaults: a family's typed defaults, validated at build; seeds resolved once."""

import pytest

from omniloop.models.families.ltx2.presets import LTX2_DEFAULTS, REFINE_DEFAULTS, LTX2Defaults
from omniloop.models.families.wan.presets import WAN_DEFAULTS
from omniloop.models.manifest import ModelManifest
from omniloop.pipeline.defaults import GenerationDefaults, TextDefaults, resolve_seeds
from omniloop.request import DiffusionParams, OmniRequest, SamplingParams, TaskType, TextPart


def test_bad_defaults_fail_at_build_naming_the_field():
    with pytest.raises(ValueError, match=r"^GenerationDefaults.steps=0 must be >= 1"):
        GenerationDefaults(steps=0)
    with pytest.raises(ValueError, match=r"^GenerationDefaults.strength=1.5 must be in \(0, 1\]"):
        GenerationDefaults(strength=1.5)
    with pytest.raises(ValueError, match=r"^TextDefaults.sampling names \['temprature'\]"):
        TextDefaults(sampling={"temprature": 0.5})
    with pytest.raises(TypeError, match="num_frame"):
        WAN_DEFAULTS.replace(num_frame=5)  # a node's override with a typo fails at build


def test_a_node_overrides_its_pipelines_defaults_typed():
    refine = LTX2_DEFAULTS.replace(**REFINE_DEFAULTS)
    assert refine.sigmas == (0.909375, 0.725, 0.421875) and refine.strength == 1.0
    assert refine.family_as(LTX2Defaults).stg_blocks == () and refine.fps == LTX2_DEFAULTS.fps
    assert LTX2_DEFAULTS.family_as(LTX2Defaults).guidance_scale == {"video": 3.0, "audio": 7.0}


def test_a_manifest_sets_typed_defaults_and_refuses_unknown_ones():
    def manifest(defaults):
        return ModelManifest(schema_version=1, name="m", family="wan", variant="v", tasks=["t2v"],
                             components={}, defaults=defaults)

    typed = manifest({"steps": 4, "sigmas": [1.0, 0.5]}).generation_defaults(WAN_DEFAULTS)
    assert (typed.steps, typed.sigmas, typed.height) == (4, (1.0, 0.5), 480)
    with pytest.raises(ValueError, match=r"defaults \['vae_scale_spatial'\] are not generation defaults"):
        manifest({"vae_scale_spatial": 8}).generation_defaults(WAN_DEFAULTS)


def test_seeds_are_resolved_once_and_given_seeds_kept():
    request = OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="x")])
    resolved = resolve_seeds(request, WAN_DEFAULTS)
    assert resolved.diffusion.seed is not None and resolved.sampling.seed is not None
    assert resolve_seeds(resolved, WAN_DEFAULTS) is resolved  # nothing left to draw
    given = request.model_copy(update={"diffusion": DiffusionParams(seed=5), "sampling": SamplingParams(seed=6)})
    assert resolve_seeds(given, WAN_DEFAULTS) is given
    fixed = resolve_seeds(request, WAN_DEFAULTS.replace(seed=11))  # a model with a fixed default seed
    assert (fixed.diffusion.seed, fixed.sampling.seed) == (11, 11)
