"""Shared pytest fixtures: one Ray session for the whole run, one tiny Qwen2 model built locally (its folder, and per
test module its tokenizer and float32 model), torch at two threads for a test.

Owned by the lead; put fixtures private to a test package in that package's own conftest.py.
"""

import pytest
import torch

torch.set_num_threads(1)


def pytest_configure(config):
    from tests.multirank import preload_fork_server

    preload_fork_server()  # before any test starts the fork server (2-rank tests, reward managers' pools)


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker (scripts/run_tests.sh)
        _slow_files_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _slow_files_first(items):
    """Order the files that hold a `slow` test before the others, keeping each file's own order: with
    `--dist loadfile --no-loadscope-reorder` the workers take files in this order, so the long end-to-end files
    start early and no worker is left running one of them alone at the end."""
    has_slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in has_slow)  # a stable sort: the order within each group stays


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray session shared by every test that asks for it (ray.init costs ~7 s)."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            log_to_driver=True,
            runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}},
        )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Directory of a tiny random-weight Qwen2 model and its locally trained tokenizer (HF format)."""
    from verl.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny_qwen2")
    build_tiny_model(str(out), size="xs", seed=0)
    return str(out)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    """The tiny model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    """The tiny model in float32, in eval mode (one per test module: tests may write its weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def process_group():
    """A world-size-1 gloo group for this module (`init_distributed("gloo")`'s (rank, world size)); torn down
    afterwards unless someone else had started one."""
    import torch.distributed as dist

    from verl.utils.fsdp_utils import init_distributed

    created = not dist.is_initialized()
    yield init_distributed("gloo")
    if created and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def own_process_group():
    """For modules whose tests `initialize()` an engine here (a one-process torch.distributed group in this
    process): end the group after the module, so that later tests that start a group of their own in this process
    find none."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    yield
    if started and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def two_threads():
    """torch at 2 intra-op threads for the test (the session runs at 1), its count back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def clean_env(monkeypatch):
    """No distributed variables set (as outside a worker group); every variable a test or a `Worker` sets is undone
    afterwards."""
    from verl.single_controller.base.worker import ENV_KEYS, NUM_THREADS_ENV

    for key in (*ENV_KEYS, NUM_THREADS_ENV):
        monkeypatch.setenv(key, "placeholder")
        monkeypatch.delenv(key)
    return monkeypatch
