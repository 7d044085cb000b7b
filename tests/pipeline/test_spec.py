"""PipelineSpec build-time validation: every error names the node and edge at fault."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from omniloop.pipeline.edges import ConditionLatents, DenoisedLatents, TextEmbeddings
from omniloop.pipeline.predicates import opt, task_in
from omniloop.pipeline.spec import ComponentSpec, Node, PipelineSpec, PipelineSpecError
from omniloop.pipeline.stage import StageBase
from omniloop.request import Artifact, OmniRequest, TaskType, TextPart, VideoArtifact

T2V, I2V = TaskType.T2V, TaskType.I2V


@dataclass
class FakeStage(StageBase):
    ins: dict
    outs: dict
    comps: tuple = ()
    opt_ins: dict | None = None

    def __post_init__(self):
        self.inputs = self.ins
        self.outputs = self.outs
        self.optional_inputs = self.opt_ins or {}
        self.components = self.comps

    def forward(self, ctx, state):  # pragma: no cover - never run
        pass


COMPONENTS = {"enc": ComponentSpec(name="enc", kind="text_encoder"), "vae": ComponentSpec(name="vae", kind="vae")}


def spec(nodes, tasks=(T2V,), outputs=None, components=COMPONENTS):
    return PipelineSpec(name="t", family="f", tasks=frozenset(tasks), components=components, nodes=tuple(nodes),
                        outputs=outputs or {})


def encode():
    return Node("encode", FakeStage({}, {"text": TextEmbeddings}, ("enc",)))


def denoise():
    return Node("denoise", FakeStage({"text": TextEmbeddings}, {"latents": DenoisedLatents}, (), {"condition": ConditionLatents}))


def decode():
    return Node("decode", FakeStage({"latents": DenoisedLatents}, {"video": VideoArtifact}, ("vae",)))


def test_valid_linear_graph_orders_nodes():
    s = spec([decode(), denoise(), encode()], outputs={"video": "video"})
    assert s.order == ("encode", "denoise", "decode")


def test_unknown_component_names_node():
    bad = Node("encode", FakeStage({}, {"text": TextEmbeddings}, ("clip",)))
    with pytest.raises(PipelineSpecError, match=r"node 'encode' binds unknown component 'clip'"):
        spec([bad])


def test_missing_producer_names_node_and_edge():
    with pytest.raises(PipelineSpecError, match=r"node 'denoise' reads edge 'text' \(TextEmbeddings\), which no node produces"):
        spec([denoise()])


def test_edge_type_mismatch_names_both_nodes():
    wrong = Node("encode", FakeStage({}, {"text": ConditionLatents}, ("enc",)))
    with pytest.raises(PipelineSpecError, match=r"edge 'text': node 'encode' produces ConditionLatents but node 'denoise' expects TextEmbeddings"):
        spec([wrong, denoise()])


def test_cycle_detected():
    a = Node("a", FakeStage({"y": Artifact}, {"x": Artifact}))
    b = Node("b", FakeStage({"x": Artifact}, {"y": Artifact}))
    with pytest.raises(PipelineSpecError, match=r"cycle among nodes \['a', 'b'\]"):
        spec([a, b])


def test_node_unreachable_for_every_declared_task():
    cond = Node("image_cond", FakeStage({}, {"condition": ConditionLatents}, ("vae",)), when=task_in(I2V))
    with pytest.raises(PipelineSpecError, match=r"node 'image_cond' is unreachable"):
        spec([encode(), cond, denoise()], tasks=(T2V,))


def test_producer_gated_to_other_task_is_missing_for_this_task():
    gated = Node("encode", FakeStage({}, {"text": TextEmbeddings}, ("enc",)), when=task_in(I2V))
    with pytest.raises(PipelineSpecError, match=r"node 'denoise' reads edge 'text' for task 't2v'"):
        spec([gated, denoise()], tasks=(T2V, I2V))


def test_optional_input_and_task_branches():
    cond = Node("image_cond", FakeStage({}, {"condition": ConditionLatents}, ("vae",)), when=task_in(I2V))
    s = spec([encode(), cond, denoise(), decode()], tasks=(T2V, I2V), outputs={"video": "video"})
    assert s.order.index("image_cond") < s.order.index("denoise")
    t2v = OmniRequest(task=T2V, inputs=[TextPart(text="x")])
    i2v = OmniRequest(task=I2V, inputs=[TextPart(text="x")])
    assert [n.name for n in s.nodes_in_order() if n.active(t2v)] == ["encode", "denoise", "decode"]
    assert [n.name for n in s.nodes_in_order() if n.active(i2v)] == ["encode", "image_cond", "denoise", "decode"]


def test_option_predicates_combine_with_tasks():
    upsample = opt("upsample", lambda r: r.priority > 5)
    p = task_in(T2V) & upsample
    assert p.tasks() == frozenset({T2V}) and not p.pure
    assert (~task_in(T2V)).tasks() == frozenset(TaskType) - {T2V}
    assert (~p).tasks() is None  # may be true for T2V (when the option is off)
    assert p(OmniRequest(task=T2V, priority=9)) and not p(OmniRequest(task=T2V))


def test_output_must_name_a_produced_edge():
    with pytest.raises(PipelineSpecError, match=r"output 'audio' names edge 'audio', which no node produces"):
        spec([encode(), denoise(), decode()], outputs={"audio": "audio"})


def test_duplicate_nodes_and_bad_rename():
    with pytest.raises(PipelineSpecError, match="duplicate node names"):
        spec([encode(), encode()])
    renamed = Node("encode", FakeStage({}, {"text": TextEmbeddings}, ("enc",)), outputs={"txt": "t"})
    with pytest.raises(PipelineSpecError, match=r"renames unknown output port\(s\) \['txt'\]"):
        spec([renamed])


def test_port_rename_wires_edges():
    enc = Node("encode", FakeStage({}, {"text": TextEmbeddings}, ("enc",)), outputs={"text": "prompt_embeds"})
    den = Node("denoise", FakeStage({"text": TextEmbeddings}, {"latents": DenoisedLatents}), inputs={"text": "prompt_embeds"})
    assert spec([den, enc]).order == ("encode", "denoise")


def test_components_shared_by_reference_between_loop_nodes(wan_a14b_dir):
    from omniloop.api.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained(wan_a14b_dir, device="cpu", dtype="float32")
    ctxs = gen.pipeline.contexts
    assert ctxs["denoise"].component("vae") is ctxs["decode"].component("vae")
    assert ctxs["denoise"].component("transformer") is gen.pipeline.components["transformer"]


def test_a_stage_missing_protocol_methods_is_refused_naming_them():
    """The engine calls every method of the Stage / LoopStage protocols without probing, so
    a stage that lacks some is refused at build (not with an AttributeError mid-step)."""

    class BareLoop:  # a loop written against the protocol by hand, without LoopStageBase
        inputs, optional_inputs, outputs, components = {}, {}, {"latents": DenoisedLatents}, ()

        def init(self, ctx, state): ...  # pragma: no cover - never run

        def step(self, ctx, loop): ...  # pragma: no cover

        def finalize(self, ctx, loop, state): ...  # pragma: no cover

    with pytest.raises(PipelineSpecError, match=r"node 'denoise': BareLoop lacks \['batch_key', 'batch_weight', "
                                                r"'check_request', .*'ready', 'ready_at', .*subclass .*LoopStageBase"):
        spec([Node("denoise", BareLoop())])
