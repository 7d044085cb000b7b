"""The spec compiled to a torch DeviceMesh on 4 gloo ranks: one mesh dimension per axis in
mesh order (dp, cfg, ring, ulysses, tp), and the two flattened groups the runtime uses —
``sp`` (ring x ulysses: one forward's tokens) and ``rows`` (dp x cfg: one step's forwards)."""

from __future__ import annotations

import torch

from tests.parallel.ranks import run_ranks

SPECS = ("dp=2,ulysses=2", "cfg=2,ring=2", "ulysses=2,tp=2")


def _layout(rank, world):
    from omniloop.parallel.mesh import ParallelMesh
    from omniloop.parallel.spec import AXES, ParallelSpec

    out = {}
    for text in SPECS:
        mesh = ParallelMesh.build(ParallelSpec.from_flag(text), torch.device("cpu"))
        assert mesh.device_mesh.mesh_dim_names == AXES and tuple(mesh.device_mesh.shape) == mesh.spec.degrees
        out[text] = {axis: (mesh.global_ranks(axis), mesh.coordinate(axis), mesh.group(axis) is None)
                     for axis in (*AXES, "sp", "rows")}
    return out


def test_groups_and_coordinates_follow_the_mesh_order():
    results = run_ranks(_layout, 4)
    # dp=2,ulysses=2: ranks [[0, 1], [2, 3]] (dp outer): sp groups are rows of the grid
    dp_sp = [r["dp=2,ulysses=2"] for r in results]
    assert [g["sp"][0] for g in dp_sp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["rows"][0] for g in dp_sp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["dp"][1] for g in dp_sp] == [0, 0, 1, 1] and [g["ulysses"][1] for g in dp_sp] == [0, 1, 0, 1]
    assert all(g["cfg"] == ([rank], 0, True) for rank, g in enumerate(dp_sp))  # degree 1: no group, no cost
    # cfg=2,ring=2: the sp group is the ring; rows is the cfg pair
    cfg_ring = [r["cfg=2,ring=2"] for r in results]
    assert [g["sp"][0] for g in cfg_ring] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["cfg"][1] for g in cfg_ring] == [0, 0, 1, 1] and [g["ring"][1] for g in cfg_ring] == [0, 1, 0, 1]
    # ulysses=2,tp=2: tp innermost (neighbours), ulysses across them
    usp_tp = [r["ulysses=2,tp=2"] for r in results]
    assert [g["tp"][0] for g in usp_tp] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["sp"][0] for g in usp_tp] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(g["rows"][2] for g in usp_tp)  # dp x cfg = 1
