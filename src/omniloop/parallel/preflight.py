"""Pre-flight validation of a :class:`ParallelSpec`: every conflict is a ValueError that names
it and proposes a spec that would work, raised before any weight is read.

Two stages, both fail-loud (no silent fallback, design §6.3.4):

* :func:`check_deploy` — against the deployment alone (``DeployConfig`` runs it when it is
  built): a ``cfg`` axis beside a batched-CFG policy (one owner per axis: the policy stacks
  the branches in one forward, the axis puts them on two ranks), ring attention on a kernel
  without log-sum-exp, tensor parallelism over FP8 GEMMs, sp/tp inside CUDA graphs, more ranks than GPUs;
* :func:`check_model` — against the checkpoint's configs (no weights): a family without a
  parallel plan, ``sp`` on a model whose attention cannot be split, ``tp`` on a family
  without a tensor plan, heads not divisible by ``tp`` x ``ulysses``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

import torch

from omniloop.parallel.plan import ParallelPlan, parallel_plan
from omniloop.parallel.spec import ParallelSpec

# attention backends whose kernel returns no log-sum-exp, so ring attention cannot merge their partials
_NO_LSE_BACKENDS = frozenset({"triton_8bit", "cudnn_fp8"})


@dataclass(frozen=True)
class ModelFacts:
    """What the pre-flight check needs from a checkpoint, read from its configs alone."""

    family: str
    plan: ParallelPlan | None
    heads: Mapping[str, int] = field(default_factory=dict)  # attention heads per model component


def model_facts(model: str | Path) -> ModelFacts:
    from omniloop.models.loader import read_model_index, resolve_model_path
    from omniloop.models.model_spec import spec_for_class

    root = resolve_model_path(model)
    index = read_model_index(root)
    spec = spec_for_class(index["_class_name"])
    plan = parallel_plan(spec)
    return ModelFacts(family=spec.family, plan=plan, heads=plan.heads(root, index) if plan is not None else {})


# -- deployment --------------------------------------------------------------------------


def check_deploy(spec: ParallelSpec, *, cfg_mode: str, attention_backend: str, quantization: str,
                 device: torch.device, cuda_graphs: bool = False) -> None:
    if spec.world == 1:
        return
    problems = []
    if spec.cfg > 1 and cfg_mode == "batched":
        problems.append(
            f"cfg={spec.cfg} puts the CFG branches on {spec.cfg} ranks while cfg_mode='batched' stacks them in one "
            f"forward on every rank (one owner per axis): pass cfg_mode='sequential' with cfg={spec.cfg}, or keep "
            f"cfg_mode='batched' with parallel='{spec.with_degrees(cfg=1, dp=spec.dp * spec.cfg).compact()}'"
        )
    if spec.ring > 1 and attention_backend in _NO_LSE_BACKENDS:
        problems.append(
            f"ring={spec.ring} merges partial attentions by their log-sum-exp, which attention_backend="
            f"{attention_backend!r} does not return: pass attention_backend='sdpa', or "
            f"parallel='{spec.with_degrees(ulysses=spec.sp, ring=1).compact()}' (Ulysses works with any kernel)"
        )
    if spec.tp > 1 and quantization != "none":
        problems.append(
            f"tp={spec.tp} shards nn.Linear weights and quantization={quantization!r} replaces them with FP8 "
            f"GEMMs that are not sharded: pass quantization='none', or "
            f"parallel='{spec.with_degrees(tp=1, dp=spec.dp * spec.tp).compact()}'"
        )
    if cuda_graphs and (spec.sp > 1 or spec.tp > 1):
        problems.append(
            f"cuda_graphs=True replays captured forwards, and the sp/tp collectives (all-to-all, all-reduce) inside "
            f"them are not captured: pass cuda_graphs=False, or "
            f"parallel='{spec.with_degrees(ulysses=1, ring=1, tp=1, dp=spec.dp * spec.sp * spec.tp).compact()}'"
        )
    problems += _device_problems(spec, device)
    if problems:
        raise ValueError(f"parallel='{spec.compact()}': " + "; ".join(problems))


def _device_problems(spec: ParallelSpec, device: torch.device) -> list[str]:
    if device.type == "cpu":
        return []  # gloo processes: any world size runs (slowly past the core count)
    if device.type != "cuda":
        return [f"device {str(device)!r} has no process-group backend; pass device='cuda' (NCCL) or device='cpu' (gloo)"]
    if device.index is not None:
        return [f"{spec.world} ranks take cuda:0..cuda:{spec.world - 1}; pass device='cuda', not {str(device)!r} "
                "(restrict the GPUs with CUDA_VISIBLE_DEVICES)"]
    count = torch.cuda.device_count()
    if count == 0:
        return [f"the spec needs {spec.world} GPUs and no CUDA GPU is visible: pass device='cpu' (the ranks are gloo "
                "processes), or run it where the GPUs are"]
    if spec.world > count:
        fit = fit_world(spec, count)
        proposal = "parallel='dp=1' (one GPU runs without a pool)" if fit.world == 1 else f"parallel='{fit.compact()}'"
        return [f"the spec needs {spec.world} GPUs (dp x cfg x ulysses x ring x tp) and {count} are visible; pass "
                f"degrees whose product is at most {count}, e.g. {proposal}"]
    return []


def fit_world(spec: ParallelSpec, ranks: int) -> ParallelSpec:
    """``spec`` with its degrees shrunk until it needs at most ``ranks`` ranks: each axis in
    turn (dp, cfg, ring, tp, ulysses: the last ones split the most work) loses prime factors."""
    d = {a: getattr(spec, a) for a in ("dp", "cfg", "ring", "tp", "ulysses")}
    for axis in d:
        while math.prod(d.values()) > ranks and d[axis] > 1:
            d[axis] //= _smallest_factor(d[axis])
    return spec.with_degrees(**d)


def _smallest_factor(n: int) -> int:
    return next(f for f in range(2, n + 1) if n % f == 0)


# -- model ---------------------------------------------------------------------------------


def check_model(spec: ParallelSpec, facts: ModelFacts) -> None:
    """Raise ValueError naming every conflict of ``spec`` with the model, with a spec that works."""
    problems = model_problems(spec, facts)
    if problems:
        fix = propose(spec, facts)
        assert not model_problems(fix, facts), f"proposal {fix.compact()} still conflicts: {model_problems(fix, facts)}"
        raise ValueError(f"parallel='{spec.compact()}' cannot run {facts.family!r}: " + "; ".join(problems)
                         + f". A spec that works for this model: parallel='{fix.compact()}'")


def model_problems(spec: ParallelSpec, facts: ModelFacts) -> list[str]:
    plan, family = facts.plan, facts.family
    if spec.world == 1:
        return []
    if plan is None:
        return [f"family {family!r} declares no parallel plan (ModelSpec.extras['parallel']), so it runs on one rank"]
    problems = []
    why = plan.why_not
    if spec.sp > 1 and plan.sequence is None:
        problems.append(f"sp={spec.sp}: " + why.get("sp", f"the attention of {family!r} cannot be split over the "
                                                          "sequence (no sequence plan)"))
    if spec.tp > 1 and plan.tensor is None:
        problems.append(f"tp={spec.tp}: " + why.get("tp", f"{family!r} has no tensor-parallel plan"))
    if spec.ring > 1 and plan.sequence is not None and not plan.sequence.ring:
        problems.append(f"ring={spec.ring}: the sequence of {family!r} packs samples end to end, and a ring block "
                        f"would cut through them (its attention is per sample); split it with ulysses instead")
    if spec.rows > 1 and not plan.rows:
        problems.append(f"dp x cfg = {spec.rows}: " + why.get("rows", f"the loops of {family!r} do not split a "
                                                                      "step's forwards across ranks"))
    elif spec.cfg > 1 and not plan.cfg:
        problems.append(f"cfg={spec.cfg}: " + why.get("cfg", f"the loops of {family!r} run one guidance branch per "
                                                            "step (no second forward to put on another rank); dp "
                                                            "splits its batched steps across ranks"))
    if spec.vae == "tiles" and plan.vae is None:
        problems.append("vae='tiles': " + why.get("vae", f"{family!r} has no tiled VAE decode to spread across ranks"))
    for component, heads in facts.heads.items():
        if spec.tp > 1 and plan.tensor is not None and heads % spec.tp:
            problems.append(f"tp={spec.tp} does not divide the {heads} attention heads of {component!r}")
        elif spec.ulysses > 1 and plan.sequence is not None and (heads // spec.tp) % spec.ulysses:
            local = f"{heads // spec.tp} heads per tp rank" if spec.tp > 1 else f"{heads} attention heads"
            problems.append(f"ulysses={spec.ulysses} does not divide the {local} of {component!r} "
                            f"(Ulysses gives each rank whole heads)")
    return problems


def propose(spec: ParallelSpec, facts: ModelFacts) -> ParallelSpec:
    """A spec of the same world size that runs this model: unsupported axes fold into dp
    (or into one rank), tp and ulysses shrink to divisors of the heads (dp and ring absorb
    the remaining factors)."""
    plan = facts.plan
    if plan is None:
        return ParallelSpec()
    d = {a: getattr(spec, a) for a in ("dp", "cfg", "ulysses", "ring", "tp")}
    if plan.sequence is None:
        d["dp"], d["ulysses"], d["ring"] = d["dp"] * d["ulysses"] * d["ring"], 1, 1
    no_ring = plan.sequence is not None and not plan.sequence.ring
    if no_ring:
        d["dp"], d["ring"] = d["dp"] * d["ring"], 1
    if not plan.cfg:
        d["dp"], d["cfg"] = d["dp"] * d["cfg"], 1
    if plan.tensor is None:
        d["dp"], d["tp"] = d["dp"] * d["tp"], 1
    heads = math.gcd(*facts.heads.values()) if facts.heads else 0
    if heads:
        tp = math.gcd(d["tp"], heads)
        d["dp"], d["tp"] = d["dp"] * d["tp"] // tp, tp
        ulysses = math.gcd(d["ulysses"], heads // tp)
        spill = "dp" if no_ring else "ring"  # the ulysses factors the heads do not take
        d[spill], d["ulysses"] = d[spill] * d["ulysses"] // ulysses, ulysses
    vae = spec.vae if plan.vae is not None else "replicate"
    fixed = spec.model_copy(update={"vae": vae})
    if not plan.rows and d["dp"] * d["cfg"] > 1:
        return ParallelSpec()  # nothing left to run these ranks on
    return fixed.with_degrees(**d)
