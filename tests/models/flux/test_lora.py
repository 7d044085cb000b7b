"""Per-request LoRA: files in diffusers/peft layout (written by diffusers' save_lora_weights
with peft-made weights) and kohya layout, stacked with strengths; parity with diffusers'
LoRA loading + set_adapters; requests with different adapter sets in one batched step
(per-row deltas, never merged); the adapter cache's tiers; bad input.

Measured (fp32 CPU): a request's latents equal diffusers' bit for bit (torch.equal) for the
diffusers-layout adapters (transformer and CLIP text encoder parts), the kohya file and
stacks of both; in a batch of different adapter sets (and sizes) each request equals its
solo run within 2e-6 (the row-group GEMMs run over fewer rows than the solo forward).
"""

from __future__ import annotations

import pytest
import torch

from omniloop.api.generator import VideoGenerator
from omniloop.cache.adapters import CACHE_NAME, AdapterCache
from omniloop.cache.text_embeddings import CACHE_NAME as TEXT_CACHE
from omniloop.engine.errors import RequestRejected
from omniloop.models.layers.lora import LoraLinear
from omniloop.request import DiffusionParams, OmniRequest, OutputSpec, TaskType, TextPart
from tests.engine_plans import run_recorded
from tests.models.flux.helpers import PROMPT, diffusers_with_loras

H, W = 32, 48
TOL = 2e-6


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    from tests.flux_checkpoint import save_flux_loras

    return save_flux_loras(tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def gen(flux_dir, lora_files):
    g = VideoGenerator.from_pretrained(flux_dir, device="cpu", dtype="float32")
    for name, path in lora_files.items():
        g.load_lora(name, path)
    return g


def _req(rid="r", loras=(), h=H, w=W, prompt=PROMPT, seed=5, steps=3):
    return OmniRequest(request_id=rid, task=TaskType.T2I, inputs=[TextPart(text=prompt)],
                       diffusion=DiffusionParams(height=h, width=w, steps=steps, guidance_scale=3.5, seed=seed,
                                                 loras=list(loras)),
                       outputs=OutputSpec(return_latents=True))


def _latents(out):
    assert out.status.value == "completed", out.error
    return out.artifacts["latents"].latents


@pytest.mark.parametrize("adapters", [
    [("detail", 0.5)],
    [("kohya", 1.0)],
    [("style", 0.8), ("detail", -0.5)],  # stacked; style also patches the CLIP text encoder
    [("detail", 1.5), ("kohya", 0.3)],
], ids=["diffusers", "kohya", "stacked-with-text-encoder", "stacked-kohya"])
def test_adapters_equal_diffusers_load_lora_weights_and_set_adapters(flux_dir, lora_files, gen, adapters):
    ours = _latents(gen.generate(_req(loras=adapters)))
    ref = diffusers_with_loras(flux_dir, lora_files, adapters, H, W, 5, prompt=PROMPT, num_inference_steps=3,
                               guidance_scale=3.5)
    assert torch.equal(ours, ref)
    assert not torch.equal(ours, _latents(gen.generate(_req())))  # the adapters changed the image


def test_kohya_file_converts_to_the_diffusers_adapter_it_was_made_from(gen):
    cache: AdapterCache = gen.pipeline.caches[CACHE_NAME]
    kohya = cache.acquire([_ref("kohya")], "probe")["transformer"][0][0]
    detail = cache.acquire([_ref("detail")], "probe")["transformer"][0][0]
    cache.release(["kohya", "detail"], "probe")
    modules = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
               "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.ff_context.net.0.proj"]
    assert sorted(kohya) == sorted(modules)
    for module in modules:  # alpha / rank is folded into the factors (diffusers' conversion): alpha == rank
        k, d = kohya[module], detail[module]
        assert k.alpha == k.rank and torch.equal(k.down, d.down * 1.5) and torch.equal(k.up, d.up)
        assert torch.allclose(k.up @ k.down * k.scale(1.0), d.up @ d.down * d.scale(1.0), atol=1e-6)


def _ref(name, strength=1.0):
    from omniloop.request import LoraRef

    return LoraRef(name=name, strength=strength)


def test_different_adapter_sets_share_one_batched_step_and_equal_their_solo_runs(gen):
    sets = [[], [("style", 0.8)], [("detail", 0.5)], [("style", 0.3), ("kohya", 1.0)]]
    sizes = [(H, W), (H, W), (48, 32), (H, W)]  # one of them another size: packed as well
    reqs = [_req(f"r{i}", s, h=h, w=w, seed=i) for i, (s, (h, w)) in enumerate(zip(sets, sizes))]
    outs, plans = run_recorded(gen.pipeline, reqs, max_batch=8, max_running=8)
    assert plans.batch_sizes() == [4, 4, 4]
    for r in reqs:
        solo = _latents(gen.generate(r.model_copy(update={"request_id": f"solo-{r.request_id}"})))
        assert (_latents(outs[r.request_id]) - solo).abs().max().item() <= TOL
    cache: AdapterCache = gen.pipeline.caches[CACHE_NAME]
    assert all(e["in_use"] == 0 for e in cache.list())  # every request released its adapters


