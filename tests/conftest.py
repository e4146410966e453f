import os
import shutil
import sys
import tempfile
from pathlib import Path

# Each xdist worker computes with one thread (read when torch and numba load, just below):
# `make test` runs two workers on two cores, and two threads each made every file about a
# quarter slower (tests/test_faults.py + test_graphs.py: 257 s of worker time against 185 s).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

import pytest
import torch
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir

sys.path.insert(0, os.path.dirname(__file__))
# Tests never reach a model hub: everything runs from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Without a GPU, Triton kernels run in the interpreter (read when @triton.jit runs).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from helpers.triton_interpreter import install

    install()  # nested kernel helpers skip the interpreter's repeated patch (a third faster)

# Hypothesis profiles. `ci` (the default): derandomized, so every run draws the same examples
# and a failure reproduces; no example database, so nothing lands in the checkout (failures
# print their blob). `deep` (CERTKV_HYPOTHESIS=deep): fresh random draws, and every property
# test ten times its examples (helpers.examples), for long local runs.
settings.register_profile("ci", deadline=None, print_blob=True, database=None,
                          derandomize=True)
settings.register_profile("deep", deadline=None, print_blob=True, database=None)
settings.load_profile(os.environ.get("CERTKV_HYPOTHESIS", "ci"))

# Where W&B puts a run without an explicit dir (its root dir is fixed at the first wandb.init
# of the process: the checkout, before this) and its caches and settings.
WANDB_DIRS = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR",
              "WANDB_ARTIFACT_DIR")


HYPOTHESIS_HOME = pytest.StashKey[Path]()


def pytest_configure(config):
    """Hypothesis's storage (``.hypothesis/``: its plugin caches constants while collecting) in
    a temporary folder of this session instead of the working directory."""
    config.stash[HYPOTHESIS_HOME] = Path(tempfile.mkdtemp(prefix="certkv-tests-hypothesis-"))
    set_hypothesis_home_dir(config.stash[HYPOTHESIS_HOME])


def pytest_unconfigure(config):
    if HYPOTHESIS_HOME in config.stash:
        set_hypothesis_home_dir(None)
        shutil.rmtree(config.stash[HYPOTHESIS_HOME], ignore_errors=True)


@pytest.fixture(scope="session")
def hypothesis_home(pytestconfig) -> Path:
    return pytestconfig.stash[HYPOTHESIS_HOME]


@pytest.fixture(scope="session", autouse=True)
def oracle_witness():
    """Every store keeps the test's own FP16 copy of what was appended to it, which the
    contract's oracle reads instead of the store (:func:`helpers.install_witness`)."""
    from helpers import install_witness

    with pytest.MonkeyPatch.context() as mp:
        install_witness(mp)
        yield


@pytest.fixture(scope="session", autouse=True)
def output_outside_the_checkout(tmp_path_factory):
    """Test output stays out of the checkout and the home directory: W&B runs (those opened
    without ``dir``), caches and settings go under pytest's temporary directory."""
    root = tmp_path_factory.mktemp("test-output")
    with pytest.MonkeyPatch.context() as mp:
        for name in WANDB_DIRS:
            path = root / name.lower()
            path.mkdir()
            mp.setenv(name, str(path))
        yield root


@pytest.fixture(scope="session")
def books():
    """The folder of the offline books in the default cache (``$CERTKV_DATA`` or
    ``~/.cache/certkv``), fetched on the first run (:func:`helpers.fetch_books`): request it
    in every test that reads them, directly or through a task; it skips where they cannot be
    had."""
    from helpers import fetch_books

    return fetch_books()


@pytest.fixture
def data_dir_with_books(books, tmp_path, monkeypatch):
    """A fresh ``$CERTKV_DATA`` under ``tmp_path`` holding the cached books (no second
    download) and nothing else."""
    target = tmp_path / "data"
    (target / "books").mkdir(parents=True)
    for book in books.glob("*.txt"):
        (target / "books" / book.name).symlink_to(book)
    monkeypatch.setenv("CERTKV_DATA", str(target))
    return target


@pytest.fixture(scope="session")
def lm_eval_data(books, tmp_path_factory):
    """A ``$CERTKV_DATA`` with the books and certkv's lm-eval tasks for the tiny model at 1024
    tokens and 2 samples, generated once for every test that runs them."""
    from certkv.integrations.lm_eval_tasks import task_folder

    target = tmp_path_factory.mktemp("lm-eval-data")
    (target / "books").mkdir()
    for book in books.glob("*.txt"):
        (target / "books" / book.name).symlink_to(book)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CERTKV_DATA", str(target))
        task_folder("tiny_random", 1024, 2)
    return target


@pytest.fixture
def data_dir_with_tasks(lm_eval_data, monkeypatch):
    """``$CERTKV_DATA`` set to :func:`lm_eval_data` (tasks for the tiny model at 1024 x 2)."""
    monkeypatch.setenv("CERTKV_DATA", str(lm_eval_data))
    return lm_eval_data


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random LLaMA saved as a Hugging Face model directory (weights + tokenizer),
    standing in for a user's local model (``model.path=DIR``)."""
    from certkv.config import compose_config
    from certkv.models import load_model
    from certkv.models.loading import ModelSpec

    spec = compose_config(["model=tiny_random"]).model
    lm = load_model(ModelSpec(**{k: v for k, v in dict(spec).items() if k != "_target_"}))
    folder = tmp_path_factory.mktemp("models") / "My-Tiny-LLaMA"
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return folder


# The longest files (seconds per file of the last CI run, "seconds per test file" below) run
# first: xdist hands each worker whole files in collection order, and a long file left to the
# end kept one worker busy alone for a minute while the other had finished.
LONG_FILES_FIRST = ("tests/test_graphs.py", "tests/test_batch_step.py", "tests/test_cli.py",
                    "tests/test_every_option.py", "tests/test_faults.py", "tests/test_sweep.py",
                    "tests/test_bench.py",
                    "tests/integrations/test_lm_eval.py", "tests/test_readme.py",
                    "tests/models/test_smollm2.py", "tests/test_user_paths.py",
                    "tests/kernels/test_device_fallback.py", "tests/test_component_contract.py",
                    "tests/evict/test_evict.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: k for k, path in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def audit(monkeypatch):
    """``(auditor, reads)``: a :class:`helpers.host_reads.HostReadAudit` and the shapes that
    ``certkv.step.to_host`` read, with every read marked on the host."""
    from helpers.host_reads import HostReadAudit

    import certkv.step as attention_module

    auditor = HostReadAudit()
    reads = []
    original = attention_module.to_host

    def counted(x):
        reads.append(tuple(x.shape))
        with torch.overrides._pop_mode_temporarily():
            out = original(x)
        auditor.mark_host(out)
        return out

    monkeypatch.setattr(attention_module, "to_host", counted)
    return auditor, reads


_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Seconds per test file (setup, call and teardown; on the controller under xdist)."""
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """The suite's time per test file, slowest first (what the 12-minute CI budget is spent
    on: the time of each file on its worker; workers run files in parallel)."""
    if not _FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file")
    ranked = sorted(_FILE_SECONDS.items(), key=lambda item: -item[1])
    for path, seconds in ranked:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  in all (both workers)")
