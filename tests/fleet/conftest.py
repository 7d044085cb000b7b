import pytest

from tests.fleet.fleet import Fleet, dynamo_missing

DYNAMO_MISSING = dynamo_missing()
requires_dynamo = pytest.mark.skipif(DYNAMO_MISSING is not None, reason=DYNAMO_MISSING or "")


@pytest.fixture
def make_fleet(wan_t2v_dir, tmp_path_factory):
    """Fleets started by a test; every process is stopped by PID at teardown."""
    fleets = []

    def make(**kwargs) -> Fleet:
        fleet = Fleet(tmp_path_factory.mktemp("fleet"), wan_t2v_dir, **kwargs)
        fleets.append(fleet)
        return fleet

    yield make
    for fleet in fleets:
        fleet.stop()
