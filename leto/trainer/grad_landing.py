"""How a parameter's gradient lands in the retained gradient buffer (issue 59).

Runs in the trainer (``RetainedTraining``). The retained gradients are views of one flat
buffer that the update reads and protects. Backward used to accumulate into those views:
the buffer zeroed at the iteration's start, then every parameter's first gradient
*added* to the zeros (read the buffer, read the gradient, write the buffer), where the
plain script's ``zero_grad(set_to_none=True)`` lets autograd keep the gradient it
computed and moves nothing. On an H100 (2026-12-06) at 1.07 B parameters that cost a
step 4.3 ms over the plain script's; copying each gradient into its view as it arrives
cost 2.2 ms (``bench.grad_landing``, in-process).

So where the script has set its gradients to None when the iteration begins (what
``zero_grad()`` does by default), only what no view covers is zeroed and no view is
attached: a hook on
each trainable parameter copies its first gradient of the iteration into its view as
autograd hands it over, and once autograd has stored it, the view becomes ``.grad``
again (later micro-batches accumulate into it in place, as before). A parameter no
backward reached is given its view, zeroed, before the update reads it (``finish``), as
the zeroed buffer gave it before. The copy is ``g + 0.0``, one read and one write like a
copy: the bytes the zeroed buffer got (0.0 + -0.0 is 0.0), which gradient replay's
digest and every earlier run assume. A script that keeps its gradients (``zero_grad
(set_to_none=False)``, or none at all) gets the views, zeroed, as before. Under Leto the
script's ``zero_grad(set_to_none=True)`` sets them to None (``release``), as torch does;
it zeroed the whole buffer in place before (and the iteration's start zeroed it again).

Not used for sharded parameters (FSDP2, tensor parallel: their gradients are DTensors
reduced into the retained shards) nor where a library sets the gradients itself
(Megatron's ``external_grads``). ``LETO_GRAD_LANDING=add`` turns it off.
"""

from __future__ import annotations

import os

import torch

ENV = "LETO_GRAD_LANDING"  # copy (default) or add (the views zeroed and added to)
LONG_GAP = 1 << 16  # elements: a gap zeroed by its own fill, not through the index
MAX_INDEXED = 1 << 20  # elements the index may hold (8 MiB of it); past it, a fill a gap


def wanted() -> bool:
    return os.environ.get(ENV, "copy") != "add"


class GradLanding:
    """The copy hooks on ``params``' trainable slots of ``state`` (a ``RetainedModel``).
    Install before any other post-accumulate hook that reads ``.grad``."""

    def __init__(self, params: dict[str, torch.nn.Parameter], state):
        self.state = state
        self.on = False  # this iteration's gradients land by copy
        self._released = False  # release() ran since the last begin()
        self._pairs: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        seen: set[int] = set()
        for slot in state.slots:
            p = params[slot.name]
            if not slot.trainable or id(p) in seen:  # tied: one parameter, one view
                continue
            seen.add(id(p))
            view = state.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self._pairs.append((p, view))
            p.register_hook(self._arrive(p, view))
            p.register_post_accumulate_grad_hook(self._stored(view))
        # What no trainable view covers (the alignment gaps, frozen parameters): zero in
        # the zeroed buffer, and read as zero by the update; nothing else writes it, but a
        # recovery marks lost gradient pages rebuilt without rebuilding them (they are
        # recomputed), and a corrupted byte there would be updated with: zeroed at every
        # iteration's start — small ranges by one indexed fill, long ones (a frozen
        # embedding) each by one fill.
        covered = sorted((s.offset, s.offset + s.numel) for s in state.slots if s.trainable)
        gaps, at = [], 0
        for a, b in covered:
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        if at < state.grad.numel():
            gaps.append((at, state.grad.numel()))
        short = [(a, b) for a, b in gaps if b - a < LONG_GAP]
        if sum(b - a for a, b in short) > MAX_INDEXED:  # (many small frozen parameters)
            short = []
        self._long = [g for g in gaps if g not in short]
        index = [torch.arange(a, b) for a, b in short]
        self._short = torch.cat(index).to(state.grad.device) if index else None

    def _arrive(self, p: torch.nn.Parameter, view: torch.Tensor):
        def hook(g: torch.Tensor) -> torch.Tensor:
            if self.on and p.grad is None:  # its first gradient of the iteration
                if g.layout is torch.strided:
                    torch.add(g, 0.0, out=view)  # (as into zeros: -0.0 lands as 0.0)
                else:  # a sparse gradient (an embedding's sparse=True)
                    view.zero_().add_(g)
            return g

        return hook

    def _stored(self, view: torch.Tensor):
        def hook(p: torch.nn.Parameter) -> None:
            g = p.grad
            if (
                self.on
                and g is not None
                and (g.layout is not torch.strided or g.data_ptr() != view.data_ptr())
            ):
                p.grad = view  # (autograd's own tensor is dropped: its memory is free)

        return hook

    def begin(self) -> bool:
        """At the iteration's start: True where every trainable gradient is None (the
        buffer is then not zeroed and the views not attached)."""
        released, self._released = self._released, False
        if not all(p.grad is None for p, _ in self._pairs):
            self.on = False
        elif not released:  # (release zeroed the gaps already since the last iteration)
            self._land()
        return self.on

    def release(self) -> None:
        """The script's ``zero_grad(set_to_none=True)``: every trainable gradient None, as
        torch leaves them, where it zeroed the whole buffer in place before; the next
        backward lands by copy (also when the script zeroes after the iteration began)."""
        for p, _ in self._pairs:
            p.grad = None
        self._land()
        self._released = True

    def _land(self) -> None:
        self.on = True
        grad = self.state.grad
        if self._short is not None:
            grad.index_fill_(0, self._short, 0)
        for a, b in self._long:
            grad[a:b].zero_()

    def finish(self) -> None:
        """Before the update reads the buffer: a parameter no backward reached gets its
        view, zeroed (a gradient of zeros, as the zeroed buffer gave it)."""
        if not self.on:
            return
        for p, view in self._pairs:
            if p.grad is None:
                view.zero_()
                p.grad = view
