import pytest

from tests.ext.factories import load


@pytest.fixture(scope="module")
def base_pipeline(wan_t2v_dir):
    """Shared by interceptor tests (installing interceptors never touches the modules)."""
    return load(wan_t2v_dir)


@pytest.fixture
def fresh_pipeline(wan_t2v_dir):
    """A newly loaded pipeline: observers with module taps hook its modules."""

    def make(cfg_mode: str = "sequential"):
        return load(wan_t2v_dir, cfg_mode)

    return make
