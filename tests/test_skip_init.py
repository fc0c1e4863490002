"""A promoted trainer's model set-up (leto.trainer.skip_init): writes to parameters are
skipped and moves give uninitialized tensors, while buffers, flags, ties and the mode
stack come out as the script wrote them — and only where the pool holds the state."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from leto.job import keys
from leto.trainer import skip_init


class Tiny(nn.Module):
    """What model code does while it builds: init functions, a tie, a frozen part, a
    buffer computed from scratch, a loaded value."""

    def __init__(self, vocab=64, width=16, seq=8):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, width, 2) / width)))
        for p in self.parameters():
            if p.ndim >= 2:
                nn.init.trunc_normal_(p, std=0.02)
        self.norm.requires_grad_(False)  # frozen
        with torch.no_grad():
            self.fc.bias.copy_(torch.full_like(self.fc.bias, 0.5))  # "a checkpoint"


def _build(mode_on: bool):
    torch.manual_seed(0)
    mode = skip_init.SkipInit() if mode_on else None
    if mode is not None:
        torch.overrides._push_mode(mode)
    try:
        m = Tiny().to(torch.float64)
    finally:
        skip_init.stop(mode)
    return m, mode


def test_parameters_are_left_alone_and_everything_else_is_built_as_written():
    want, _ = _build(False)
    got, mode = _build(True)
    # every init function and write to a parameter: reset_parameters' (5), the script's
    # trunc_normal_ (2: the tie once) and its copy_ (1)
    assert mode.skipped >= 8 and mode.moved == len(list(got.parameters())), (mode.skipped, mode.moved)
    for (n, a), (_, b) in zip(want.named_buffers(), got.named_buffers(), strict=True):
        assert torch.equal(a, b), n  # computed, not skipped (and moved with a copy)
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad), n
    assert got.head.weight is got.wte.weight  # the tie survives the move
    assert not got.norm.weight.requires_grad
    # off again: a write to a parameter runs
    got.fc.bias.data.fill_(3.0)
    with torch.no_grad():
        got.fc.bias.add_(1.0)
    assert torch.equal(got.fc.bias, torch.full_like(got.fc.bias, 4.0))


def test_stop_inside_a_device_context_leaves_the_scripts_modes_in_place():
    mode = skip_init.SkipInit()
    torch.overrides._push_mode(mode)
    with torch.device("cpu"):
        before = len(_get_current_function_mode_stack())
        skip_init.stop(mode)
        stack = _get_current_function_mode_stack()
        assert mode not in stack and len(stack) == before - 1
        assert torch.empty(2).device.type == "cpu"
    assert mode not in _get_current_function_mode_stack()
    skip_init.stop(mode)  # twice: nothing more to do


class _Store:
    def __init__(self, keys_present=(), verdict=skip_init.SAFE):
        self.d = {k: b"1" for k in keys_present}
        if verdict is not None:
            self.d[keys.skip_init(0)] = verdict.encode()

    def check(self, ks):
        return all(k in self.d for k in ks)

    def get(self, k):
        return self.d[k]

    def set(self, k, v):
        self.d[k] = v.encode()


@pytest.mark.parametrize(
    "generation,present,verdict,on",
    [
        (1, [keys.pace(0, 0)], skip_init.SAFE, True),  # trained, and its set-up is safe
        (1, [], skip_init.SAFE, False),  # it died before its first iteration
        (0, [keys.pace(0, 0)], skip_init.SAFE, False),  # a first start
        (2, [keys.pace(0, 0)], skip_init.SAFE, False),  # only the generation just before
        (1, [keys.pace(0, 0)], "randint() drew ...", False),  # the active trainer saw a draw
        (1, [keys.pace(0, 0)], None, False),  # nothing observed
    ],
)
def test_only_a_pool_known_to_hold_the_state_and_a_safe_set_up_turn_it_on(
    generation, present, verdict, on, monkeypatch
):
    monkeypatch.delenv(skip_init.ENV_SKIP_INIT, raising=False)
    mode = skip_init.start(_Store(present, verdict), generation, 0)
    try:
        assert (mode is not None) == on
    finally:
        skip_init.stop(mode)


def test_it_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(skip_init.ENV_SKIP_INIT, "0")
    assert skip_init.start(_Store([keys.pace(0, 0)]), 1, 0) is None
    assert skip_init.observe() is None


def _observed(script) -> str:
    store = _Store(verdict=None)
    mode = skip_init.observe()
    try:
        script()
    finally:
        skip_init.stop(mode)
    assert mode.skipped == 0 and mode.moved == 0  # observing changes nothing
    return skip_init.publish(store, 0, mode)


def test_a_draw_from_the_global_generator_after_the_model_makes_skipping_unsafe(monkeypatch):
    monkeypatch.delenv(skip_init.ENV_SKIP_INIT, raising=False)

    def loader_leto():  # examples/porting/loader_leto.py's set-up: data drawn after the model
        torch.manual_seed(0)
        Tiny()
        torch.randint(0, 64, (16, 9))

    got = _observed(loader_leto)
    assert got.startswith("randint() drew from torch's global generator"), got


def test_draws_before_the_model_or_from_a_generator_of_its_own_keep_it_safe(monkeypatch):
    monkeypatch.delenv(skip_init.ENV_SKIP_INIT, raising=False)

    def script():
        torch.manual_seed(0)
        torch.randn(4)  # before the model: the same in every process
        Tiny()
        g = torch.Generator().manual_seed(1)
        torch.randperm(10, generator=g)  # a shuffle with its own generator

    assert _observed(script) == skip_init.SAFE


def test_a_parameter_the_retained_state_does_not_restore_makes_skipping_unsafe(monkeypatch):
    # (leto.Run, under Megatron's optimizer with its main copies: a frozen parameter has
    # no copy among them, so only the script's own initialization gives its value.)
    monkeypatch.delenv(skip_init.ENV_SKIP_INIT, raising=False)
    mode = skip_init.observe()
    try:
        torch.manual_seed(0)
        Tiny()  # a safe set-up: nothing drawn after the model
        skip_init.mark_unsafe(mode, "pos.weight is frozen")
        skip_init.mark_unsafe(mode, "a second reason")  # the first one stands
    finally:
        skip_init.stop(mode)
    assert skip_init.publish(_Store(verdict=None), 0, mode) == "pos.weight is frozen"
    skip_init.mark_unsafe(None, "no observation: nothing to mark")  # (a promoted trainer)


def test_nn_init_on_a_parameter_is_not_run():
    # 64 M parameters initialized on the CPU as GPT-2 does (1.5 s here without the mode):
    # nn.init's functions come to the mode with the tensor as a keyword.
    def build():
        lin = nn.Linear(8192, 8192, bias=False)
        nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2))
        return lin

    mode = skip_init.SkipInit()
    torch.overrides._push_mode(mode)
    try:
        build()
    finally:
        skip_init.stop(mode)
    assert mode.skipped == 2  # kaiming_uniform_'s uniform_ in reset_parameters, normal_


def test_an_observation_paused_over_leto_run_sees_only_the_scripts_draws(monkeypatch):
    monkeypatch.delenv(skip_init.ENV_SKIP_INIT, raising=False)
    mode = skip_init.observe()
    try:
        Tiny()
        skip_init.stop(mode)  # leto.Run begins: its own sampling is not the script's
        torch.randint(0, 8, (4,))
        skip_init.resume(mode)  # leto.Run is done: the script again
        assert mode.unsafe is None
        torch.rand(3)  # the script's draw between leto.Run and its loop
    finally:
        skip_init.stop(mode)
    assert mode.unsafe is not None and mode.unsafe.startswith("rand()"), mode.unsafe
