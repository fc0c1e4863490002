"""Megatron's loss scaler (fp16: its ``DynamicGradScaler``, or a constant one) as
``leto.Run`` takes torch's ``GradScaler``: each iteration's skip (inf/NaN gradients: the
update does not run) noted as Megatron decides it, and the scaler's state retained with
the loop's (``leto.trainer.loop_state``).

Runs in a trainer, made by ``leto.Run`` where the script gave it Megatron's optimizer
with a loss scaler. Megatron's ``step()`` first prepares the gradients
(``prepare_grads``: copied to the main ones, unscaled, checked for inf/NaN — all-reduced
over its groups — and the scaler updated), and only then, when none was found, clips and
runs the inner torch optimizers' step, which is Leto's update. So unlike torch's
``GradScaler``, whose ``update()`` comes after the step, Megatron's scaler has already
moved when the update's step record is written: the record takes the state as it was
before ``prepare_grads`` (the iteration's start, what ``LoopState`` keeps in a step
record), and an end record (every step skipped) the state after it (the start of the
next iteration). A recovery that rebuilds an iteration's start from the record before it
replays Megatron's own ``update(found_inf=False)`` on a copy (``grown``).

Not covered: a chained optimizer whose parts disagree about inf/NaN (Megatron's own
ChainedOptimizer skips every part when any found one; so does Leto).
"""

from __future__ import annotations

import copy

import torch

from leto.errors import InvalidInput


class MegatronLossScaler:
    def __init__(self, outer: list, on_prepared):
        """``outer``: the optimizers the script calls ``step()`` on (Megatron's); each
        part with a ``grad_scaler`` is followed. ``on_prepared(found_inf)``: called once
        an iteration's gradients are prepared (the skip is known)."""
        self.scalers = [
            part.grad_scaler
            for opt in outer
            for part in getattr(opt, "chained_optimizers", [opt])
            if getattr(part, "grad_scaler", None) is not None
        ]
        self.on_prepared = on_prepared
        self.found_inf: bool | None = None  # this iteration's, once prepared
        self._before: list[dict] | None = None  # the scalers as the iteration began
        for opt in outer:
            self._watch(opt)

    def _watch(self, opt) -> None:
        orig = opt.prepare_grads

        def prepare_grads(*args, **kwargs):
            before = self._state()
            found = bool(orig(*args, **kwargs))
            self._before, self.found_inf = before, found
            self.on_prepared(found)
            return found

        opt.prepare_grads = prepare_grads  # Megatron's step() calls self.prepare_grads()

    def begin(self) -> None:
        """An iteration starts: nothing prepared yet."""
        self.found_inf, self._before = None, None

    def _state(self) -> list[dict]:
        out = []
        for sc in self.scalers:
            sd = dict(sc.state_dict())
            if "scale" in sd:  # a float32 device tensor of one element
                sd["scale"] = float(sd["scale"].reshape(-1)[0].item())
            out.append(sd)
        return out

    def state_dict(self) -> list[dict]:
        """The scalers at the iteration's start when its update runs (a step record),
        else as they are (an end record, or between iterations)."""
        if self.found_inf is False and self._before is not None:
            return copy.deepcopy(self._before)
        return self._state()

    def load_state_dict(self, state: list[dict]) -> None:
        if len(state) != len(self.scalers):
            raise ValueError(
                f"a record of {len(state)} Megatron loss scaler(s) for {len(self.scalers)}"
            )
        for sc, sd in zip(self.scalers, state, strict=True):
            sc.load_state_dict(_tensors(sc, sd))

    def grown(self, state: list[dict]) -> list[dict]:
        """The state after an iteration whose gradients held no inf/NaN: Megatron's own
        ``update(False)`` on a copy of each scaler (its float32 arithmetic)."""
        out = []
        for sc, sd in zip(self.scalers, state, strict=True):
            twin = copy.deepcopy(sc)
            twin.load_state_dict(_tensors(twin, sd))
            twin.update(False)
            got = dict(twin.state_dict())
            if "scale" in got:
                got["scale"] = float(got["scale"].reshape(-1)[0].item())
            out.append(got)
        return out


def _tensors(sc, sd: dict) -> dict:
    sd = dict(sd)
    if "scale" in sd:
        sd["scale"] = torch.tensor([sd["scale"]], dtype=torch.float32, device=sc.scale.device)
    return sd


def of(outer: list, on_prepared) -> MegatronLossScaler | None:
    """The loss scaler of Megatron's optimizers ``outer``, or None where none scales.
    Several of them scaling, each deciding its own skip, is refused: Leto's update is
    one transaction (Megatron-LM's get_megatron_optimizer gives one, chained)."""
    scaling = [
        opt
        for opt in outer
        if any(
            getattr(part, "grad_scaler", None) is not None
            for part in getattr(opt, "chained_optimizers", [opt])
        )
    ]
    if len(scaling) > 1:
        raise InvalidInput(
            f"leto.Run: {len(scaling)} Megatron optimizers scale the loss (fp16), each "
            "deciding its own skips: give leto.Run one (get_megatron_optimizer chains the "
            "model's parts into one); nothing was retained"
        )
    return MegatronLossScaler(outer, on_prepared) if scaling else None
