"""Binding a model to retained memory keeps its meaning: tied parameters are retained
once and stay tied, frozen parameters are retained but never updated, and buffers Leto
cannot retain are refused by name — checked against the same model, optimizer and loop
in plain PyTorch, bit for bit."""

from __future__ import annotations

import pytest
import torch

from leto.memory.client import PoolClient
from leto.memory.launch import start_state_manager
from leto.update.layout import check_buffers
from leto.update.rmu import Updater, UpdaterConfig
from leto.update.user_optim import UserOptimizer
from tests.pool_helpers import small_config


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied, as LM heads are
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.frozen(self.emb(x))))).square().mean()


def init(model: Tied) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def data(t: int) -> torch.Tensor:
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(t))


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def test_tied_and_frozen_parameters_train_as_in_plain_pytorch():
    ref = Tied()
    init(ref)
    opt = optimizer(ref)
    for t in range(3):
        ref(data(t)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sm = start_state_manager(small_config(data_pages=8, tier1_pages=2))
    try:
        with PoolClient.connect(sm.socket_path, sm.token) as client:
            client.localize()
            with torch.device("meta"):
                model = Tied()
            names = {id(p): n for n, p in model.named_parameters()}
            mine = optimizer(model)
            up = Updater(client, model, None, UpdaterConfig(chunk_units=1),
                         user=UserOptimizer(mine, names))  # fmt: skip
            assert [s.name for s in up.state.slots] == [n for n, _ in ref.named_parameters()]
            assert model.head.weight is model.emb.weight, "tied parameters came apart"
            assert model.frozen.weight.grad is None and not model.frozen.weight.requires_grad
            up.initialize(lambda: init(model))
            for t in range(3):
                up.begin(t)
                model(data(t)).backward()
                up.hparams = up.user.hparams()
                up.protect_grads(t)
                up.sync(t)
                up.update(t)
            got = {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        sm.stop()
    for n, p in ref.named_parameters():
        assert torch.equal(got[n].view(torch.uint8), p.detach().view(torch.uint8)), n


def test_a_buffer_on_the_meta_device_is_refused_by_name():
    check_buffers(torch.nn.BatchNorm1d(4))  # persistent: leto.Run retains its statistics
    with torch.device("meta"):
        m = torch.nn.Linear(2, 2)
        m.register_buffer("table", torch.zeros(3), persistent=False)
    with pytest.raises(ValueError, match="buffer table is on the meta device"):
        check_buffers(m)
    ok = torch.nn.Linear(2, 2)
    ok.register_buffer("cache", torch.zeros(3), persistent=False)  # recomputed: fine
    check_buffers(ok)
