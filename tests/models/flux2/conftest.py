from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def klein_dir(tmp_path_factory):
    """A tiny FLUX.2-klein folder (step-distilled: no CFG; tests/models/flux2/checkpoint.py)."""
    from tests.models.flux2.checkpoint import save_klein_checkpoint

    folder = tmp_path_factory.mktemp("klein")
    save_klein_checkpoint(folder)
    return folder


@pytest.fixture(scope="session")
def klein_base_dir(tmp_path_factory):
    """The same weights as a klein base folder (``is_distilled: false``: CFG against "")."""
    from tests.models.flux2.checkpoint import save_klein_checkpoint

    folder = tmp_path_factory.mktemp("klein_base")
    save_klein_checkpoint(folder, distilled=False)
    return folder
