"""Every family's declared fast path (``ModelSpec.fast_path``, issue 34): what ``"auto"`` resolves to
on a (simulated) CUDA device, the eager reference on a CPU, explicit values winning, impossible
ones refused naming the option, and the blocks a fast path compiles staying within the family's
parity tolerance of eager on CPU Inductor."""

from __future__ import annotations

import shutil

import pytest
import torch

from omniloop.deploy import DeployConfig
from omniloop.engine.async_engine import load_options
from omniloop.models import fast_path
from omniloop.models.fast_path import resolve_kernels
from omniloop.models.model_spec import LoadOptions, ModelSpec, registered_specs

AUTO = frozenset({"attention_backend", "cfg_mode", "compile"})

# family -> (attention_backend, cfg_mode, compile) that "auto" picks on an H100-class GPU with Triton
ON_CUDA = {
    "wan": ("sdpa_cudnn", "batched", True),
    # no CFG forward (embedded guidance): nothing to batch; compile off until the GPU clears it (flux/spec.py)
    "flux": ("sdpa_cudnn", "sequential", False),
    "ltx2": ("sdpa_cudnn", "batched", True),
    "stable_audio": ("sdpa", "batched", True),
    "far": ("sdpa", "sequential", False),
    "cosmos3": ("sdpa", "sequential", False),
    "qwen2": ("sdpa", "sequential", False),
}
CPU_REFERENCE = ("sdpa", "sequential", False)


def _spec(family: str) -> ModelSpec:
    specs = [s for s in registered_specs() if s.family == family]
    assert specs, f"no registered family {family!r}"
    assert len({s.fast_path for s in specs}) == 1, f"{family}'s specs declare different fast paths"
    return specs[0]


@pytest.fixture
def h100(monkeypatch):
    """The CUDA branch on this CPU machine: the GPU's capabilities are what the checks ask."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(fast_path, "compile_runs", lambda device: True)


def _picked(options: LoadOptions) -> tuple[str, str, bool]:
    return options.attention_backend, options.cfg_mode, options.compile


@pytest.mark.parametrize("family", sorted(ON_CUDA))
def test_auto_on_cuda_picks_the_declared_path(family, h100):
    options = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, auto=AUTO)
    assert _picked(resolve_kernels(options, _spec(family).fast_path, family=family)) == ON_CUDA[family]


@pytest.mark.parametrize("family", sorted(ON_CUDA))
def test_auto_on_cpu_keeps_the_eager_reference(family):
    options = load_options(DeployConfig(device="cpu"))
    assert options.auto == AUTO
    assert _picked(resolve_kernels(options, _spec(family).fast_path, family=family)) == CPU_REFERENCE


@pytest.mark.parametrize("family", sorted(ON_CUDA))
def test_an_explicit_option_overrides_auto(family, h100):
    """Each field given explicitly wins on CUDA; the others still follow the family."""
    declared = ON_CUDA[family]
    explicit = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, attention_backend="math",
                           cfg_mode="sequential" if declared[1] == "batched" else "batched",
                           compile=not declared[2])
    assert _picked(resolve_kernels(explicit, _spec(family).fast_path, family=family)) == (
        "math", explicit.cfg_mode, not declared[2])
    only_compile = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, compile=False,
                               auto=frozenset({"attention_backend", "cfg_mode"}))
    assert _picked(resolve_kernels(only_compile, _spec(family).fast_path, family=family)) == (*declared[:2], False)


@pytest.mark.parametrize("family", sorted(ON_CUDA))
def test_compile_without_triton_is_refused_naming_the_option(family, monkeypatch):
    monkeypatch.setattr(fast_path, "compile_runs", lambda device: False)
    explicit = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, compile=True)
    with pytest.raises(ValueError, match=r"compile=True on cuda needs Triton.*compile=False \(--no-compile\)"):
        resolve_kernels(explicit, _spec(family).fast_path, family=family)


def test_an_explicit_compile_with_a_caveat_says_it(h100, caplog):
    """Flux's compile is off for a measured fault: turning it on is allowed, and logged with why."""
    explicit = LoadOptions(device=torch.device("cuda"), dtype=torch.bfloat16, compile=True)
    with caplog.at_level("WARNING", logger=fast_path.__name__):
        assert resolve_kernels(explicit, _spec("flux").fast_path, family="flux").compile is True
    assert "compile=True for flux on cuda: Flux's compiled blocks gave an image 13.4 dB" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger=fast_path.__name__):
        resolve_kernels(explicit, _spec("wan").fast_path, family="wan")
    assert caplog.text == ""  # no caveat, no line


