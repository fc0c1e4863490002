"""Megatron-Core on a CPU, for tests and CI: ``import cpu`` before megatron is imported.

Megatron-Core runs on CUDA only: it allocates on ``torch.cuda.current_device()`` and
``device="cuda"``, keeps its RNG tracker's states as CUDA generator states, and asserts
``'torch.cuda.FloatTensor'`` gradients before clipping. After this import, on a machine
without a GPU:

* every ``"cuda"`` (or device index) a tensor factory or ``.to``/``.cuda`` is given means
  the CPU (a torch function mode, on for the whole process);
* the "CUDA generator" Megatron's tracker forks is the CPU's default generator, which is
  what dropout draws from here (``torch.cuda.manual_seed``/``get_rng_state``/
  ``set_rng_state`` and the tracker's own state helpers);
* ``clip_grad_by_total_norm_fp32`` is Megatron's own, less its CUDA type assertion (the
  same arithmetic: ``local_multi_tensor_scale``), and a tensor's ``type()`` names the CUDA
  type (what Megatron's DistributedOptimizer sorts tensors by);
* streams, and waiting for the device (its pipeline's sends), are no-ops;
* the MoE router's ``te_general_gemm``, which megatron-core 0.16.1 leaves undefined
  without TransformerEngine, is None (its own check's meaning: torch's matmul).

An emulation for a CPU machine: the arithmetic is the CPU's, and on a GPU nothing of this
is needed or done (``gpt_leto.py``/``gpt_torchrun.py`` import it only where torch sees no
GPU). Both scripts take it alike, so a run under torchrun and one under ``leto run`` are
compared like for like.
"""

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode, _push_mode

if torch.cuda.is_available():
    raise RuntimeError("examples/megatron/cpu.py is for machines without a GPU")

CPU = torch.device("cpu")


def _cpu(device):
    if device is None:
        return None
    if isinstance(device, int) or (
        isinstance(device, (str, torch.device)) and "cuda" in str(device)
    ):
        return CPU
    return device


class CudaIsCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        name = getattr(func, "__name__", "")
        if name == "cuda":  # tensor.cuda()
            return args[0]
        if name == "to" and len(args) > 1 and not isinstance(args[1], (torch.Tensor, torch.dtype)):
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


# The CPU itself, not an index: Megatron's backward functions (a MoE's gathers) allocate
# on it where the function mode above no longer applies.
torch.cuda.current_device = lambda: CPU
torch.cuda.current_stream = lambda *a, **k: contextlib.nullcontext()
torch.cuda.synchronize = lambda *a, **k: None
torch.cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
_push_mode(CudaIsCpu())  # for the process: below any mode pushed later

from megatron.core.optimizer import clip_grads  # noqa: E402
from megatron.core.tensor_parallel import random as tp_random  # noqa: E402
from megatron.core.utils import local_multi_tensor_scale  # noqa: E402

tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
# The tracker warns when the CPU generator moved inside a fork of the "CUDA" one: here
# they are the same generator, so it always has.
logging.getLogger(tp_random.__name__).setLevel(logging.ERROR)


def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """Megatron's, less ``assert param.grad.type() == 'torch.cuda.FloatTensor'``."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for param in parameters:
        g = param.decoupled_grad if use_decoupled_grad else param.grad
        if g is not None:
            grads.append(clip_grads.to_local_if_dtensor(g).detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        local_multi_tensor_scale(2048 * 32, None, [grads, grads], clip_coeff)


clip_grads.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32
# (and where Megatron's optimizers bound it by name: their step() clips)
from megatron.core.optimizer import optimizer as _optimizers  # noqa: E402

_optimizers.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm_fp32

# Megatron's DistributedOptimizer and Float16 optimizers sort tensors by their type's name
# ('torch.cuda.FloatTensor', 'torch.cuda.BFloat16Tensor'): here a tensor answers with the
# CUDA name of its type.
_type = torch.Tensor.type


def _cuda_type(self, *args, **kwargs):
    if args or kwargs:
        return _type(self, *args, **kwargs)
    name = _type(self)
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


torch.Tensor.type = _cuda_type

# megatron-core 0.16.1's router reads ``te_general_gemm`` where TransformerEngine is not
# installed, where it was never defined (a NameError in the first MoE forward): None,
# which is what its own check means, so the router takes torch's matmul.
from megatron.core.transformer.moe import moe_utils  # noqa: E402

if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None
