"""docs/serving-real-checkpoints.md tells the truth: every ``deploy.yaml`` block loads as a
``DeployConfig`` (and its ``serve:`` section as a ``ServeConfig``), every option it names in
backticks exists (with a value of the option's type), every ``omniloop`` command line parses
with the real CLI parser, every cited benchmark line exists with the quoted numbers, and
every family the runtime ships has its section."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter

from omniloop.api.cli import build_parser
from omniloop.deploy import DeployConfig, Limits
from omniloop.ext.builtins import BUILTINS
from omniloop.models.layers.attention import get_attention_backend
from omniloop.parallel.spec import ParallelSpec
from omniloop.request.params import DiffusionParams
from omniloop.serve.config import ServeConfig, load_config_file

ROOT = Path(__file__).resolve().parents[1]
GUIDE_PATH = ROOT / "docs" / "serving-real-checkpoints.md"
GUIDE = GUIDE_PATH.read_text()
RESULTS = ROOT / "benchmarks" / "results"
FAMILIES = ROOT / "src" / "omniloop" / "models" / "families"

FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
CITATION = re.compile(r"^(?P<file>[\w.-]+\.jsonl): (?P<fields>.+)$")
ASSIGNMENT = re.compile(r"^(?P<name>[a-z_][a-z0-9_]*)=(?P<value>\S+)$")  # `compile=true`
MAPPING = re.compile(r"^(?P<name>[a-z_][a-z0-9_]*): (?P<value>.+)$")  # `taylorseer: {order: 1}`
SNAKE = re.compile(r"^_?[a-z][a-z0-9]*(?:_[a-z0-9]+)+$")  # a bare `max_batch_tokens`


# -- reading the guide -----------------------------------------------------------------------


def _blocks(lang: str, text: str = GUIDE) -> list[str]:
    return [body for tag, body in FENCE.findall(text) if tag == lang]


def _inline_code(text: str = GUIDE) -> list[str]:
    """Backticked spans of the prose and tables (fenced blocks removed first)."""
    prose = FENCE.sub("", text)
    return re.findall(r"`([^`\n]+)`", prose)


def _citations() -> list[str]:
    return [span for span in _inline_code() if CITATION.match(span)]


def _command_lines() -> list[list[str]]:
    """Every ``omniloop ...`` line of the bash blocks, continuation lines joined, as argv."""
    commands = []
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0] == "omniloop":
                commands.append(argv[1:])
    return commands


# -- what exists -----------------------------------------------------------------------------


def _fields(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


OPTION_MODELS: tuple[type[BaseModel], ...] = (DeployConfig, ServeConfig)


@cache
def _known_names() -> frozenset[str]:
    """Names a backticked snake_case word may be: options, request fields, plugin settings,
    option values, and the string keys the family loaders read (model_index.json keys)."""
    from omniloop.serve import chat, protocol  # the HTTP bodies' fields (/v1/videos' reference_images...)

    wire = (protocol._VideoCreateBase, protocol._ImageEditBase, protocol._ImageVariationBase,
            chat.ChatCompletionRequest, chat.MMProcessorKwargs)
    names = set().union(*(_fields(m) for m in (DeployConfig, ServeConfig, Limits, ParallelSpec, DiffusionParams, *wire)))
    for spec in BUILTINS.values():
        names |= {spec.name, *_fields(spec.config_schema)}
    names |= {"sdpa_cudnn", "sdpa_flash", "triton_8bit", "cudnn_fp8", "fp8_tensor", "fifo_batch"}
    for source in FAMILIES.glob("*/*.py"):
        names |= set(re.findall(r"[\"'](_?[a-z][a-z0-9_]*)[\"']", source.read_text()))
    return frozenset(names)


def _check_option_value(name: str, value: Any) -> None:
    """``name`` is a DeployConfig or ServeConfig field and ``value`` is of its type."""
    model = next((m for m in OPTION_MODELS if name in m.model_fields), None)
    assert model is not None, f"the guide names option `{name}`, which is neither a DeployConfig nor a ServeConfig field"
    TypeAdapter(model.model_fields[name].annotation).validate_python(value)
    if name == "attention_backend":
        get_attention_backend(value)
    if name == "plugins":
        _check_plugins(value)


def _check_plugins(plugins: dict[str, Any]) -> None:
    for plugin, config in plugins.items():
        assert plugin in BUILTINS, f"plugin `{plugin}` is not a built-in plugin ({sorted(BUILTINS)})"
        BUILTINS[plugin].config_schema.model_validate(config or {})


# -- the checks ------------------------------------------------------------------------------


@pytest.fixture
def gpus(monkeypatch):
    """The YAML files target a GPU host: the pre-flight check sees 8 GPUs (no torch.cuda call
    reaches a device here: only ``device_count`` is asked)."""
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)


def test_every_deploy_yaml_block_loads(tmp_path, gpus):
    blocks = _blocks("yaml")
    assert len(blocks) >= 7, "one deploy.yaml per family at least"
    for i, block in enumerate(blocks):
        path = tmp_path / f"deploy{i}.yaml"
        path.write_text(block)
        deploy = DeployConfig.from_yaml(path)
        deploy_again, serve = load_config_file(path)
        assert deploy == deploy_again and isinstance(serve, ServeConfig)
        _check_plugins(deploy.plugins)


def test_every_option_the_guide_names_exists():
    assignments = [m for span in _inline_code() if (m := ASSIGNMENT.match(span))]
    assert len(assignments) >= 8
    for m in assignments:
        _check_option_value(m["name"], yaml.safe_load(m["value"]))
    for span in _inline_code():
        if CITATION.match(span) or not (m := MAPPING.match(span)):
            continue
        value = yaml.safe_load(m["value"])
        if m["name"] in BUILTINS:
            _check_plugins({m["name"]: value})
        else:
            assert m["name"] in _known_names(), f"`{span}`: {m['name']!r} is no option, field or checkpoint key"
    for span in _inline_code():
        if SNAKE.match(span):
            assert span in _known_names(), f"`{span}` is no deploy/serve option, request field, plugin setting or " \
                                           "checkpoint key omniloop reads"


def _subcommand_flags(parser: argparse.ArgumentParser, command: str) -> set[str]:
    """The option strings of one subcommand, spelled in full (argparse would also take a prefix)."""
    (subparsers,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}


def test_every_command_line_parses():
    commands = _command_lines()
    assert {argv[0] for argv in commands} == {"serve", "generate"}
    parser = build_parser()
    for argv in commands:
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"`omniloop {shlex.join(argv)}` does not parse (exit {e.code})")
        flags = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
        unknown = flags - _subcommand_flags(parser, argv[0])
        assert not unknown, f"`omniloop {shlex.join(argv)}`: {sorted(unknown)} are not flags of omniloop {argv[0]}"


@cache
def _rows(file: str) -> tuple[dict[str, Any], ...]:
    path = RESULTS / file
    assert path.is_file(), f"the guide cites {file}, which is not under benchmarks/results/"
    return tuple(json.loads(line) for line in path.read_text().splitlines() if line.strip())


def _equal_as_written(actual: Any, written: str) -> bool:
    """``actual`` (a JSON value) equals ``written`` rounded to as many decimals as written."""
    if isinstance(actual, bool) or actual is None:
        return json.dumps(actual) == written
    if isinstance(actual, (int, float)):
        decimals = len(written.split(".", 1)[1]) if "." in written else 0
        return re.fullmatch(r"-?\d+(\.\d+)?", written) is not None and f"{actual:.{decimals}f}" == written
    return str(actual) == written


def _cited_line_exists(citation: str) -> bool:
    m = CITATION.match(citation)
    assert m is not None
    pairs = shlex.split(m["fields"])
    assert all("=" in pair for pair in pairs), f"`{citation}`: write each figure as key=value"
    fields = dict(pair.split("=", 1) for pair in pairs)
    return any(all(key in row and _equal_as_written(row[key], value) for key, value in fields.items())
               for row in _rows(m["file"]))


def test_every_cited_benchmark_figure_is_in_its_file():
    citations = _citations()
    assert len(citations) >= 40
    missing = [c for c in citations if not _cited_line_exists(c)]
    assert not missing, f"no line of benchmarks/results matches: {missing}"


def test_the_citation_check_fails_on_a_drifted_figure():
    citation = next(c for c in _citations() if "median_s=" in c)
    drifted = re.sub(r"median_s=(\d+\.\d+)", lambda m: f"median_s={float(m[1]) + 0.1:.{len(m[1].split('.')[1])}f}",
                     citation)
    assert _cited_line_exists(citation) and not _cited_line_exists(drifted)


def test_every_family_has_its_section_and_every_path_exists():
    for family in sorted(p.parent.name for p in FAMILIES.glob("*/spec.py")):
        assert f"src/omniloop/models/families/{family}/spec.py" in GUIDE, f"family {family!r} has no section"
    for path in re.findall(r"(?:src|benchmarks|tests|docs)/[\w./-]+\.(?:py|md|jsonl)", GUIDE):
        assert (ROOT / path).exists(), f"the guide names {path}, which does not exist"


def test_the_readme_links_the_guide():
    assert "docs/serving-real-checkpoints.md" in (ROOT / "README.md").read_text()


def _published_modules() -> dict[str, Any]:
    """The guide's computed parameter counts -> builders of the published architectures
    (the family presets; text encoders from their published configs), built without weights."""
    from diffusers import (AnyFlowFARTransformer3DModel, AutoencoderKL, AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video,
                           AutoencoderKLWan, AutoencoderOobleck, FluxTransformer2DModel, LTX2VideoTransformer3DModel,
                           StableAudioDiTModel, WanTransformer3DModel)
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from diffusers.pipelines.stable_audio import StableAudioProjectionModel
    from transformers import (CLIPTextConfig, CLIPTextModel, Gemma3TextConfig, Gemma3TextModel, Qwen2Config,
                              Qwen2ForCausalLM, T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel)

    from omniloop.models.families.far import presets as far
    from omniloop.models.families.flux import presets as flux
    from omniloop.models.families.ltx2 import presets as ltx2
    from omniloop.models.families.qwen2 import presets as qwen2
    from omniloop.models.families.stable_audio import presets as sao
    from omniloop.models.families.wan import presets as wan

    t5_xxl = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu")
    return {
        "1,418,996,800": lambda: WanTransformer3DModel(**wan.WAN21_T2V_1_3B),
        "14,288,491,584": lambda: WanTransformer3DModel(**wan.WAN21_T2V_14B),
        "14,288,901,184": lambda: WanTransformer3DModel(**wan.WAN22_I2V_A14B),
        "126,892,531": lambda: AutoencoderKLWan(**wan.WAN21_VAE),
        "5,680,910,336": lambda: UMT5EncoderModel(UMT5Config(vocab_size=256384, **t5_xxl)),  # google/umt5-xxl
        "1,422,147,136": lambda: AnyFlowFARTransformer3DModel(**far.FAR_WAN21_1_3B),
        "11,891,178,560": lambda: FluxTransformer2DModel(**flux.FLUX1_SCHNELL),
        "4,762,310,656": lambda: T5EncoderModel(T5Config(vocab_size=32128, **t5_xxl)),  # t5-v1_1-xxl
        "123,060,480": lambda: CLIPTextModel(CLIPTextConfig(  # openai/clip-vit-large-patch14's text tower
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, projection_dim=768)),
        "83,819,683": lambda: AutoencoderKL(**flux.FLUX1_VAE),
        "18,876,174,592": lambda: LTX2VideoTransformer3DModel(**ltx2.LTX2_TRANSFORMER),
        "11,766,034,176": lambda: Gemma3TextModel(Gemma3TextConfig(vocab_size=262208, **ltx2.GEMMA3_12B_TEXT)),
        "1,431,475,200": lambda: LTX2TextConnectors(**ltx2.LTX2_CONNECTORS),
        "1,222,479,601": lambda: AutoencoderKLLTX2Video(**ltx2.LTX2_VIDEO_VAE),
        "53,248,146": lambda: AutoencoderKLLTX2Audio(**ltx2.LTX2_AUDIO_VAE),
        "55,592,802": lambda: LTX2Vocoder(**ltx2.LTX2_VOCODER),
        "1,056,939,136": lambda: StableAudioDiTModel(**sao.SAO_TRANSFORMER),
        "156,112,514": lambda: AutoencoderOobleck(**sao.SAO_VAE),
        "109,628,544": lambda: T5EncoderModel(T5Config(vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12,
                                                       num_heads=12)),  # t5-base
        "396,544": lambda: StableAudioProjectionModel(**sao.SAO_PROJECTION),
        "494,032,768": lambda: Qwen2ForCausalLM(Qwen2Config(**qwen2.QWEN25_0_5B)),
        "1,543,714,304": lambda: Qwen2ForCausalLM(Qwen2Config(**qwen2.QWEN25_1_5B)),
        "7,615,616,512": lambda: Qwen2ForCausalLM(Qwen2Config(**qwen2.QWEN25_7B)),
    }


def test_the_computed_parameter_counts_are_the_published_architectures():
    pytest.importorskip("diffusers")
    import torch

    for written, build in _published_modules().items():
        assert written in GUIDE, f"the guide no longer gives {written} parameters; update this table with it"
        with torch.device("meta"):  # shapes only: no memory, no init
            count = sum(p.numel() for p in build().parameters())
        assert f"{count:,}" == written, f"the architecture the guide counts as {written} parameters has {count:,}"
