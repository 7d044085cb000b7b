"""Families register themselves: built-in folders on import, third-party ones through the
``omniloop.families`` entry-point group."""

from __future__ import annotations

import sys
import textwrap

import pytest

import omniloop.models.families as families
from omniloop.models import model_spec


def test_builtin_families_register_without_being_named():
    specs = model_spec.registered_specs()
    classes = {c for s in specs for c in s.diffusers_classes}
    assert {"WanPipeline", "WanImageToVideoPipeline", "omniloop:wan", "Qwen2ForCausalLM"} <= classes
    assert all(s.description for s in specs)


def test_an_unknown_class_lists_what_is_supported():
    with pytest.raises(ValueError, match=r"no omniloop family loads; supported: \[.*'WanPipeline'"):
        model_spec.spec_for_class("NoSuchPipeline")


def test_a_third_party_family_registers_through_its_entry_point(tmp_path, monkeypatch):
    pkg = tmp_path / "toyfam"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        from omniloop.models.model_spec import ModelSpec, register_model_spec

        TOY = register_model_spec(ModelSpec(
            family="toy", diffusers_classes=("ToyPipeline",), variant=lambda index: None,
            build=lambda *a: None, description="a third-party family"))
    '''))
    dist = tmp_path / "toyfam-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toyfam\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[omniloop.families]\ntoy = toyfam\n")
    # a broken plug-in is skipped (logged), the others still load
    (tmp_path / "broken-0.1.dist-info").mkdir()
    (tmp_path / "broken-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (tmp_path / "broken-0.1.dist-info" / "entry_points.txt").write_text("[omniloop.families]\nbad = no_such_module\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(families, "_discovered", False)
    monkeypatch.setattr(model_spec, "_REGISTRY", dict(model_spec._REGISTRY))
    try:
        spec = model_spec.spec_for_class("ToyPipeline")
        assert spec.family == "toy" and spec.description == "a third-party family"
        assert model_spec.spec_for_class("WanPipeline").family == "wan"
    finally:
        sys.modules.pop("toyfam", None)


def test_two_families_cannot_claim_one_class(monkeypatch):
    model_spec.discover_families()
    monkeypatch.setattr(model_spec, "_REGISTRY", dict(model_spec._REGISTRY))
    other = model_spec.ModelSpec(family="other", diffusers_classes=("WanPipeline",), variant=lambda i: None,
                                 build=lambda *a: None)
    with pytest.raises(ValueError, match="already claimed by family 'wan'"):
        model_spec.register_model_spec(other)