def test_adapters_never_change_the_shared_weights(gen):
    model = gen.pipeline.components["transformer"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen.generate(_req(loras=[("style", 1.0), ("detail", 1.0)]))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    wrapped = [m for m in model.modules() if isinstance(m, LoraLinear)]
    assert wrapped and all(m.key.startswith(("transformer_blocks", "single_", "x_embedder", "proj_out")) for m in wrapped)


def test_text_embeddings_are_cached_per_adapter_set(gen):
    text_cache = gen.pipeline.caches[TEXT_CACHE]
    before = text_cache.stats.hits
    gen.generate(_req(prompt="a cached prompt", loras=[("detail", 1.0)], steps=1))
    gen.generate(_req(prompt="a cached prompt", loras=[("kohya", 1.0)], steps=1))  # transformer-only: same rows
    assert text_cache.stats.hits - before == 2  # both encoders' rows reused
    hits = text_cache.stats.hits
    gen.generate(_req(prompt="a cached prompt", loras=[("style", 1.0)], steps=1))  # patches CLIP: its rows differ
    assert text_cache.stats.hits - hits == 1  # T5's row only


def test_bad_loras_are_refused_naming_the_problem(gen, lora_files, tmp_path):
    from pydantic import ValidationError
    from safetensors.torch import load_file, save_file

    with pytest.raises(RequestRejected, match=r"diffusion.loras\[0\].name 'nope' is not a loaded LoRA; loaded: "):
        gen.generate(_req(loras=[("nope", 1.0)]))
    with pytest.raises(ValidationError, match=r"loras\.0\.strength\n.*less than or equal to 5"):
        _req(loras=[("style", 7.5)])
    sd = load_file(str(lora_files["detail"]))
    sd["transformer.transformer_blocks.9.attn.to_q.lora_A.weight"] = torch.zeros(2, 32)  # no block 9
    sd["transformer.transformer_blocks.9.attn.to_q.lora_B.weight"] = torch.zeros(32, 2)
    sd["transformer.transformer_blocks.0.attn.to_k.lora_A.weight"] = torch.zeros(2, 31)  # wrong width
    save_file(sd, str(tmp_path / "other_model.safetensors"))
    with pytest.raises(ValueError, match=r"2 keys do not match the model: \[transformer.transformer_blocks.0.attn.to_k "
                                         r"\(A \[2, 31\], B \[32, 2\] vs the linear's \[out 32, in 32\]\), "
                                         r"transformer.transformer_blocks.9.attn.to_q \(no such linear\)\]"):
        gen.load_lora("other", tmp_path / "other_model.safetensors")
    assert "other" not in gen.pipeline.caches[CACHE_NAME]
    (tmp_path / "lora.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ValueError, match="is not a .safetensors file"):
        gen.load_lora("pickle", tmp_path / "lora.bin")
    assert _latents(gen.generate(_req(loras=[("detail", 1.0)], steps=1))) is not None  # still serving


def test_offline_loras_by_file_path(gen, lora_files):
    path = str(lora_files["detail"])
    by_path = _latents(gen.generate(_req(loras=[(path, 0.5)])))
    assert torch.equal(by_path, _latents(gen.generate(_req(loras=[("detail", 0.5)]))))
    image = gen.generate_image(PROMPT, height=H, width=W, steps=2, seed=1, loras=[(path, 0.5)], save_image=False)
    assert image.image.shape == (H, W, 3)


def test_adapter_tiers_lru_budget_and_unload_while_in_use(flux_dir, lora_files):
    gen = VideoGenerator.from_pretrained(flux_dir, device="cpu", dtype="float32", text_cache_mb=0)
    old: AdapterCache = gen.pipeline.caches[CACHE_NAME]
    sizes = {}
    for name, path in lora_files.items():
        sizes[name] = old.load(name, path)["bytes"]
    # budgets: the device tier holds one adapter at a time, the host tier the two small ones
    cache = AdapterCache(old.components, old.support, device=old.device, dtype=old.dtype,
                         device_budget_bytes=sizes["style"], host_budget_bytes=sizes["detail"] + sizes["kohya"])
    gen.pipeline.caches[CACHE_NAME] = cache
    for name, path in lora_files.items():
        cache.load(name, path)
    assert [e["name"] for e in cache.list() if e["host_resident"]] == ["detail", "kohya"]  # style evicted (LRU)
    cache.acquire([_ref("style")], "a")  # reloaded from its file, then device-resident
    assert cache.stats.disk_loads == 4 and cache.summary()["device_bytes"] == sizes["style"]
    cache.acquire([_ref("detail")], "b")  # style pinned: over budget rather than failing
    assert cache.stats.over_budget == 1
    cache.release(["style"], "a")
    cache.acquire([_ref("kohya")], "c")
    assert cache.stats.device_evictions >= 1 and cache.summary()["device_bytes"] <= sizes["style"] + sizes["detail"]
    cache.unload("detail")  # in use by "b": stays until released, no new request may name it
    assert "detail" not in cache
    with pytest.raises(RequestRejected, match="'detail' is not a loaded LoRA"):
        gen.generate(_req(loras=[("detail", 1.0)]))
    cache.release(["detail"], "b")
    assert "detail" not in [e["name"] for e in cache.list()] and cache.summary()["loaded"] == 2
