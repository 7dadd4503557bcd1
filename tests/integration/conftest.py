"""Fixtures of the integration tests (helpers live in integration_helpers.py)."""

import os
import random

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True, scope="session")
def _threads():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