@pytest.mark.parametrize("family", ["flux", "ltx2", "stable_audio", "far", "qwen2"])
def test_a_loaded_pipeline_on_cpu_is_the_eager_reference(family, request):
    """Loaded with every kernel option left "auto": no compiled block, sdpa everywhere."""
    from omniloop.models.loader import load_pipeline

    folder = request.getfixturevalue(f"{family}_dir")
    _, pipeline = load_pipeline(folder, load_options(DeployConfig(device="cpu", dtype="float32")))
    assert pipeline.compiled is False
    backends = {m.attention_backend for c in pipeline.components.values() if isinstance(c, torch.nn.Module)
                for m in c.modules() if hasattr(m, "attention_backend")}
    assert backends <= {"sdpa"}
    compiled = [c for c in pipeline.components.values() if isinstance(c, torch.nn.Module)
                for m in c.modules() if m._compiled_call_impl is not None]
    assert compiled == []


# -- compiled blocks vs eager on CPU Inductor ----------------------------------------------------------

def _inductor_cpu_unavailable() -> str | None:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        return "CPU Inductor needs a C++ compiler (g++) to build its kernels; none on PATH"
    return None


# family -> (request builder, parity tolerance of its eager-vs-diffusers tests, fp32)
def _flux_request():
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

    return OmniRequest(task=TaskType.T2I, inputs=[TextPart(text="a red fox")], outputs=OutputSpec(return_latents=True),
                       diffusion=DiffusionParams(height=32, width=48, steps=1, guidance_scale=3.5, seed=5))


def _ltx2_request():
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

    return OmniRequest(task=TaskType.T2V, inputs=[TextPart(text="a red fox")], outputs=OutputSpec(return_latents=True),
                       diffusion=DiffusionParams(height=64, width=64, num_frames=9, steps=2, guidance_scale=4.0,
                                                 seed=3, negative_prompt="blurry"))


def _stable_audio_request():
    from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart

    return OmniRequest(task=TaskType.T2A, inputs=[TextPart(text="a dog barking")], outputs=OutputSpec(return_latents=True),
                       diffusion=DiffusionParams(steps=2, guidance_scale=7.0, seed=3, duration_s=1.5,
                                                 negative_prompt="noise"))


COMPILED = {  # the families whose fast path compiles blocks; tolerances: their diffusers parity tests' (fp32)
    "flux": (_flux_request, 1e-4),
    "ltx2": (_ltx2_request, 1e-4),
    "stable_audio": (_stable_audio_request, 1e-5),
}


def test_every_compiling_fast_path_has_a_parity_check():
    """Wan's compiled blocks are checked by tests/serve/test_startup.py (a compiled server on CPU);
    Flux's compile is opt-in (``compile=True``) and checked all the same."""
    assert {f for f, picked in ON_CUDA.items() if picked[2]} - {"wan"} <= set(COMPILED)


# cold CPU Inductor compiles, measured here (2 shared cores): Flux 24 s (2 graphs: double + single
# block), LTX-2 48 s (3 graphs: the batched CFG pass, and the batch-1 guidance passes with and
# without cross-modal attention), Stable Audio 5 s
SLOW = pytest.mark.slow


@pytest.mark.parametrize("family", [pytest.param("flux", marks=SLOW), pytest.param("ltx2", marks=SLOW), "stable_audio"])
def test_compiled_blocks_match_eager_on_cpu_inductor(family, request):
    """The fast path's per-block compile, run by CPU Inductor on the tiny checkpoint (its cfg_mode
    too): the final latents within the family's parity tolerance of the eager sequential run."""
    if (reason := _inductor_cpu_unavailable()) is not None:
        pytest.skip(reason)
    from omniloop.api.generator import VideoGenerator

    make_request, tol = COMPILED[family]
    folder = request.getfixturevalue(f"{family}_dir")
    _, cfg_mode, _ = ON_CUDA[family]
    eager = VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32", compile=False, cfg_mode="sequential")
    fast = VideoGenerator.from_pretrained(folder, device="cpu", dtype="float32", compile=True, cfg_mode=cfg_mode)
    assert fast.pipeline.compiled is True
    torch._dynamo.reset()
    ref, out = eager.generate(make_request()), fast.generate(make_request())
    assert ref.status.value == out.status.value == "completed", (ref.error, out.error)
    a, b = ref.artifacts["latents"].latents, out.artifacts["latents"].latents
    err = (a - b).abs().max().item()
    assert err <= tol * max(1.0, a.abs().max().item()), f"{family}: compiled blocks differ from eager by {err}"
