"""The parallel axis spec and its pre-flight checks: conflicts are refused with a message
that names them and proposes a spec that works — before any weight is read."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from omniloop.api.cli import build_parser
from omniloop.api.schema_flags import collect
from omniloop.deploy import DeployConfig
from omniloop.parallel.plan import ParallelPlan, SequencePlan
from omniloop.parallel.preflight import ModelFacts, check_deploy, check_model, model_facts, model_problems, propose
from omniloop.parallel.spec import ParallelSpec


def test_text_form_and_degrees():
    spec = ParallelSpec.from_flag("sp=4,ring=2,cfg=2")
    assert (spec.dp, spec.cfg, spec.ring, spec.ulysses, spec.tp) == (1, 2, 2, 2, 1)
    assert spec.sp == 4 and spec.world == 8 and spec.degrees == (1, 2, 2, 2, 1)
    assert ParallelSpec.from_flag("sp=2").ulysses == 2  # sp alone is Ulysses
    assert ParallelSpec.from_flag(spec.compact()) == spec
    assert ParallelSpec.model_validate({"sp": 4, "ulysses": 2}).ring == 2  # the YAML form
    assert ParallelSpec.from_flag("").world == 1
    assert ParallelSpec.from_flag("vae=tiles,check_plans=1,dp=2") == ParallelSpec(dp=2, vae="tiles", check_plans=True)


@pytest.mark.parametrize("text, message", [
    ("cfg=3", "classifier-free guidance has two branches"),
    ("sp=4,ulysses=3,ring=1", "sp=4 must equal ulysses x ring = 3 x 1"),
    ("sp=2,world_size=4", "pass dp=2,ulysses=2 (dp takes the remaining factor)"),
    ("sp=2,world_size=3", "pass degrees whose product is 3"),
    ("sp", "pass key=value items"),
    ("pp=2", "keys: dp, cfg"),
    ("tp=two", "tp='two': pass a number"),
    ("sp=2,sp=4", "is given twice"),
    ("vae=tiles,vae_tile=64,vae_stride=128", "vae_stride=128 exceeds vae_tile=64"),
])
def test_bad_specs_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelSpec.from_flag(text)


@pytest.mark.parametrize("options, message", [
    (dict(parallel="cfg=2", cfg_mode="batched"),
     "cfg=2 puts the CFG branches on 2 ranks while cfg_mode='batched' stacks them.*parallel='dp=2'"),
    (dict(parallel="tp=2", quantization="fp8"), "not sharded: pass quantization='none', or parallel='dp=2'"),
    (dict(parallel="sp=2", device="mps"), "has no process-group backend"),
])
def test_deploy_level_conflicts(options, message):
    with pytest.raises(ValueError, match=message):
        DeployConfig.from_options(device=options.pop("device", "cpu"), **options)


def test_ring_needs_a_kernel_that_returns_its_log_sum_exp():
    with pytest.raises(ValueError, match=r"attention_backend='triton_8bit' does not return: pass attention_backend="
                                         r"'sdpa', or parallel='ulysses=2,tp=2'"):
        DeployConfig.from_options(device="cpu", parallel="ring=2,tp=2", attention_backend="triton_8bit")
    for backend in ("triton_8bit", "cudnn_fp8"):  # Ulysses gives whole heads to any kernel: accepted
        check_deploy(ParallelSpec(ulysses=2), cfg_mode="sequential", attention_backend=backend, quantization="none",
                     device=torch.device("cpu"))


def test_sp_and_tp_are_refused_inside_cuda_graphs():
    """Flux's CUDA-graph path replays captured forwards; collectives inside them are refused."""
    for flag, fix in (("ulysses=2", "dp=2"), ("tp=2,cfg=2", "dp=2,cfg=2")):
        with pytest.raises(ValueError, match=rf"cuda_graphs=True replays captured forwards.*parallel='{fix}'"):
            check_deploy(ParallelSpec.from_flag(flag), cfg_mode="sequential", attention_backend="sdpa",
                         quantization="none", device=torch.device("cpu"), cuda_graphs=True)
    check_deploy(ParallelSpec(dp=2), cfg_mode="sequential", attention_backend="sdpa", quantization="none",
                 device=torch.device("cpu"), cuda_graphs=True)  # rows only: each forward is one rank's own


