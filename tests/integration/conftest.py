"""Fixtures of the integration tests (helpers live in integration_helpers.py)."""

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
    # Tiny models: one thread is faster than two (each op is microseconds; a second thread
    # only adds synchronisation, and on a shared 2-core box it waits for the other jobs).
    torch.set_num_threads(1)
