"""The roles a Dynamo worker publishes at registration: ``all`` for a one-pool worker, its
role pools (and ``main``) otherwise, as taints and runtime data Dynamo 1.6.1 stores."""

from __future__ import annotations

import json

import pytest

from omniloop.deploy import DeployConfig
from omniloop.serve.dynamo.roles import runtime_config, worker_roles
from tests.fleet.conftest import requires_dynamo


@pytest.fixture(scope="module")
def spec(wan_t2v_dir):
    from omniloop.engine import AsyncEngine

    eng = AsyncEngine.from_pretrained(wan_t2v_dir, device="cpu", dtype="float32")
    try:
        yield eng.engine.pipeline.spec
    finally:
        eng.shutdown()


def test_one_pool_worker_serves_all(spec):
    roles = worker_roles(spec, DeployConfig())
    assert roles.roles == ("all",)
    assert [n for n, _ in roles.nodes] == list(spec.order) and {r for _, r in roles.nodes} == {"all"}
    assert roles.taints() == {"omniloop.role/all"}


def test_role_pools_are_the_roles_and_unplaced_nodes_are_main(spec):
    first, *rest = spec.order
    deploy = DeployConfig(pools={"encode": {"device": "cpu"}, "denoise": {"device": "cpu"}},
                          placement={first: "encode", rest[0]: "denoise"})
    roles = worker_roles(spec, deploy)
    assert roles.roles == ("denoise", "encode", "main")
    placed = dict(roles.nodes)
    assert placed[first] == "encode" and placed[rest[0]] == "denoise"
    assert all(placed[n] == "main" for n in rest[1:])
    graph = json.loads(roles.engine_specific()["omniloop_role_graph"])
    assert graph["worker_type"] == "aggregated" and graph["nodes"][0] == {"name": first, "role": "encode"}


@requires_dynamo
def test_dynamo_runtime_config_carries_the_roles(spec):
    deploy = DeployConfig(pools={"decode": {"device": "cpu"}}, placement={spec.order[-1]: "decode"})
    config = runtime_config(worker_roles(spec, deploy))
    assert config.taints == {"omniloop.role/decode", "omniloop.role/main"}
    assert config.get_engine_specific("omniloop_roles") == "decode,main"
    graph = json.loads(config.get_engine_specific("omniloop_role_graph"))
    assert graph["nodes"][-1] == {"name": spec.order[-1], "role": "decode"}