@pytest.mark.parametrize("gpus, spec, message", [
    (0, "sp=2", r"no CUDA GPU is visible: pass device='cpu'"),
    (1, "cfg=2", r"needs 2 GPUs .* and 1 are visible; pass degrees whose product is at most 1, e.g. parallel='dp=1'"),
    (2, "cfg=2,ulysses=2", r"needs 4 GPUs .* and 2 are visible; .* e.g. parallel='ulysses=2'"),
    (4, "dp=2,cfg=2,ring=2,tp=2", r"needs 16 GPUs .* e.g. parallel='ring=2,tp=2'"),
])
def test_more_ranks_than_gpus_is_refused_with_a_spec_that_fits(monkeypatch, gpus, spec, message):
    """The machine's GPU count (the one fact of the machine the check reads) is set here."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(ValueError, match=message):
        DeployConfig.from_options(device="cuda", parallel=spec)
    with pytest.raises(ValueError, match=r"2 ranks take cuda:0..cuda:1; pass device='cuda', not 'cuda:1'"):
        DeployConfig.from_options(device="cuda:1", parallel="sp=2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 16)
    DeployConfig.from_options(device="cuda", parallel=spec)  # enough GPUs: accepted


def test_deploy_config_takes_text_dict_and_yaml(tmp_path):
    assert DeployConfig.from_options(device="cpu", parallel="sp=2,cfg=2").parallel == ParallelSpec(ulysses=2, cfg=2)
    assert DeployConfig(device="cpu", parallel={"sp": 2}).parallel.ulysses == 2
    path = tmp_path / "deploy.yaml"
    path.write_text("device: cpu\nparallel: ulysses=2,ring=2\n")
    assert DeployConfig.from_yaml(path).parallel.world == 4
    path.write_text("device: cpu\nparallel:\n  tp: 2\n  vae: tiles\n")
    assert DeployConfig.from_yaml(path).parallel == ParallelSpec(tp=2, vae="tiles")
    # JSON round trip: the form ranks receive their deployment in
    config = DeployConfig(device="cpu", parallel="cfg=2")
    assert DeployConfig.model_validate_json(config.model_dump_json()) == config


def test_cli_flag(capsys):
    parser = build_parser()
    args = parser.parse_args(["generate", "a circle", "--parallel", "sp=2,cfg=2", "--device", "cpu"])
    options = collect(args, args._deploy)
    assert DeployConfig.from_options(**options).parallel == ParallelSpec(ulysses=2, cfg=2)
    for command in (["serve"], ["generate", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*command, "--parallel", "cfg=3"])
        assert "classifier-free guidance has two branches" in capsys.readouterr().err


# -- against a model, before its weights load ------------------------------------------


def test_heads_and_plans_of_the_tiny_wan(wan_t2v_dir):
    facts = model_facts(wan_t2v_dir)
    assert facts.family == "wan" and dict(facts.heads) == {"transformer": 2}
    check_model(ParallelSpec.from_flag("ulysses=2,cfg=2,vae=tiles"), facts)  # fits
    with pytest.raises(ValueError, match=r"ulysses=4 does not divide the 2 attention heads of 'transformer'.*"
                                         r"parallel='ulysses=2,ring=2'"):
        check_model(ParallelSpec.from_flag("sp=4"), facts)
    with pytest.raises(ValueError, match=r"tp=4 does not divide the 2 attention heads.*parallel='dp=2,tp=2'"):
        check_model(ParallelSpec.from_flag("tp=4"), facts)
    with pytest.raises(ValueError, match=r"ulysses=2 does not divide the 1 heads per tp rank.*parallel='ring=2,tp=2'"):
        check_model(ParallelSpec.from_flag("tp=2,ulysses=2"), facts)


def test_a_family_without_a_plan_runs_on_one_rank():
    from omniloop.models.families.cosmos3.spec import COSMOS3
    from omniloop.parallel.plan import parallel_plan

    assert parallel_plan(COSMOS3) is None  # Cosmos3 declares none
    with pytest.raises(ValueError, match=r"family 'cosmos3' declares no parallel plan.*parallel='dp=1'"):
        check_model(ParallelSpec.from_flag("sp=2"), ModelFacts("cosmos3", None))


def test_each_missing_plan_is_named_and_folded_into_dp():
    plan = ParallelPlan(models=("transformer",), heads=lambda root, index: {}, rows=True)  # no sequence/tensor/vae
    facts = ModelFacts("toy", plan, {"transformer": 8})
    spec = ParallelSpec.from_flag("sp=2,tp=2,vae=tiles")
    problems = " | ".join(model_problems(spec, facts))
    assert "sp=2: the attention of 'toy' cannot be split" in problems
    assert "tp=2: 'toy' has no tensor-parallel plan" in problems
    assert "vae='tiles': 'toy' has no tiled VAE decode" in problems
    assert propose(spec, facts) == ParallelSpec(dp=4)
    no_rows = ModelFacts("toy", ParallelPlan(models=(), heads=lambda r, i: {}, sequence=SequencePlan("blocks", "x")), {})
    assert "do not split a step's forwards" in model_problems(ParallelSpec(cfg=2), no_rows)[0]
    assert propose(ParallelSpec(cfg=2), no_rows) == ParallelSpec()


def test_refused_before_any_weight_is_read(wan_t2v_dir, tmp_path):
    """A checkpoint whose weight files are gone: the spec is refused on its configs alone."""
    from omniloop.api.generator import VideoGenerator

    configs_only = tmp_path / "configs_only"
    shutil.copytree(wan_t2v_dir, configs_only, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    assert not list(configs_only.rglob("*.safetensors"))
    with pytest.raises(ValueError, match="ulysses=4 does not divide the 2 attention heads"):
        VideoGenerator.from_pretrained(configs_only, device="cpu", parallel="sp=4")
    assert json.loads((configs_only / "transformer" / "config.json").read_text())["num_attention_heads"] == 2
    assert torch.distributed.is_initialized() is False  # nothing was started
