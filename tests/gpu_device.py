"""The device of the `gpu`-marked tests (pytest -m gpu): CUDA, or the CPU in the GPU check's dry run.

AGENTRL_TEST_DEVICE picks it: unset = CUDA where torch sees one, else the test
skips (saying so); `cuda` = CUDA or fail (scripts/gpu_check.sh on a GPU: a skip
must not pass for a check); `cpu` = the CPU (`gpu_check.sh --cpu`, so the tests
run, and cannot rot, on machines without a GPU).
"""

from __future__ import annotations

import os

import pytest

ENV = "AGENTRL_TEST_DEVICE"
ALLOWED = ("cpu", "cuda")


def gpu_test_device() -> str:
    """The torch device for a gpu-marked test, or a skip where none is to be had."""
    want = os.environ.get(ENV, "")
    if want and want not in ALLOWED:
        raise ValueError(f"{ENV}={want!r}: allowed values are {', '.join(ALLOWED)} (or unset)")
    if want == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if want == "cuda":
        pytest.fail(f"{ENV}=cuda but torch sees no CUDA device (torch {torch.__version__})")
    pytest.skip(f"needs a CUDA GPU (torch.cuda.is_available() is False); {ENV}=cpu runs it on the CPU")
