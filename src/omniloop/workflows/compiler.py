"""Workflow -> ``OmniRequest``s: the sampler chains the output nodes depend on, read as
generation calls on the served models, built by the project's one request builder.

A chain is one of:

- one sampler (``KSampler``, or ``SamplerCustomAdvanced`` with its noise, guider, sampler
  and sigmas nodes) -> one denoise loop;
- two ``KSamplerAdvanced`` splitting one schedule (``end_at_step`` = ``start_at_step``) over
  a high-noise and a low-noise model -> a two-expert model's one loop (``guidance_scale`` and
  ``guidance_scale_2``);
- a sampler, ``LTXVLatentUpsampler``, a second sampler on the upsampled latents -> the
  two-stage path (``node_params`` ``upsample`` and ``refine``).

Output nodes fed by one chain share its request; each chain is one request.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from omniloop.request import Fields, ImagePart, LoraRef, Modality, OmniRequest, OutputSpec, TaskType, build_request
from omniloop.request.builder import FieldError
from omniloop.workflows.control_render import control_part
from omniloop.workflows.errors import node_error
from omniloop.workflows.evaluate import Deviation, Evaluation
from omniloop.workflows.graph import Graph, GraphNode, load_workflow
from omniloop.workflows.model_folder import ModelFolder, ServedCheckpoint
from omniloop.workflows.schedules import SCHEDULES, flow_schedule, ksampler_sigmas
from omniloop.workflows.style_models import REDUX_NODE, style_parts
from omniloop.workflows.values import AudioOut, GeneratedText, Latent, Pixels, Preview, SaveTarget, Sampling, VideoOut
from omniloop.workflows.ltx_guides import guide_parts
from omniloop.workflows.video_nodes import vace_parts

# ComfyUI sampler -> ours; the named schedules we run (ComfyUI's own under ModelSamplingSD3)
SUPPORTED_SAMPLERS: Mapping[str, str] = {"euler": "flow_euler", "uni_pc": "comfy_uni_pc",
                                         "uni_pc_bh2": "comfy_uni_pc_bh2", "euler_ancestral": "comfy_euler_ancestral",
                                         "dpmpp_2m": "comfy_dpmpp_2m", "dpmpp_2m_sde": "comfy_dpmpp_2m_sde",
                                         "dpmpp_2m_sde_gpu": "comfy_dpmpp_2m_sde_gpu",
                                         "dpmpp_2m_sde_heun": "comfy_dpmpp_2m_sde_heun",
                                         "dpmpp_2m_sde_heun_gpu": "comfy_dpmpp_2m_sde_heun_gpu",
                                         "res_multistep": "comfy_res_multistep",
                                         "res_multistep_ancestral": "comfy_res_multistep_ancestral",
                                         "dpmpp_sde": "comfy_dpmpp_sde", "dpmpp_sde_gpu": "comfy_dpmpp_sde_gpu",
                                         "dpmpp_3m_sde": "comfy_dpmpp_3m_sde",
                                         "dpmpp_3m_sde_gpu": "comfy_dpmpp_3m_sde_gpu"}
# on a v-prediction EDM-sigma model (Stable Audio): ComfyUI sampler -> ours (pipeline/samplers/comfy_v_prediction.py)
# and the schedulers they run (the denoise loop's ``scheduler`` knob)
COMFY_V_SAMPLERS: Mapping[str, str] = {"euler": "comfy_v_euler", "dpmpp_2m": "comfy_v_dpmpp_2m",
                                       "dpmpp_2m_sde": "comfy_v_dpmpp_2m_sde",
                                       "dpmpp_2m_sde_gpu": "comfy_v_dpmpp_2m_sde_gpu",
                                       "dpmpp_3m_sde": "comfy_v_dpmpp_3m_sde",
                                       "dpmpp_3m_sde_gpu": "comfy_v_dpmpp_3m_sde_gpu"}
V_SCHEDULERS = ("simple", "normal", "sgm_uniform", "karras", "exponential")
# samplers that keep history or draw noise from a generator: ComfyUI restarts them at each sampler node
RESTARTING_SAMPLERS = frozenset(set(SUPPORTED_SAMPLERS) - {"euler"})
# a sampler node's knobs (SamplerEulerAncestral's, SamplerDPMPP_2M_SDE's) -> the denoise loop's node
# params, with ComfyUI's defaults; the samplers that take them
SAMPLER_OPTION_DEFAULTS: Mapping[str, float] = {"eta": 1.0, "s_noise": 1.0}
OPTION_SAMPLERS = frozenset({"euler_ancestral", "dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun",
                             "dpmpp_2m_sde_heun_gpu", "res_multistep_ancestral", "dpmpp_sde", "dpmpp_sde_gpu",
                             "dpmpp_3m_sde", "dpmpp_3m_sde_gpu"})
# two model evaluations a step: no start from given latents mid-schedule
TWO_EVALUATION_SAMPLERS = frozenset({"dpmpp_sde", "dpmpp_sde_gpu"})
# the samplers that start a schedule at sigma 1 at the model sampling's percent_to_sigma(1e-4)
SNR_OFFSET_SAMPLERS = frozenset({"dpmpp_2m_sde", "dpmpp_2m_sde_gpu", "dpmpp_2m_sde_heun", "dpmpp_2m_sde_heun_gpu",
                                 "dpmpp_sde", "dpmpp_sde_gpu", "dpmpp_3m_sde", "dpmpp_3m_sde_gpu"})
# the sampler nodes whose schedule is KSampler's (calculate_sigmas, with its penultimate-sigma rule)
KSAMPLER_NODES = frozenset({"KSampler", "KSamplerAdvanced"})
SUPPORTED_SCHEDULERS = SCHEDULES
# the schedulers computed over ModelSamplingSD3's training sigmas only (another model's own schedule runs)
SD3_ONLY_SCHEDULERS = frozenset(SCHEDULES[4:])
# the second stage's sigmas of the distilled two-stage recipe (the refine node's own)
REFINE_SIGMAS = (0.909375, 0.725, 0.421875)
SEED_LIMIT = 2**63
DENOISE_NODE = "denoise"  # the graph's denoise loop node (every denoise family names it so)
# the CLIP image-encode node of an image-to-video graph with an image encoder (its knob
# clip_last_frame=false: the first frame's tokens only, as WanFunInpaintToVideo conditions)
IMAGE_ENCODE_NODE = "image_encode"
ENHANCE_NODE = "enhance_prompt"  # LTX-2: the prompt rewritten by its text encoder (TextGenerateLTX2Prompt)


@dataclass(frozen=True)
class Generation:
    """One request of a compiled workflow and the output nodes that save its results."""

    request: OmniRequest
    served: ServedCheckpoint
    saves: tuple[SaveTarget, ...]
    sampler_nodes: tuple[str, ...]  # the sampler nodes it runs (progress is theirs)


@dataclass(frozen=True)
class CompiledWorkflow:
    graph: Graph
    generations: tuple[Generation, ...]
    deviations: tuple[Deviation, ...]
    evaluated: tuple[str, ...]  # node ids the outputs depend on (ComfyUI executes these)
    previews: tuple[Preview, ...] = ()  # PreviewAny: the values displayed, nothing saved


def compile_workflow(source: str | bytes | Mapping[str, Any] | Graph, models: ModelFolder, *,
                     input_dir: Path | None = None, exact: bool = False) -> CompiledWorkflow:
    """Compile a workflow (API or UI format; JSON text or parsed) against ``models``.
    ``exact``: refuse what would run differently from ComfyUI instead of reporting it.
    Raises ``WorkflowError`` (ComfyUI's ``node_errors`` shape) for anything we cannot run."""
    graph: Graph = load_workflow(source) if isinstance(source, (str, bytes)) or not _is_graph(source) \
        else dict(source)
    ev = Evaluation(graph, models, input_dir, exact)
    ev.run()
    chains: dict[str, list[SaveTarget]] = {}
    finals: dict[str, Latent] = {}
    for save in ev.saves:
        latent = _latent_of(save)
        if latent is None or latent.sampled is None:
            raise node_error(save.node, save.class_type, "invalid_input_type", "saves nothing a sampler made",
                             "connect it to the decoded output of a KSampler / SamplerCustomAdvanced")
        key = latent.sampled.node
        chains.setdefault(key, []).append(save)
        finals.setdefault(key, latent)
    generations = []
    for key, saves in chains.items():
        generations.append(_generation(ev, finals[key], tuple(saves)))
    for preview in ev.previews:
        if isinstance(preview.value, GeneratedText) and not any(g.request.node_params.get(ENHANCE_NODE) is not None
                                                                for g in generations):
            _deviate(ev, preview.node, f"it shows the text node {preview.value.node} would generate, but no prompt "
                     "uses that text, so it is not generated here: the prompt as written is shown")
    return CompiledWorkflow(graph, tuple(generations), tuple(ev.deviations), tuple(ev.values), tuple(ev.previews))


def _is_graph(source: Any) -> bool:
    return isinstance(source, dict) and bool(source) and all(isinstance(v, GraphNode) for v in source.values())


def _latent_of(save: SaveTarget) -> Latent | None:
    media = save.media
    if isinstance(media, VideoOut):
        media = media.images
    if isinstance(media, AudioOut):
        return media.latent
    if isinstance(media, Pixels):
        return media.latent
    return None


def _modalities(saves: tuple[SaveTarget, ...], kind: str) -> list[Modality]:
    wanted: list[Modality] = []
    for save in saves:
        media = save.media
        if isinstance(media, VideoOut):
            wanted += [Modality.VIDEO] + ([Modality.AUDIO] if media.audio is not None else [])
        elif isinstance(media, AudioOut):
            wanted.append(Modality.AUDIO)
        else:
            wanted.append(Modality.IMAGE if kind == "image" else Modality.VIDEO)
    return list(dict.fromkeys(wanted))


# -- one chain -> one request ----------------------------------------------------------------
def _generation(ev: Evaluation, final: Latent, saves: tuple[SaveTarget, ...]) -> Generation:
    last = final.sampled
    assert last is not None, "a chain ends in a sampled latent"
    node_params: dict[str, dict[str, Any]] = {}
    fields = Fields()
    runs: tuple[Sampling, ...]
    if last.start.upsampled_from is not None:  # base -> upsample -> refine
        base = last.start.upsampled_from.sampled
        assert base is not None, "the upsampler checks its input was sampled"
        _refine(ev, base, last, node_params)
        runs = (base, last)
        first = base
    elif last.start.sampled is not None:  # one schedule split over two models
        first = last.start.sampled
        _split(ev, first, last, fields, node_params)
        runs = (first, last)
    else:
        first = last
        runs = (last,)
    served = _served(ev, runs)
    canvas = first.start
    task = _task(ev, first, canvas, saves)
    vace = (vace_parts(ev, first, canvas, final, node_params, DENOISE_NODE, lambda n, m: _deviate(ev, n, m))
            if first.positive.vace is not None else [])
    if "refine" in node_params and task == TaskType.I2V:
        _deviate(ev, last.node, "the two-stage path (upsample + refine) runs text-to-video only: this image-to-video "
                 "runs the base stage alone, at the base size")
        node_params.clear()
        runs = (first,)
    prompt = _prompt(ev, first)
    _enhance(ev, first, node_params)
    _guidance(ev, first, served, fields)
    # the joint audio-video latent and the two-stage path run the model's own sampler beside euler
    # (ComfyUI's samplers there step a nested latent and a second sampler node we do not mirror)
    comfy_path = canvas.kind != "av" and "refine" not in node_params
    if canvas.kind == "audio":  # an audio latent's model (Stable Audio): v-prediction over EDM sigmas
        _v_schedule(ev, first, fields, node_params)
    else:
        _schedule(ev, first, fields, comfy_samplers=comfy_path)
        _sampler_options(ev, first, fields, node_params)
    if canvas.noise_mask:  # SetLatentNoiseMask / InpaintModelConditioning(noise_mask=true)
        node_params.setdefault(DENOISE_NODE, {})["noise_mask"] = "comfy"
    if first.model.cfg_zero_star and comfy_path:
        node_params.setdefault(DENOISE_NODE, {})["cfg_zero_star"] = True
    elif first.model.cfg_zero_star:
        _deviate(ev, first.node, "CFGZeroStar is not applied on a joint audio-video latent or the two-stage path "
                 "(the model's own guidance runs)")
    if first.model.reference_kv is not None:
        _reference_kv(ev, first, first.model.reference_kv, node_params)
    _geometry(ev, first, canvas, saves, fields, task)
    fields.put("seed", _seed(ev, first))
    loras = _loras(ev, runs)
    if loras:
        fields.put("loras", loras)
    parts = vace or _parts(ev, first, canvas) + guide_parts(canvas)  # LTXVAddGuide: keyframe images
    styles, redux = style_parts(first, served, ev.loaded, task)  # StyleModelApply: FLUX.1 Redux references
    parts += styles
    if redux is not None:
        node_params[REDUX_NODE] = redux
    _clip_vision(ev, first, served, task, node_params)
    if task == TaskType.I2I and first.positive.reference is None:  # a reference edit starts from noise
        fields.put("strength", first.denoise)
    outputs = OutputSpec(modalities=_modalities(saves, canvas.kind))
    try:
        request = build_request(task, prompt, fields, parts=parts, outputs=outputs, node_params=node_params,
                                model=served.name)
    except FieldError as e:
        raise node_error(first.node, _class(ev, first.node), "invalid_input_type", e.message,
                         f"request field {e.field}") from None
    return Generation(request, served, saves, tuple(r.node for r in runs))


def _reference_kv(ev: Evaluation, run: Sampling, patch: str, node_params: dict[str, dict[str, Any]]) -> None:
    """A reference KV-cache patch (node ``patch``, FluxKVCache): the loop caches the references'
    keys/values (its ``reference_kv`` knob; a model without the cache refuses it at admission)."""
    node_params.setdefault(DENOISE_NODE, {})["reference_kv"] = True
    if run.positive.reference is not None:
        _deviate(ev, patch, "the references' keys/values are computed once with the references attending only to "
                 "each other (diffusers' KV pipeline, as the KV model was trained); ComfyUI keeps those of its "
                 "first step, where they also attend to the text and the noisy image")


def _class(ev: Evaluation, node_id: str) -> str:
    return ev.graph[node_id].class_type


def _deviate(ev: Evaluation, node_id: str, message: str) -> None:
    if ev.exact:
        raise node_error(node_id, _class(ev, node_id), "exact_compile_refused", message,
                         "compile without exact to run it as described")
    ev.deviations.append(Deviation(node_id, _class(ev, node_id), message))


def _served(ev: Evaluation, runs: tuple[Sampling, ...]) -> ServedCheckpoint:
    served = [ev.loaded[r.model.loader] for r in runs]
    if any(s.name != served[0].name for s in served):
        names = {r.model.name: ev.loaded[r.model.loader].name for r in runs}
        raise node_error(runs[-1].node, _class(ev, runs[-1].node), "invalid_input_type", "the sampler chain's "
                         f"models are different checkpoints ({names}); one chain runs on one served model")
    return served[0]


def _task(ev: Evaluation, first: Sampling, canvas: Latent, saves: tuple[SaveTarget, ...]) -> TaskType:
    if canvas.kind == "image":
        if first.positive.reference is not None:  # an edit model's reference (ReferenceLatent): FLUX.1 Kontext
            return TaskType.I2I
        inpaint = canvas.mask is not None  # an inpainting model's image + mask: i2i at any denoise
        return TaskType.I2I if canvas.encoded is not None and (first.denoise < 1 or inpaint) else TaskType.T2I
    if canvas.kind == "audio":
        return TaskType.T2A
    if first.positive.vace is not None:  # WanVaceToVideo: control video -> v2v
        return TaskType.V2V if first.positive.vace.video is not None else TaskType.T2V
    if canvas.image is not None or first.positive.image is not None or canvas.guides:
        return TaskType.I2V  # (a last frame needs a first one: WanFirstLastFrameToVideo checks)
    if canvas.kind == "av" and Modality.AUDIO in _modalities(saves, canvas.kind):
        return TaskType.T2VS
    return TaskType.T2V


def _prompt(ev: Evaluation, run: Sampling) -> str:
    text = run.positive.text
    if not text or not text.strip():
        raise node_error(run.node, _class(ev, run.node), "required_input_missing", "positive: the prompt is empty",
                         "write a prompt in the positive text encoder", "positive")
    return text


def _enhance(ev: Evaluation, run: Sampling, node_params: dict[str, dict[str, Any]]) -> None:
    """TextGenerateLTX2Prompt on the positive prompt: the LTX-2 pipeline's ``enhance_prompt`` node
    rewrites it before encoding (another model's admission refuses the node, naming it)."""
    if run.negative is not None and run.negative.enhance is not None:
        generated = run.negative.enhance
        raise node_error(generated.node, _class(ev, generated.node), "invalid_input_type", "generated text feeds "
                         "the negative prompt; only the positive prompt can be enhanced",
                         "connect it to the positive CLIPTextEncode", "prompt")
    if run.positive.enhance is not None:
        for message in run.positive.enhance.deviations:
            _deviate(ev, run.positive.enhance.node, message)
        node_params[ENHANCE_NODE] = dict(run.positive.enhance.params)


def _guidance(ev: Evaluation, run: Sampling, served: ServedCheckpoint, fields: Fields) -> None:
    """cfg -> guidance_scale; on a guidance-distilled model its embedded guidance instead."""
    negative = run.negative.text if run.negative is not None else None
    if served.embedded_guidance or (served.guidance_unknown and run.positive.guidance is not None):
        if run.cfg != 1.0:
            _deviate(ev, run.node, f"cfg={run.cfg} on a guidance-distilled model: it runs with its embedded guidance "
                     "only (cfg 1)")
        if run.positive.guidance is not None:
            fields.put("guidance_scale", run.positive.guidance, "FluxGuidance.guidance")
        return
    if run.positive.guidance is not None:
        _deviate(ev, run.node, "an embedded guidance (FluxGuidance) on a model without one is ignored")
    if "guidance_scale" not in fields:
        fields.put("guidance_scale", run.cfg, "cfg")
    if run.cfg > 1.0 and negative:
        fields.put("negative_prompt", negative)


def _sampler(ev: Evaluation, run: Sampling, comfy_samplers: bool) -> str | None:
    supported = SUPPORTED_SAMPLERS if comfy_samplers else {"euler": SUPPORTED_SAMPLERS["euler"]}
    ours = supported.get(run.sampler_name)
    if ours is not None and run.sampler_name in TWO_EVALUATION_SAMPLERS and run.denoise < 1.0:
        _deviate(ev, run.node, f"sampler_name={run.sampler_name!r} does not start mid-schedule here (denoise="
                 f"{run.denoise}: its two evaluations a step); the model's own sampler runs")
        return None
    if ours is None:
        where = "" if comfy_samplers else " on a joint audio-video latent or the two-stage path"
        message = (f"sampler_name={run.sampler_name!r} is not supported{where} (supported: {sorted(supported)}); "
                   "the model's own sampler runs")
        _deviate(ev, run.node, message)
    return ours


def _sampler_options(ev: Evaluation, run: Sampling, fields: Fields, node_params: dict[str, dict[str, Any]]) -> None:
    """A sampler node's eta / s_noise (``SamplerEulerAncestral``, ``SamplerDPMPP_2M_SDE``): the
    denoise loop's knobs where not ComfyUI's defaults (when its sampler runs; otherwise the
    sampler's deviation was reported). The SDE samplers also take the ModelSamplingSD3 shift the
    sigmas were made with (their first sigma below 1 is that model sampling's)."""
    if run.sampler_name not in OPTION_SAMPLERS or fields.get("sampler") != SUPPORTED_SAMPLERS[run.sampler_name]:
        return
    for name, value in run.sampler_options:
        if value != SAMPLER_OPTION_DEFAULTS[name]:
            node_params.setdefault(DENOISE_NODE, {})[name] = value
    if run.sampler_name in SNR_OFFSET_SAMPLERS and run.model.shift is not None and fields.get("shift") == 1.0 \
            and run.model.shift != 1.0:
        node_params.setdefault(DENOISE_NODE, {})["model_shift"] = run.model.shift


def _schedule(ev: Evaluation, run: Sampling, fields: Fields, *, comfy_samplers: bool = True) -> None:
    """Steps or sigmas, sampler, shift. Under ``ModelSamplingSD3`` (a flow model with a static
    shift) a named schedule is ComfyUI's own (``schedules.py``): its shifted sigmas, shift 1.
    ``comfy_samplers``: ComfyUI's own samplers run (else euler only)."""
    sampler = _sampler(ev, run, comfy_samplers)
    if run.scheduler is not None and run.scheduler != "ltxv" and run.scheduler not in SUPPORTED_SCHEDULERS:
        _deviate(ev, run.node, f"scheduler={run.scheduler!r} is not supported (supported: {list(SUPPORTED_SCHEDULERS)}"
                 "); the model's own schedule runs")
    elif run.scheduler in SD3_ONLY_SCHEDULERS and run.model.shift is None and run.sigmas is None:
        _deviate(ev, run.node, f"scheduler={run.scheduler!r} runs under ModelSamplingSD3 only (without it: "
                 f"{list(SUPPORTED_SCHEDULERS[:4])}); the model's own schedule runs")
    if sampler is not None:
        fields.put("sampler", sampler)
    if run.sigmas is not None:
        fields.put("sigmas", list(run.sigmas))
    elif run.scheduler == "kl_optimal" and run.steps < 2:
        _deviate(ev, run.node, "scheduler='kl_optimal' at 1 step has no schedule (ComfyUI's divides by steps - 1: "
                 "NaN sigmas); the model's own schedule runs")
        fields.put("steps", run.steps)
    elif run.model.shift is not None and run.scheduler in SCHEDULES and run.denoise >= 1.0:
        sigmas = flow_schedule(run.scheduler, run.steps, run.model.shift)
        if _class(ev, run.node) in KSAMPLER_NODES:
            ksampler = ksampler_sigmas(run.scheduler, run.steps, run.model.shift, run.sampler_name)
            if all(a > b for a, b in zip(ksampler, ksampler[1:])):
                sigmas = ksampler
            else:  # more steps than training sigmas: ComfyUI's extra step repeats one (h = 0)
                _deviate(ev, run.node, f"KSampler's {run.sampler_name} schedule at {run.steps} steps repeats a sigma; "
                         "the schedule without its extra step runs")
        fields.put("sigmas", sigmas[:-1])  # (the final 0 is implied)
        fields.put("shift", 1.0, "ModelSamplingSD3.shift")  # the sigmas are shifted already
        return
    else:
        fields.put("steps", run.steps)
    if run.model.shift is not None:
        fields.put("shift", run.model.shift, "ModelSamplingSD3.shift")
    if run.denoise < 1.0 and run.start.encoded is None:
        _deviate(ev, run.node, f"denoise={run.denoise} from an empty latent: the whole schedule runs")


def _v_schedule(ev: Evaluation, run: Sampling, fields: Fields, node_params: dict[str, dict[str, Any]]) -> None:
    """Sampler, scheduler and steps on a v-prediction EDM-sigma model (Stable Audio): ComfyUI's
    sampler of the name on its model sampling's sigmas (``comfy_v_*``, the scheduler a knob of the
    denoise loop), or, for one we do not run, the model's own sampler and schedule (a deviation)."""
    fields.put("steps", run.steps)
    if run.denoise < 1.0 and run.start.encoded is None:
        _deviate(ev, run.node, f"denoise={run.denoise} from an empty latent: the whole schedule runs")
    sampler = COMFY_V_SAMPLERS.get(run.sampler_name)
    if sampler is None:
        _deviate(ev, run.node, f"sampler_name={run.sampler_name!r} is not supported on this v-prediction model "
                 f"(supported: {sorted(COMFY_V_SAMPLERS)}); the model's own sampler runs")
        return
    if run.sigmas is not None or run.scheduler not in V_SCHEDULERS:
        given = "custom sigmas" if run.sigmas is not None else f"scheduler={run.scheduler!r}"
        _deviate(ev, run.node, f"{given} is not supported on this v-prediction model (supported schedulers: "
                 f"{list(V_SCHEDULERS)}); the model's own sampler and schedule run")
        return
    fields.put("sampler", sampler)
    params = node_params.setdefault(DENOISE_NODE, {})
    params["scheduler"] = run.scheduler
    if run.sampler_name in OPTION_SAMPLERS:
        for name, value in run.sampler_options:
            if value != SAMPLER_OPTION_DEFAULTS[name]:
                params[name] = value


def _geometry(ev: Evaluation, run: Sampling, canvas: Latent, saves: tuple[SaveTarget, ...], fields: Fields,
              task: TaskType) -> None:
    if canvas.batch != 1:
        _deviate(ev, run.node, f"batch_size={canvas.batch}: one result is made per prompt (queue it again for more)")
    if canvas.kind == "audio":
        if canvas.seconds is not None:
            fields.put("duration_s", canvas.seconds, "seconds")
        return
    if task == TaskType.I2I and run.positive.reference is None:
        return  # the image's size
    fields.put("width", canvas.width)
    fields.put("height", canvas.height)
    if canvas.kind in ("video", "av"):
        fields.put("num_frames", canvas.frames, "length")
        rate = run.positive.frame_rate
        fps = next((s.media.fps for s in saves if isinstance(s.media, VideoOut)), None)
        if rate is not None and fps is not None and rate != fps:
            _deviate(ev, run.node, f"frame_rate={rate} conditions the model but the video is saved at {fps} fps")
        chosen = rate if rate is not None else fps
        if chosen is not None:
            if float(chosen) != int(chosen):
                _deviate(ev, run.node, f"fps={chosen}: rounded to {round(chosen)}")
            fields.put("fps", int(round(chosen)), "fps")


def _seed(ev: Evaluation, run: Sampling) -> int:
    if run.seed is None:
        raise node_error(run.node, _class(ev, run.node), "invalid_input_type", "the first sampler adds no noise "
                         "(add_noise=disable / DisableNoise)", "enable its noise")
    if run.seed >= SEED_LIMIT:
        _deviate(ev, run.node, f"seed={run.seed} is above 2**63; seed {run.seed % SEED_LIMIT} runs")
    return run.seed % SEED_LIMIT


def _loras(ev: Evaluation, runs: tuple[Sampling, ...]) -> list[LoraRef]:
    loras = list(runs[0].model.loras)
    for run in runs[1:]:
        if list(run.model.loras) != loras:
            if len(runs) == 2 and runs[1].start.upsampled_from is not None:
                _deviate(ev, run.node, f"LoRAs of the refine stage ({[l.name for l in run.model.loras]}) differ from "
                         "the base stage's: the refine stage runs the base stage's")
            else:
                raise node_error(run.node, _class(ev, run.node), "invalid_input_type", "the two samplers' models "
                                 "carry different LoRAs; per-expert LoRAs are not supported",
                                 "apply the same LoRAs to both, or none")
    return loras


def _parts(ev: Evaluation, run: Sampling, canvas: Latent) -> list[ImagePart]:
    if run.positive.control is not None:  # InstructPixToPixConditioning: a FLUX.1 Canny/Depth model's control image
        return [control_part(run.positive.control, canvas.width, canvas.height)]
    reference = run.positive.reference
    if reference is not None:
        # chained ReferenceLatents: every image a reference, in order (the served model's admission
        # refuses more than it takes)
        references = [(reference, run.positive.reference_node), *run.positive.more_references]
        for pixels, node_id in references:
            if pixels.source != "file" or pixels.path is None:
                raise node_error(node_id, "ReferenceLatent", "invalid_input_type", "latent: the reference must be "
                                 "the VAEEncode of a LoadImage", "connect a LoadImage (resizes are applied by the "
                                 "model)", "latent")
        if run.denoise < 1.0:
            _deviate(ev, run.node, f"denoise={run.denoise} with a reference edit: the whole schedule runs from noise")
        return [ImagePart(path=pixels.path, role="reference") for pixels, _ in references]
    image = canvas.image or run.positive.image or canvas.encoded
    if image is None:
        return []
    if image.source != "file" or image.path is None:
        raise node_error(run.node, _class(ev, run.node), "invalid_input_type", "the conditioning image must come "
                         "from LoadImage", "connect a LoadImage (resizes are applied by the model)")
    parts = [_padded(image) if image.pad is not None else ImagePart(path=image.path, role="first_frame")]
    if canvas.mask is not None:
        mask, soft = _mask_part(canvas.mask.image)
        if canvas.noise_mask and run.model.differential_diffusion:  # (bilinear to latents: soft at any edge)
            _deviate(ev, run.node, "DifferentialDiffusion: the noise mask is not thresholded per step; the kept "
                     "area is blended by the mask's own (soft) values each step")
        if soft and canvas.mask_to_model:
            _deviate(ev, run.node, "the mask's alpha has values between 0 and 255: the model reads it binarized at "
                     "0.5 (diffusers' Fill pipeline); ComfyUI feeds the soft values")
        parts.append(mask)
    frames = run.positive.frames
    if frames is not None and frames.end is not None:
        end = frames.end
        if end.source != "file" or end.path is None:
            raise node_error(frames.node, frames.class_type, "invalid_input_type", "end_image: the last frame must "
                             "come from LoadImage", "connect a LoadImage (resizes are applied by the model)",
                             "end_image")
        parts.append(ImagePart(path=end.path, role="last_frame"))
    return parts


def _png_part(array: Any, role: Literal["first_frame", "mask"]) -> ImagePart:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return ImagePart(b64=base64.b64encode(buf.getvalue()).decode(), role=role)


def _padded(image: Pixels) -> ImagePart:
    """ImagePadForOutpaint's canvas: the file on mid gray (ComfyUI's 0.5; 128 in a PNG, only
    ever under the mask, so the model never reads it at the default strength 1)."""
    import numpy as np
    from PIL import Image

    assert image.path is not None and image.pad is not None, "a padded LoadImage"
    if not Path(image.path).is_file():  # compiled without an input folder: a stand-in
        return ImagePart(path=image.path, role="first_frame")
    p = image.pad
    with Image.open(image.path) as pil:
        rgb = np.asarray(pil.convert("RGB"))
    h, w = rgb.shape[:2]
    canvas = np.full((h + p.top + p.bottom, w + p.left + p.right, 3), 128, dtype=np.uint8)
    canvas[p.top:p.top + h, p.left:p.left + w] = rgb
    return _png_part(canvas, "first_frame")


def _pad_mask(image: Pixels) -> tuple[ImagePart, bool]:
    """ImagePadForOutpaint's mask (``image_ops.outpaint_mask``: 1 on the margins, fading into
    the image within ``feathering`` of a padded edge), as the white-is-repaint image."""
    import numpy as np

    from omniloop.workflows.image_ops import outpaint_mask

    assert image.pad is not None and image.width is not None and image.height is not None, "a padded image"
    p = image.pad
    mask = outpaint_mask(image.height - p.top - p.bottom, image.width - p.left - p.right, p)[0].double().numpy()
    soft = bool(((mask > 0) & (mask < 1)).any())
    return _png_part(np.round(mask * 255).astype(np.uint8), "mask"), soft


def _mask_part(image: Pixels) -> tuple[ImagePart, bool]:
    """LoadImage's mask (1 - alpha) as the white-is-repaint image an inpainting model reads:
    value 255 - alpha (its binarization at 0.5 is ComfyUI's round of 1 - alpha/255), and
    whether the alpha is soft (values other than 0 and 255)."""
    import io

    import numpy as np
    from PIL import Image

    assert image.path is not None, "InpaintModelConditioning checks the mask comes from LoadImage"
    if image.pad is not None:
        return _pad_mask(image)
    if not Path(image.path).is_file():  # compiled without an input folder: a stand-in
        return ImagePart(path=image.path, role="mask"), False
    with Image.open(image.path) as pil:
        alpha = np.asarray(pil.convert("RGBA"))[..., 3]
    buf = io.BytesIO()
    Image.fromarray((255 - alpha).astype(np.uint8), mode="L").save(buf, format="PNG")
    soft = bool(((alpha != 0) & (alpha != 255)).any())
    return ImagePart(b64=base64.b64encode(buf.getvalue()).decode(), role="mask"), soft


def _image_encoder(served: ServedCheckpoint) -> bool | None:
    """Whether the served checkpoint has an image encoder (a CLIP vision tower): its
    diffusers folder's model_index.json says; None where the compile cannot tell (single
    files: their loader checks the DiT against the CLIPVisionLoader file; names-only folders)."""
    if served.path is None or not (served.path / "model_index.json").is_file():
        return None
    entry = json.loads((served.path / "model_index.json").read_text()).get("image_encoder")
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def _clip_vision(ev: Evaluation, run: Sampling, served: ServedCheckpoint, task: TaskType,
                 node_params: dict[str, dict[str, Any]]) -> None:
    """The CLIP vision outputs a Wan image-to-video node attaches: the served model's own image
    encoder encodes the request's first (and last) frame, so they must be of those frames, and
    the model must have one (and a model that has one needs them)."""
    frames = run.positive.frames
    if frames is None or task != TaskType.I2V:
        return
    wired = frames.clip_start is not None
    has_encoder = _image_encoder(served)
    if wired and has_encoder is False:
        raise node_error(frames.node, frames.class_type, "invalid_input_type", f"{frames.clip_start_input}: the "
                         f"model {served.name!r} has no image encoder to take CLIP vision conditioning; disconnect it, "
                         "or load a model with one (its folder's image_encoder/)", input_name=frames.clip_start_input)
    if not wired and has_encoder:
        raise node_error(frames.node, frames.class_type, "required_input_missing", f"{frames.clip_start_input}: the "
                         f"model {served.name!r} has an image encoder: it is conditioned on the start image's CLIP vision "
                         "output; connect a CLIPVisionEncode of the start image", input_name=frames.clip_start_input)
    for vision, image, which in ((frames.clip_start, frames.start, "start"), (frames.clip_end, frames.end, "end")):
        if vision is None:
            continue
        if image is None or vision.image != image:
            _deviate(ev, vision.node, f"image: the CLIP vision output is of another image than the {which} frame; "
                     f"the model's image encoder encodes the {which} frame")
        elif vision.crop == "none" and image.source == "file":
            width, height = _file_size(image)
            if width != height:
                _deviate(ev, vision.node, f"crop='none' squeezes the {width}x{height} image to the encoder's square; "
                         "the model's image processor center-crops it")
    if frames.clip_end is None and frames.end is not None and frames.clip_start is not None:
        if frames.class_type == "WanFunInpaintToVideo":  # ComfyUI: the start image's CLIP output alone
            node_params.setdefault(IMAGE_ENCODE_NODE, {})["clip_last_frame"] = False
        else:
            _deviate(ev, frames.node, "clip_vision_end_image: not connected; the model's image encoder encodes the "
                     "end frame too")


def _file_size(image: Pixels) -> tuple[int, int]:
    if image.width is not None and image.height is not None:
        return image.width, image.height
    from PIL import Image

    assert image.path is not None, "a file image has a path"
    with Image.open(image.path) as opened:
        return opened.size


def _split(ev: Evaluation, first: Sampling, second: Sampling, fields: Fields,
           node_params: dict[str, dict[str, Any]]) -> None:
    """Two KSamplerAdvanced over one schedule: the first (high noise) ends where the second starts."""
    if first.end_at_step is None or first.end_at_step != second.start_at_step or first.steps != second.steps \
            or first.start_at_step != 0:
        raise node_error(second.node, _class(ev, second.node), "invalid_input_type", "chained samplers must split "
                         "one schedule: the first from step 0 to k, the second from k, with the same steps",
                         f"got steps {first.steps}/{second.steps}, end_at_step {first.end_at_step}, "
                         f"start_at_step {second.start_at_step}")
    if second.seed is not None:
        _deviate(ev, second.node, "add_noise=enable on the second sampler: no noise is added between experts")
    if (first.sampler_name, first.scheduler) != (second.sampler_name, second.scheduler):
        _deviate(ev, second.node, "the second sampler's sampler/scheduler differ from the first's; the first's run")
    if first.model.cfg_zero_star != second.model.cfg_zero_star:
        _deviate(ev, second.node, "CFGZeroStar patches one expert's model only; the first expert's setting "
                 f"({first.model.cfg_zero_star}) applies to both")
    if first.model.shift != second.model.shift:
        _deviate(ev, second.node, f"the experts' shifts differ ({first.model.shift}, {second.model.shift}); "
                 f"{first.model.shift} runs")
    if first.sampler_name in RESTARTING_SAMPLERS:
        _deviate(ev, second.node, f"{first.sampler_name} runs as one solve (one history, one noise generator) over "
                 "both experts; ComfyUI restarts it at the switch")
    _deviate(ev, second.node, f"the experts switch at the checkpoint's boundary (its boundary_ratio), not at step "
             f"{first.end_at_step} of {first.steps}")
    fields.put("guidance_scale", first.cfg, "cfg")
    # the low-noise expert's scale is the denoise loop's knob (its params_schema), not a shared field
    node_params.setdefault(DENOISE_NODE, {})["guidance_scale_2"] = second.cfg
    negative = first.negative.text if first.negative is not None else None
    if max(first.cfg, second.cfg) > 1.0 and negative:
        fields.put("negative_prompt", negative)


def _refine(ev: Evaluation, base: Sampling, refine: Sampling, node_params: dict[str, dict[str, Any]]) -> None:
    if refine.sigmas is None or tuple(round(s, 6) for s in refine.sigmas) != REFINE_SIGMAS:
        _deviate(ev, refine.node, f"the refine stage runs its own sigmas {list(REFINE_SIGMAS)}, not "
                 f"{list(refine.sigmas or ())}")
    if refine.sampler_name != base.sampler_name:
        _deviate(ev, refine.node, "the refine stage's sampler differs from the base stage's; the model's runs")
    node_params["upsample"] = {}
    node_params["refine"] = {"guidance_scale": refine.cfg} if refine.cfg != 1.0 else {}


