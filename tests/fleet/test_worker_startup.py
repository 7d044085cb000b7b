"""``omniloop dynamo-worker`` fails loudly as ``omniloop serve`` does: a warmup that fails
exits 1 with the error naming the shape and the cause, before the worker registers."""

from __future__ import annotations

import pytest

from tests.fleet.conftest import requires_dynamo

pytestmark = [pytest.mark.fleet, pytest.mark.slow, requires_dynamo]


def test_a_refused_warmup_exits_1_naming_the_shape_and_the_cause(make_fleet):
    fleet = make_fleet()
    worker = fleet.start_worker("bad-warmup", warmup=(1, 40, 5))  # 40x40: not a multiple of 16
    worker.proc.expect_exit = True
    assert worker.proc.wait(timeout=180) == 1, worker.proc.tail()
    assert worker.proc.tail().splitlines()[-1] == (
        "error: warmup shape 0 (steps=1 height=40 width=40 num_frames=5) was refused: "
        "diffusion.height=40 must be a multiple of 16; pass 32 or 48")
