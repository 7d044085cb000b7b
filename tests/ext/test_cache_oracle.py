"""Cache decisions and outputs equal the published algorithms on the same sequences.

Oracles: cache-dit itself (``CachedBlocks_Pattern_0_1_2`` driving its own
``CachedContextManager``, and its ``TaylorSeerCalibrator``) for DBCache/FBCache/TaylorSeer;
for TeaCache, ``TeaCacheReference`` below, a transcription of TeaCache4Wan2.1's
``teacache_forward`` decision code (even/odd counters, class-level state) kept independent
of our implementation.

Toy blocks are elementwise, so a batched forward is bit-identical to per-row ones and
every comparison is exact. Block 0 adds the ``encoder_hidden_states`` it is given, so each
test scripts the first-block residual sequence directly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from omniloop.ext.cache.dbcache import DBCache, DBCacheConfig
from omniloop.ext.cache.taylorseer import TaylorSeerConfig, TaylorSeerStep
from omniloop.ext.cache.teacache import IDENTITY_POLYNOMIAL, TeaCache, TeaCacheConfig, TeaCacheProfile
from omniloop.ext.interceptors import BlockSegment, PluginLoopState, SegmentedBlockRun, StepView
from omniloop.ext.scope import Segment
from omniloop.models.families.wan.presets import TEACACHE_DEFAULT, TEACACHE_POLYNOMIALS
from omniloop.models.layers.run_blocks import run_blocks

cache_dit = pytest.importorskip("cache_dit", reason="cache-dit is the test-only oracle (pip install cache-dit)")
from cache_dit.caching.cache_blocks.pattern_0_1_2 import CachedBlocks_Pattern_0_1_2  # noqa: E402
from cache_dit.caching.cache_contexts.cache_config import DBCacheConfig as CDConfig  # noqa: E402
from cache_dit.caching.cache_contexts.cache_manager import CachedContextManager  # noqa: E402
from cache_dit.caching.cache_contexts.calibrators import TaylorSeerCalibrator, TaylorSeerCalibratorConfig  # noqa: E402
from cache_dit.caching.cache_types import CacheType  # noqa: E402
from cache_dit.caching.forward_pattern import ForwardPattern  # noqa: E402

STEPS = 24
SHAPE = (1, 6, 8)  # [rows, tokens, dim]


class AddEncoder(nn.Module):
    """Block 0: its residual is exactly the scripted ``encoder_hidden_states``."""

    def forward(self, hidden_states, encoder_hidden_states):
        return hidden_states + encoder_hidden_states


class Elementwise(nn.Module):
    def __init__(self, a: float) -> None:
        super().__init__()
        self.a = a

    def forward(self, hidden_states, encoder_hidden_states):
        return hidden_states * self.a + torch.tanh(hidden_states) * 0.3 + encoder_hidden_states * 0.05


def toy_blocks(n: int) -> nn.ModuleList:
    return nn.ModuleList([AddEncoder(), *[Elementwise(0.9 - 0.05 * i) for i in range(n - 1)]])


def scripted_residuals(seed: int, steps: int = STEPS, spread: float = 0.3) -> list[torch.Tensor]:
    """First-block residuals base * (1 + e_t): relative differences spread over [0, spread]."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(SHAPE, generator=g) + 0.5
    return [base * (1 + spread * torch.rand((), generator=g)) for _ in range(steps)]


def hidden_inputs(seed: int, steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1000)
    x0 = torch.randn(SHAPE, generator=g)
    return [x0 * (1 - t / (2 * steps)) + 0.01 * torch.randn(SHAPE, generator=g) for t in range(steps)]


# -- cache-dit side ---------------------------------------------------------------------


def cache_dit_blocks(blocks: nn.ModuleList, cfg: dict, order: int, separate_cfg: bool = False):
    manager = CachedContextManager("oracle")
    calibrator = TaylorSeerCalibratorConfig(taylorseer_order=order) if order else None
    manager.new_context(name="ctx", cache_config=CDConfig(enable_separate_cfg=separate_cfg, **cfg),
                        calibrator_config=calibrator)
    cached = CachedBlocks_Pattern_0_1_2(blocks, transformer=None, forward_pattern=ForwardPattern.Pattern_2,
                                        cache_prefix="toy", cache_context="ctx", context_manager=manager,
                                        cache_type=CacheType.DBCache)
    return cached, manager


