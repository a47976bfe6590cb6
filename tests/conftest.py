import os

import pytest
import torch

# Off for the suite: tests that patch a pass would otherwise get the rewrite an earlier run stored
# (tests/test_compile_cache.py turns it on, in a directory of its own).
os.environ["SPECPASS_CACHE"] = "0"

if "PYTEST_XDIST_WORKER" in os.environ:  # a worker per core (pyproject's addopts): one thread each
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test compiles from scratch: no cache entry of one test serves another.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def pytest_addoption(parser):
    parser.addoption("--long", action="store_true",
                     help="tests/test_generated.py: 5,000 random programs, every failure recorded and shrunk")
