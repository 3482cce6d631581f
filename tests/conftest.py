import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu-marked test)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_bundle_fp32():
    """The real default model in float32 (loaded once per test session)."""
    from aserve.config import EngineConfig
    from aserve.engine.bundle import ModelBundle

    return ModelBundle.load(EngineConfig(dtype="fp32", attention="reference"))