def our_config(cfg: dict, order: int) -> DBCacheConfig:
    names = {"Fn_compute_blocks": "Fn", "Bn_compute_blocks": "Bn", "residual_diff_threshold": "threshold",
             "max_warmup_steps": "warmup_steps", "warmup_interval": "warmup_interval",
             "max_cached_steps": "max_cached_steps", "max_continuous_cached_steps": "max_continuous_cached_steps",
             "max_accumulated_residual_diff_threshold": "max_accumulated_diff"}
    return DBCacheConfig(**{names[k]: v for k, v in cfg.items()}, taylorseer_order=order)


def run_ours(plugin: DBCache, blocks, x: torch.Tensor, enc: torch.Tensor, states: list, rows: list[int]) -> torch.Tensor:
    loop_state = PluginLoopState("dbcache", plugin.config)
    segments, start = [], 0
    for i, (state, n) in enumerate(zip(states, rows)):
        segments.append(BlockSegment(Segment("r", f"b{i}", None, start, start + n), state, plugin.config, STEPS, loop_state))
        start += n
    return run_blocks(blocks, x, enc, interceptor=SegmentedBlockRun(plugin, segments, None))


CONFIGS = {
    "F1B0": dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.12, max_warmup_steps=2),
    "F1B1": dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.12, max_warmup_steps=0),
    "F2B1-warmup-interval": dict(Fn_compute_blocks=2, Bn_compute_blocks=1, residual_diff_threshold=0.1,
                                 max_warmup_steps=6, warmup_interval=2),
    "max-cached": dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.2, max_warmup_steps=1,
                       max_cached_steps=4),
    "max-continuous": dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.25,
                           max_warmup_steps=1, max_continuous_cached_steps=2),
    "max-accumulated": dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.2,
                            max_warmup_steps=1, max_accumulated_residual_diff_threshold=0.5),
    "always": dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=1.0, max_warmup_steps=3),
    "off": dict(Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.0, max_warmup_steps=0),
}


