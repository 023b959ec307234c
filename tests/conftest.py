import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
# most tests plan one length per step: compiled static, they fit the suite's time on 2 cores (a
# symbolic compile took about twice as long); the tests of symbolic lengths ask for them
# (``dynamic=True``: tests/test_lengths.py), as does every user by default
os.environ.setdefault("AUTOSP_DYNAMIC", "0")

import pytest
import torch
import torch.distributed as dist
from _pool import Pool

torch.set_num_threads(1)


def _pools(backend: str):
    started: dict[int, Pool] = {}

    def get(world: int) -> Pool:
        if world not in started or started[world].broken:
            if world in started:
                started[world].close()
            started[world] = Pool(world, backend=backend)
        return started[world]

    yield get
    for p in started.values():
        p.close()


@pytest.fixture(scope="session")
def pools():
    """Gloo worker pools by world size, each started once per session, on first use."""
    yield from _pools("gloo")


@pytest.fixture(scope="session")
def nccl_pools():
    """NCCL worker pools by world size (rank r on GPU r), each started once per session, on first use."""
    yield from _pools("nccl")


@pytest.fixture
def fake_world():
    """A fake process group of any world size in this process: plans without processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()
