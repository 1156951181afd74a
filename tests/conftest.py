import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# One thread: the suite must finish in time with another busy process on a 2-core machine, where two threads wait on
# each other (four heavy test files: 188 s with two threads against 150 s with one; alone 155 s against 162 s)
torch.set_num_threads(1)

try:  # property tests draw the same examples on every run (a CI run is reproducible; `--runslow` explores anew)
    from hypothesis import settings as _hypothesis

    _hypothesis.register_profile("reproducible", derandomize=True)
    _hypothesis.register_profile("explore", derandomize=False)
except ImportError:  # (hypothesis is a test extra)
    _hypothesis = None


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_configure(config):
    if _hypothesis is not None:
        _hypothesis.load_profile("explore" if config.getoption("--runslow") else "reproducible")


def pytest_collection_modifyitems(config, items):
    skip_slow = pytest.mark.skip(reason="slow: pass --runslow to run")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--runslow"):
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    # A module with `start_background(config)` starts a subprocess as soon as the tests are collected (below) and
    # its tests run last, so that the subprocess's work overlaps the rest of the suite (stable: the order is
    # otherwise kept).
    items.sort(key=lambda item: hasattr(getattr(item, "module", None), "start_background"))


def pytest_collection_finish(session):
    for module in dict.fromkeys(getattr(item, "module", None) for item in session.items):
        if hasattr(module, "start_background"):
            module.start_background(session.config)


# Models load on the CPU by default, as on CI, also on a machine with a GPU (load's default there is CUDA, where
# the fp32 oracle comparisons and CPU generators of these tests do not hold); set at import, so module- and
# session-scoped fixtures see it too (a value from the shell is overridden: these tests assume it). Tests marked gpu
# get CUDA as their default.
os.environ["BLOCKPRESS_DEVICE"] = "cpu"
# No tuned kernel settings (`blockpress tune`'s file, kernels/tuned.py) from the machine's cache: the tests choose the
# kernels they test; tests of the tuned settings point BLOCKPRESS_TUNED at a file of their own.
os.environ["BLOCKPRESS_TUNED"] = "off"


@pytest.fixture(autouse=True)
def _gpu_tests_default_to_cuda(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        monkeypatch.setenv("BLOCKPRESS_DEVICE", "cuda")
    yield


@pytest.fixture(autouse=True)
def _grad_mode(request):
    """Every test runs with autograd on, or off where its module says `pytestmark = pytest.mark.no_grad` (inference
    tests), and leaves the mode as it found it: a mode set at a module's import, or by a script run in-process
    (runpy), would otherwise hold for every test after it."""
    with torch.set_grad_enabled(request.node.get_closest_marker("no_grad") is None):
        yield


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """The spec 6.1 tiny model, saved by transformers (save_pretrained)."""
    from hf_oracle import build_hf_model

    model = build_hf_model()
    path = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(path)
    return path, model
