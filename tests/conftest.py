import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHARED = ROOT.parent / "shared"


def pytest_addoption(parser):
    parser.addoption("--kernels", default="auto", choices=("auto", "fallback"),
                     help="fallback: run the suite as on a CPU where aserve's C++ kernels do not build: every "
                          "engine takes torch's own ops (kernels auto resolves to fallback), the kernels' own "
                          "tests skip, their fallbacks' tests run")


def pytest_configure(config):
    if config.getoption("--kernels") == "fallback":
        from model import native

        def refuse():
            raise RuntimeError("aserve's C++ kernels are off for this test run (pytest --kernels fallback)")

        native.load = refuse  # what available() and every kernel call go through
        native.available.cache_clear()
        native.bf16_linear_available.cache_clear()


@pytest.fixture(scope="session")
def kernels(pytestconfig) -> str:
    """This run's ``--kernels``, for servers the tests start as subprocesses (``cli.py --kernels``)."""
    return pytestconfig.getoption("--kernels")


# The unit tier (make test-unit, CI's first signal): modules that load no model, start no server
# and never wait on the wall clock (the control plane runs on simulated devices and virtual time:
# test_control_plane.py). Its tests are marked ``unit``; the rest of make test follows them in CI.
UNIT_MODULES = frozenset({
    "test_adaptive_policies", "test_adaptive_table", "test_alise", "test_baseline_rules",
    "test_batching_invariants", "test_cli_spellings", "test_core_lending", "test_control_plane", "test_decode_policies", "test_dispatch",
    "test_fig_ablation", "test_flip_policies", "test_netemu_link", "test_predictors_agreement", "test_predictors_base",
    "test_predictor_share", "test_prefill_policies", "test_prefix_cache", "test_release_memory", "test_results_page",
    "test_sim_heldout", "test_step_channel", "test_step_drift", "test_step_speed", "test_placement_slo", "test_slo_budget", "test_profile_checks",
})


def pytest_collection_modifyitems(config, items):
    unit = pytest.mark.unit
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in UNIT_MODULES and not (
                {"slow", "long", "gpu"} & set(item.keywords)):
            item.add_marker(unit)
    if not any("gpu" in item.keywords for item in items):
        return  # torch is not imported for a run that has no gpu test
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


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray for the whole test session: two CPUs and a small object store, as the Ray
    tests are sized for. Clusters with ``backend="ray"`` find it connected and leave it up."""
    ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    init_local_ray(ray)
    yield ray
    ray.shutdown()


def init_local_ray(ray) -> None:
    """The session's local Ray (tests that run a Ray cluster of their own start it again after)."""
    import logging

    ray.init(num_cpus=2, object_store_memory=128 * 2**20, include_dashboard=False,
             logging_level=logging.WARNING)


if __name__ == "__main__":  # make test-unit collects only these files (collecting all costs ~15 s)
    print(" ".join(f"tests/{m}.py" for m in sorted(UNIT_MODULES)))
