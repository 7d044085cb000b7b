"""Plugins are enabled by deploy config only; requests parameterize enabled plugins
through validated per-plugin schemas. Wiring through VideoGenerator, AsyncEngine and a
deploy config file."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from omniloop.deploy import DeployConfig
from omniloop.engine import Engine, EngineConfig
from omniloop.engine.errors import RequestRejected
from omniloop.ext import install_plugins, installed_plugins
from tests.ext.factories import drive, request


def engine_for(pipeline) -> Engine:
    return Engine(pipeline, EngineConfig())


@pytest.mark.parametrize("plugins,params,message", [
    ({}, {"fbcache": {"threshold": 0.1}},
     r"diffusion\.plugin_params\['fbcache'\]: plugin 'fbcache' is not enabled in this deployment \(enabled: \[\]\)"),
    ({"fbcache": {}}, {"teacache": {}},
     r"diffusion\.plugin_params\['teacache'\]: plugin 'teacache' is not enabled .*\(enabled: \['fbcache'\]\)"),
    ({"fbcache": {}}, {"fbcache": {"threshold": -0.5}},
     r"diffusion\.plugin_params\['fbcache'\]\.threshold: Input should be greater than or equal to 0"),
    ({"fbcache": {}}, {"fbcache": {"Fn": 4}},
     r"diffusion\.plugin_params\['fbcache'\]\.Fn: Extra inputs are not permitted"),  # Fn/Bn are deploy-only
    ({"teacache": {}}, {"teacache": {"enabled": "maybe"}},
     r"diffusion\.plugin_params\['teacache'\]\.enabled: Input should be a valid boolean"),
    ({"profiler": {"blocks": False}}, {"profiler": {"blocks": True}},
     r"diffusion\.plugin_params\['profiler'\]: plugin 'profiler' takes no per-request parameters"),
])
def test_bad_plugin_params_are_rejected_naming_plugin_and_field(base_pipeline, plugins, params, message):
    engine = engine_for(install_plugins(base_pipeline, plugins))
    with pytest.raises(RequestRejected, match=message):
        engine.add_request(request(0, plugin_params=params))
    assert engine.num_waiting() == 0 and engine.stats.rejected == 1


def test_request_params_tune_an_enabled_plugin(base_pipeline):
    pipe = install_plugins(base_pipeline, {"fbcache": {"threshold": 0.1, "warmup_steps": 2}})
    driven = drive(pipe, [request(0), request(1, plugin_params={"fbcache": {"threshold": 0.05}}),
                          request(2, plugin_params={"fbcache": {"warmup_steps": 12}})])
    skipped = {rid: p["fbcache"].skipped for rid, p in driven.plugins.items()}
    assert skipped["req0"] > skipped["req1"] and skipped["req2"] == 0
    assert driven.plugins["req1"]["fbcache"].config.threshold == 0.05
    assert pipe.contexts["denoise"].hooks.block_interceptor.config.threshold == 0.1  # deployment default untouched


def test_video_generator_from_pretrained_enables_plugins(wan_t2v_dir):
    from omniloop.api.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32",
                                         plugins={"fbcache": {"threshold": 0.1, "warmup_steps": 2}})
    assert gen.deploy.plugins == {"fbcache": {"threshold": 0.1, "warmup_steps": 2}}
    assert installed_plugins(gen.pipeline).bindings == {"denoise": ["fbcache"]}
    out = gen.generate(request(0, steps=8, plugin_params={"fbcache": {"threshold": 0.2}}))
    assert out.status.value == "completed"
    assert gen.engine.plugin_metrics()["fbcache"]["skipped"] > 0


def test_async_engine_reads_plugins_from_the_deploy_config_file(wan_t2v_dir, tmp_path):
    from omniloop.engine.async_engine import AsyncEngine

    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"device": "cpu", "dtype": "float32",
                                    "plugins": {"teacache": {"model": "identity", "threshold": 0.4, "ret_steps": 2},
                                                "profiler": {"blocks": False}}}))
    deploy = DeployConfig.from_yaml(path)

    async def main():
        async with AsyncEngine.from_pretrained(wan_t2v_dir, deploy=deploy) as engine:
            out = await engine.generate(request(0, steps=8))
            with pytest.raises(RequestRejected, match="plugin 'dbcache' is not enabled"):
                engine.submit(request(1, plugin_params={"dbcache": {}}))
            return out, engine.stats()

    out, stats = asyncio.run(main())
    assert out.status.value == "completed"
    assert stats["plugins"]["teacache"]["skipped"] > 0
    assert stats["plugins"]["profiler"]["step_s"]["denoise"]["count"] == 8
