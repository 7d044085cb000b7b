"""Fleet worker: an omniloop ``AsyncEngine`` behind NVIDIA Dynamo's frontend.

Dynamo owns discovery, routing and autoscaling; this package makes our engine a Dynamo
backend (design §6.3.5): ``mapping`` (wire objects <-> ``OmniRequest``), ``frames``
(JPEG/PNG and progress frames), ``metrics`` (queue depth, running, per-request cost),
``handler`` (per-request coroutines over the engine: cancellation, errors, streaming) and
``worker`` (runtime, registration, readiness, graceful drain). Needs the ``fleet`` extra;
``mapping`` and ``frames`` import nothing of Dynamo.
"""
