import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles from scratch: no cache entry of one test serves another.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
