"""The roles a Dynamo worker serves, as it publishes them at registration (design §6.3.6 A4).

A deployment's graph nodes run on its role pools (``DeployConfig.pools`` / ``placement``:
encode / denoise / decode, thinker / talker / vocoder...); nodes not placed run in the
engine's own process, role ``main``. A worker without pools serves its whole graph in one
pool: role ``all``.

What Dynamo 1.6.1 lets a worker publish, and what we put there:

* ``ModelRuntimeConfig.taints``: one ``omniloop.role/<role>`` per role served. A request's
  ``RoutingConstraints(required_taints=...)`` restricts it to workers of that role.
* ``ModelRuntimeConfig.set_engine_specific``: ``omniloop_roles`` (the roles, comma-joined)
  and ``omniloop_role_graph`` (JSON: every node in topological order with its role, and the
  streaming edges), in the card's ``runtime_data``, which a role-aware router reads.
* ``worker_type=WorkerType.Aggregated``, ``needs=[]``: the fallback of one worker per
  deployment. NOTE: Dynamo 1.6.1's ``WorkerType`` is a closed enum (``Prefill``, ``Decode``,
  ``Encode``, ``Aggregated``) and the frontend's disaggregation (``PrefillRouter``, with
  ``needs``) orchestrates only those LLM stages with KV hand-offs; there is no API to declare
  an N-node role graph and have the frontend move artifacts along its edges. So the worker
  owns its whole graph (its role pools are engine-internal, joined by our Connectors) and the
  frontend routes to it as one aggregated worker; the published roles are for routing and
  observability until Dynamo generalizes the role router (ask A4).

Nothing here imports Dynamo.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from omniloop.deploy import DeployConfig
from omniloop.pipeline.spec import PipelineSpec

ROLE_TAINT_PREFIX = "omniloop.role/"
ALL_ROLES = "all"  # a one-pool worker: every node of the graph in the engine's process
MAIN_ROLE = "main"  # nodes not placed on a pool run in the engine's own process


@dataclass(frozen=True)
class WorkerRoles:
    roles: tuple[str, ...]  # what this worker serves: its pools (and "main"), or ("all",)
    nodes: tuple[tuple[str, str], ...]  # (graph node, its role), topological order
    streams: tuple[str, ...]  # graph edges declared streaming (their consumers start at the first chunk)

    def taints(self) -> set[str]:
        return {ROLE_TAINT_PREFIX + role for role in self.roles}

    def engine_specific(self) -> dict[str, str]:
        """``ModelRuntimeConfig.set_engine_specific`` entries (string values: what a reader
        gets back from ``get_engine_specific``)."""
        graph = {"roles": list(self.roles), "nodes": [{"name": n, "role": r} for n, r in self.nodes],
                 "streams": list(self.streams), "worker_type": "aggregated"}
        return {"omniloop_roles": ",".join(self.roles), "omniloop_role_graph": json.dumps(graph)}

    def describe(self) -> dict[str, Any]:
        return {"roles": list(self.roles), "nodes": dict(self.nodes), "streams": list(self.streams)}


def worker_roles(spec: PipelineSpec, deploy: DeployConfig) -> WorkerRoles:
    """The roles of a worker serving ``spec`` placed as ``deploy`` says."""
    order = spec.order or tuple(n.name for n in spec.nodes)
    streams = tuple(s.edge for s in spec.streams)
    if not deploy.pools:
        return WorkerRoles(roles=(ALL_ROLES,), nodes=tuple((n, ALL_ROLES) for n in order), streams=streams)
    nodes = tuple((n, deploy.placement.get(n, MAIN_ROLE)) for n in order)
    used = {role for _, role in nodes}
    # every declared pool is served (a pool no node is placed on still runs its process)
    roles = tuple(sorted(deploy.pools)) + ((MAIN_ROLE,) if MAIN_ROLE in used else ())
    return WorkerRoles(roles=roles, nodes=nodes, streams=streams)


def runtime_config(roles: WorkerRoles) -> Any:
    """A Dynamo ``ModelRuntimeConfig`` carrying ``roles`` (imports Dynamo)."""
    from dynamo.llm import ModelRuntimeConfig

    config = ModelRuntimeConfig()
    config.taints = roles.taints()
    for key, value in roles.engine_specific().items():
        config.set_engine_specific(key, json.dumps(value))  # the value is parsed as JSON: a JSON string
    return config
