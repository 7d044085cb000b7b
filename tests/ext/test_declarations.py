"""Build-time checks: declarations, conflicts, capability negotiation, config errors,
entry-point discovery."""

from __future__ import annotations

import copy
import dataclasses
from importlib import metadata

import pytest
import torch
from torch import nn

from omniloop.ext import (
    ENTRY_POINT_GROUP,
    Declarations,
    InterceptorConfig,
    PluginSpec,
    available_plugin_names,
    install_plugins,
    installed_plugins,
)
from omniloop.ext.builtins import BUILTINS
from omniloop.ext.interceptors import InterceptorBase
from tests.ext.factories import drive, fake_entry_points, request


class AnotherStepSkipper(InterceptorBase):
    declarations = Declarations(kind="step_interceptor", distribution_altering=True, skips="step", min_steps=2)

    def before_step(self, view):
        return None

    def after_step(self, view, preds, supplied):
        pass


def another_step_skipper() -> PluginSpec:  # a factory, as an entry point may export
    return PluginSpec("stepskip", lambda c, ctx: AnotherStepSkipper(ctx.name, c), InterceptorConfig)


def test_builtins_are_registered_under_the_entry_point_group():
    eps = {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    assert set(BUILTINS) <= set(eps), "pip install -e . registers pyproject's [project.entry-points] group"
    for name, ep in eps.items():
        if name in BUILTINS:
            assert ep.load() is BUILTINS[name]


def test_third_party_entry_points_are_discovered(base_pipeline, monkeypatch):
    fake_entry_points(monkeypatch, stepskip=another_step_skipper)
    assert "stepskip" in available_plugin_names()
    pipe = install_plugins(base_pipeline, {"stepskip": {}})
    assert installed_plugins(pipe).bindings == {"denoise": ["stepskip"]}
    with pytest.raises(ValueError, match=r"plugins \['taylorseer', 'stepskip'\] both skip steps of loop 'denoise'"):
        install_plugins(base_pipeline, {"taylorseer": {}, "stepskip": {}})


@pytest.mark.parametrize("pair", [("dbcache", "teacache"), ("fbcache", "dbcache"), ("teacache", "fbcache")])
def test_two_block_skippers_on_one_loop_are_rejected(base_pipeline, pair):
    plugins = {name: {"Fn": 1} if name == "dbcache" else {} for name in pair}
    with pytest.raises(ValueError, match=rf"plugins \['{pair[0]}', '{pair[1]}'\] both skip blocks of loop 'denoise'"):
        install_plugins(base_pipeline, plugins)


def test_a_step_and_a_block_interceptor_compose(base_pipeline):
    pipe = install_plugins(base_pipeline, {"taylorseer": {}, "fbcache": {}})
    hooks = pipe.contexts["denoise"].hooks
    assert [p.name for p in hooks.step_interceptors] == ["taylorseer"] and hooks.block_interceptor.name == "fbcache"


class NoRunBlocks(nn.Module):
    """A family model that inlines its block loop: its forward takes no block_interceptor."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.config = inner.config
        self.blocks = inner.blocks

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        return self.inner(hidden_states, timestep, encoder_hidden_states)


def test_a_family_without_run_blocks_rejects_block_interceptors(base_pipeline):
    components = dict(base_pipeline.components)
    components["transformer"] = NoRunBlocks(components["transformer"])
    pipe = copy.copy(base_pipeline)
    pipe.contexts = {n: dataclasses.replace(c, components=components) for n, c in base_pipeline.contexts.items()}
    pipe.components = components
    for name in ("dbcache", "teacache", "fbcache"):
        with pytest.raises(ValueError, match=rf"plugins\['{name}'\] intercepts transformer blocks, .* without run_blocks"):
            install_plugins(pipe, {name: {"Fn": 1} if name == "dbcache" else {}})
    with pytest.raises(ValueError, match="without run_blocks"):
        install_plugins(pipe, {"fbcache": {"nodes": ["denoise"]}})
    stepped = install_plugins(pipe, {"taylorseer": {}})  # step-level interceptors still work
    assert drive(stepped, [request(0)]).plugins["req0"]["taylorseer"].skipped > 0


def test_distribution_altering_caches_are_rejected_on_few_step_models(base_pipeline):
    distilled = copy.copy(base_pipeline)
    distilled.contexts = {n: dataclasses.replace(c, defaults=c.defaults.replace(steps=4))
                          for n, c in base_pipeline.contexts.items()}
    for name in ("fbcache", "teacache", "taylorseer"):
        with pytest.raises(ValueError, match=rf"plugins\['{name}'\] skips .* 4 steps by default .* distilled"):
            install_plugins(distilled, {name: {}})
    install_plugins(distilled, {"profiler": {"blocks": False}})  # observers are fine


def test_config_errors_name_the_plugin_and_field(base_pipeline):
    with pytest.raises(ValueError, match=r"unknown plugin 'dbcash'; available: \[.*'dbcache'"):
        install_plugins(base_pipeline, {"dbcash": {}})
    with pytest.raises(ValueError, match=r"plugins\['dbcache'\]\.threshold: Input should be greater than or equal to 0"):
        install_plugins(base_pipeline, {"dbcache": {"threshold": -1}})
    with pytest.raises(ValueError, match=r"plugins\['teacache'\]\.treshold: Extra inputs are not permitted"):
        install_plugins(base_pipeline, {"teacache": {"treshold": 0.1}})
    with pytest.raises(ValueError, match=r"Fn \+ Bn = 8 exceeds the 2 blocks of 'transformer'"):
        install_plugins(base_pipeline, {"dbcache": {}})
    with pytest.raises(ValueError, match=r"plugins\['fbcache'\]\.nodes: \['decode'\] are not loop nodes"):
        install_plugins(base_pipeline, {"fbcache": {"nodes": ["decode"]}})
    with pytest.raises(ValueError, match=r"teacache: unknown model 'wan9'"):
        install_plugins(base_pipeline, {"teacache": {"model": "wan9"}})
    with pytest.raises(ValueError, match=r"plugins\['parity_aligner'\]\.mode: Field required"):
        install_plugins(base_pipeline, {"parity_aligner": {"path": "/tmp/x"}})


def test_graph_safe_and_compile_are_reported(base_pipeline):
    pipe = install_plugins(base_pipeline, {"fbcache": {}}, compile=True)
    assert any("not graph_safe" in line for line in installed_plugins(pipe).report)
    assert BUILTINS["fbcache"].build is not None and not installed_plugins(pipe).plugins["fbcache"].declarations.graph_safe
    assert installed_plugins(pipe).plugins["fbcache"].declarations.distribution_altering


def test_plugins_are_installed_once(base_pipeline):
    pipe = install_plugins(base_pipeline, {"fbcache": {}})
    with pytest.raises(ValueError, match="already has plugins installed"):
        install_plugins(pipe, {"profiler": {}})


def test_install_never_mutates_the_shared_pipeline(base_pipeline):
    before = {n: c.hooks for n, c in base_pipeline.contexts.items()}
    pipe = install_plugins(base_pipeline, {"fbcache": {}})
    assert pipe is not base_pipeline and pipe.components is base_pipeline.components
    assert {n: c.hooks for n, c in base_pipeline.contexts.items()} == before
    assert torch.equal(drive(base_pipeline, [request(0)]).latents["req0"],
                       drive(install_plugins(base_pipeline, {}), [request(0)]).latents["req0"])
