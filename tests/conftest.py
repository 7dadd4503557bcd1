"""Shared test setup: a fixed seed for every test and two threads (the CI machine's cores)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_configure(config):
    torch.set_num_threads(min(2, torch.get_num_threads()))
