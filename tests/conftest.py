import pytest
import torch


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles from scratch: no cache entry of one test serves another.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="tests/test_generated.py: 5,000 random programs, every failure recorded and shrunk")
