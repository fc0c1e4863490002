"""The data position's records (``leto.trainer.data_state``) on a real state manager, no
trainers: a shuffled two-worker ``StatefulDataLoader`` recorded at each commit and loaded
into a fresh loader (as a promoted trainer builds it) yields the exact next batch; the
records' XOR parity is what the pool's codec computes and rebuilds a lost page; torn,
oversized and stateless inputs are refused or read as absent."""

from __future__ import annotations

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from leto.errors import FatalFailure, InvalidInput
from leto.memory.client import PoolClient
from leto.memory.launch import start_state_manager
from leto.trainer.data_state import NAMES, DataState, stateful
from tests.pool_helpers import small_config

pytestmark = [
    # torchdata calls torch.set_vital, deprecated in torch 2.13: not ours to fix.
    pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning"),
]


@pytest.fixture
def pool():
    sm = start_state_manager(small_config())
    yield sm
    sm.stop()


def _loader() -> StatefulDataLoader:
    """As a user builds it: shuffled, two workers, a seeded generator."""
    data = torch.utils.data.TensorDataset(torch.arange(64))
    g = torch.Generator().manual_seed(7)
    return StatefulDataLoader(data, batch_size=4, shuffle=True, num_workers=2, generator=g)


def test_a_shuffled_two_worker_loader_resumes_at_the_exact_next_batch(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as client:
        client.localize()
        loader = _loader()
        state = DataState(client, stateful(loader))
        state.bind()
        drawn = []
        it = iter(loader)
        for t in range(6):  # an iteration draws its batch, then commits
            drawn.append(next(it)[0])
            if t < 4:
                state.write(t)  # (4 and 5 never commit: the failure)
        del it
        # A recovery resuming at 4 (3 committed): a new loader, built as the script
        # builds it, gets 3's record and yields iteration 4's batch, then 5's.
        fresh = _loader()
        again = DataState(client, stateful(fresh))
        again.bind()
        again.restore(4, required=True)
        it = iter(fresh)
        assert torch.equal(next(it)[0], drawn[4]), "not iteration 4's batch"
        assert torch.equal(next(it)[0], drawn[5]), "not iteration 5's batch"


class _Counter:
    """A sampler-like object: its whole state is a position."""

    def __init__(self):
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def test_the_records_parity_is_the_codecs_and_rebuilds_a_lost_page(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as client:
        client.localize()
        c = _Counter()
        state = DataState(client, [c])
        state.bind()
        for t in range(3):
            c.pos = 1000 + t
            state.write(t)
        # The reference twin: the pool's own encoder over each record's group.
        for g in client.layout():
            if any(m[0] in NAMES for m in g.members):
                assert client._code(g).verify(g.data, torch.stack(g.tier1), torch.stack(g.tier2)), (
                    f"group {g.gid}: the record's parity is not the codec's"
                )
    with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
        f.inject_loss("data", NAMES[0], [0])  # slot 0 holds iteration 2's record
    with PoolClient.connect(pool.socket_path, pool.token) as client:
        report = client.localize()
        c = _Counter()
        state = DataState(client, [c])
        state.bind()
        client.reconstruct(report)
        state.restore(3, required=True)
        assert c.pos == 1002, f"rebuilt record gave position {c.pos}"


def test_absent_torn_and_oversized_records_and_stateless_data(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as client:
        client.localize()
        c = _Counter()
        state = DataState(client, [c])
        state.bind()
        state.restore(0, required=False)  # a fresh start: nothing recorded, nothing loaded
        assert c.pos == 0
        with pytest.raises(FatalFailure, match="not in the data record"):
            state.restore(5, required=True)
        c.pos = 5
        state.write(4)
        state.records[0][30] ^= 0xFF  # a write torn by a crash: fails its CRC
        assert state.read(4) is None
        c.pos = "x" * state.capacity
        with pytest.raises(InvalidInput, match=r"pickles to \d+ bytes; the data record holds"):
            state.write(5)
    with pytest.raises(InvalidInput, match="StatefulDataLoader is a drop-in"):
        stateful(torch.utils.data.DataLoader(torch.arange(4)))