@pytest.mark.parametrize("order", [0, 1, 2], ids=["reuse", "taylor1", "taylor2"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_dbcache_equals_cache_dit(name, order):
    cfg = CONFIGS[name]
    n_blocks = 4
    oracle, manager = cache_dit_blocks(toy_blocks(n_blocks), cfg, order)
    plugin = DBCache("dbcache", our_config(cfg, order))
    ours_blocks, state = toy_blocks(n_blocks), plugin.new_branch_state()
    for x, r in zip(hidden_inputs(0), scripted_residuals(0)):
        expected = oracle(hidden_states=x, encoder_hidden_states=r)
        got = run_ours(plugin, ours_blocks, x, r, [state], [1])
        assert torch.equal(got, expected), f"{name}: output differs at step {state.calls - 1}"
    assert state.cached_steps == manager.get_cached_steps()
    theirs = {int(k): v for k, v in manager.get_residual_diffs().items()}
    assert state.diffs.keys() == theirs.keys() and all(state.diffs[k] == theirs[k] for k in theirs)
    if name not in ("off",) and order == 0:
        assert 0 < len(state.cached_steps) < STEPS, "the scripted sequence should exercise both outcomes"


@pytest.mark.parametrize("batched", [False, True], ids=["sequential-cfg", "batched-cfg"])
def test_per_branch_state_equals_cache_dit_separate_cfg(batched):
    """cache-dit's separate-CFG contexts (cond on even, uncond on odd transformer calls)
    vs our one state per branch — called one branch per forward, or both in one batch."""
    cfg = dict(Fn_compute_blocks=1, Bn_compute_blocks=1, residual_diff_threshold=0.12, max_warmup_steps=2)
    oracle, manager = cache_dit_blocks(toy_blocks(3), cfg, order=1, separate_cfg=True)
    plugin = DBCache("dbcache", our_config(cfg, 1))
    blocks = toy_blocks(3)
    cond, uncond = plugin.new_branch_state(), plugin.new_branch_state()
    xs_c, xs_u = hidden_inputs(1), hidden_inputs(2)
    rs_c, rs_u = scripted_residuals(1), scripted_residuals(2, spread=0.5)
    for t in range(STEPS):
        want_c = oracle(hidden_states=xs_c[t], encoder_hidden_states=rs_c[t])
        want_u = oracle(hidden_states=xs_u[t], encoder_hidden_states=rs_u[t])
        if batched:
            got = run_ours(plugin, blocks, torch.cat([xs_c[t], xs_u[t]]), torch.cat([rs_c[t], rs_u[t]]), [cond, uncond], [1, 1])
            got_c, got_u = got[:1], got[1:]
        else:
            got_c = run_ours(plugin, blocks, xs_c[t], rs_c[t], [cond], [1])
            got_u = run_ours(plugin, blocks, xs_u[t], rs_u[t], [uncond], [1])
        assert torch.equal(got_c, want_c) and torch.equal(got_u, want_u), f"step {t}"
    assert cond.cached_steps == manager.get_cached_steps()
    assert uncond.cached_steps == manager.get_cfg_cached_steps()
    assert cond.cached_steps != uncond.cached_steps, "branches should decide differently here"


@pytest.mark.parametrize("order,warmup,interval", [(1, 3, 2), (2, 4, 3), (0, 2, 2), (1, 1, 1)])
def test_taylorseer_step_equals_cache_dit_calibrator(order, warmup, interval):
    calibrator = TaylorSeerCalibrator(n_derivatives=order, max_warmup_steps=warmup, skip_interval_steps=interval)
    plugin = TaylorSeerStep("taylorseer", TaylorSeerConfig(order=order, warmup_steps=warmup, interval=interval))
    state = PluginLoopState("taylorseer", plugin.config)
    view = StepView(loop=None, component="transformer", branches=("cond",), state=state)
    g = torch.Generator().manual_seed(3)
    ys = [torch.sin(torch.linspace(0, 3, 10) * (1 + 0.05 * t)) + 0.01 * torch.randn(10, generator=g) for t in range(STEPS)]
    for t, y in enumerate(ys):
        expected = calibrator.step(y, name="pred")
        supplied = plugin.before_step(view) or {}
        pred = supplied["cond"]["video"] if "cond" in supplied else y
        plugin.after_step(view, {"cond": {"video": pred}}, frozenset(supplied))
        assert torch.equal(pred, expected), f"step {t}"
        assert ("cond" not in supplied) == calibrator.states["pred"].should_compute(t)


# -- TeaCache -------------------------------------------------------------------------------


class TeaCacheReference:
    """TeaCache4Wan2.1 ``teacache_forward``'s cache logic, transcribed (one model object,
    cond/uncond told apart by the parity of a shared call counter)."""

    def __init__(self, sample_steps: int, thresh: float, coefficients: list[float], use_ret_steps: bool) -> None:
        self.cnt, self.num_steps, self.teacache_thresh, self.coefficients = 0, sample_steps * 2, thresh, coefficients
        self.ret_steps = 5 * 2 if use_ret_steps else 1 * 2
        self.cutoff_steps = sample_steps * 2 if use_ret_steps else sample_steps * 2 - 2
        self.accumulated_rel_l1_distance_even = self.accumulated_rel_l1_distance_odd = 0
        self.previous_e0_even = self.previous_e0_odd = None
        self.previous_residual_even = self.previous_residual_odd = None

    def forward(self, x, e0, blocks):
        modulated_inp = e0
        rescale_func = np.poly1d(self.coefficients)
        if self.cnt % 2 == 0:
            self.is_even = True
            if self.cnt < self.ret_steps or self.cnt >= self.cutoff_steps:
                should_calc_even = True
                self.accumulated_rel_l1_distance_even = 0
            else:
                self.accumulated_rel_l1_distance_even += rescale_func(
                    ((modulated_inp - self.previous_e0_even).abs().mean() / self.previous_e0_even.abs().mean()).cpu().item())
                if self.accumulated_rel_l1_distance_even < self.teacache_thresh:
                    should_calc_even = False
                else:
                    should_calc_even = True
                    self.accumulated_rel_l1_distance_even = 0
            self.previous_e0_even = modulated_inp.clone()
        else:
            self.is_even = False
            if self.cnt < self.ret_steps or self.cnt >= self.cutoff_steps:
                should_calc_odd = True
                self.accumulated_rel_l1_distance_odd = 0
            else:
                self.accumulated_rel_l1_distance_odd += rescale_func(
                    ((modulated_inp - self.previous_e0_odd).abs().mean() / self.previous_e0_odd.abs().mean()).cpu().item())
                if self.accumulated_rel_l1_distance_odd < self.teacache_thresh:
                    should_calc_odd = False
                else:
                    should_calc_odd = True
                    self.accumulated_rel_l1_distance_odd = 0
            self.previous_e0_odd = modulated_inp.clone()
        calc = should_calc_even if self.is_even else should_calc_odd
        if self.is_even:
            if not should_calc_even:
                x = x + self.previous_residual_even
            else:
                ori_x = x.clone()
                for block in blocks:
                    x = block(x, e0)
                self.previous_residual_even = x - ori_x
        else:
            if not should_calc_odd:
                x = x + self.previous_residual_odd
            else:
                ori_x = x.clone()
                for block in blocks:
                    x = block(x, e0)
                self.previous_residual_odd = x - ori_x
        self.cnt += 1
        if self.cnt >= self.num_steps:
            self.cnt = 0
        return x, calc


class ModBlock(nn.Module):
    def __init__(self, a: float) -> None:
        super().__init__()
        self.a = a

    def forward(self, x, e0):
        return x * self.a + torch.tanh(x) * 0.2 + e0.mean(dim=(1, 2), keepdim=True)[:, :, :1].expand_as(x) * 0.01


def e0_sequence(seed: int, steps: int, lo: float, hi: float) -> list[torch.Tensor]:
    """Modulated inputs [1, 6, D] whose successive relative L1 distances lie in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    e = torch.rand(1, 6, 16, generator=g) + 0.5
    out = []
    for _ in range(steps):
        out.append(e.clone())
        step = lo + (hi - lo) * torch.rand((), generator=g)
        e = e * (1 + step * torch.sign(torch.randn(1, 6, 16, generator=g)))
    return out


@pytest.mark.parametrize("use_ret_steps,model,thresh,lo,hi", [
    (True, "wan2.1-t2v-1.3b", 0.2, 0.01, 0.08),
    (True, "wan2.1-t2v-1.3b", 0.5, 0.01, 0.08),
    (False, "identity", 0.15, 0.0, 0.1),
])
def test_teacache_equals_reference(use_ret_steps, model, thresh, lo, hi):
    coefficients = list(IDENTITY_POLYNOMIAL if model == "identity" else TEACACHE_POLYNOMIALS[model])
    reference = TeaCacheReference(STEPS, thresh, coefficients, use_ret_steps)
    config = TeaCacheConfig(threshold=thresh, model=model, ret_steps=5 if use_ret_steps else 1,
                            cutoff_steps=0 if use_ret_steps else 1)
    profile = TeaCacheProfile(modulated_input=lambda call: call.args[0], polynomials=TEACACHE_POLYNOMIALS,
                              default=TEACACHE_DEFAULT)
    plugin = TeaCache("teacache", config, profile=profile)
    blocks = nn.ModuleList([ModBlock(0.9), ModBlock(0.8)])
    cond, uncond = plugin.new_branch_state(), plugin.new_branch_state()
    loop_state = PluginLoopState("teacache", config)
    e_c, e_u = e0_sequence(5, STEPS, lo, hi), e0_sequence(6, STEPS, lo, hi * 1.5)
    xs = hidden_inputs(7)
    decisions = []
    for t in range(STEPS):
        for state, e, x in ((cond, e_c[t], xs[t]), (uncond, e_u[t], xs[t] * 0.5)):
            want, calc = reference.forward(x, e, blocks)
            seg = BlockSegment(Segment("r", "b", t, 0, 1), state, config, STEPS, loop_state)
            got = run_blocks(blocks, x, e, interceptor=SegmentedBlockRun(plugin, [seg], None))
            assert torch.equal(got, want), f"step {t}"
            decisions.append(calc)
    assert loop_state.skipped == decisions.count(False) and 0 < loop_state.skipped < len(decisions)
