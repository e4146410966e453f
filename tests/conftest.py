import os
import sys

import pytest
import torch
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))
# Tests never reach a model hub: everything runs from local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Without a GPU, Triton kernels run in the interpreter (read when @triton.jit runs).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile("ci", deadline=None, print_blob=True)
settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
