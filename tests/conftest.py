import os
import tempfile

import pytest
import torch
import torch.distributed as dist


@pytest.fixture(scope="session")
def single_rank_group():
    """A one-rank gloo process group in the test process (for setup-time checks)."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        yield
        dist.destroy_process_group()


@pytest.fixture()
def cpu_mesh(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (1,))


def pytest_configure(config):
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
