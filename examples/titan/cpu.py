"""torchtitan (0.2) on a CPU, for tests: ``import cpu`` before torchtitan is imported.

torchtitan runs on accelerators only: it takes its device type from torch (none on a
CPU build, so "cuda") and asks that device's module for its name, memory statistics
and current index. After this import it is told the CPU is its device and given those
answers (no memory statistics: its memory line reads 0). An emulation for a CPU
machine, world 1 only: FSDP2's gradient reduce-scatter over gloo needs PREMUL_SUM,
which gloo lacks. On a GPU nothing of this is needed or done (``debug_job.py`` imports
it only where torch sees no GPU)."""

import os
import types

import torch
import torch._utils
import torch.cpu

if torch.cuda.is_available():
    raise RuntimeError("examples/titan/cpu.py is for machines without a GPU")
torch._utils._get_available_device_type = lambda: "cpu"
cpu = torch.cpu
cpu.get_device_name = lambda *a: "cpu"
cpu.get_device_properties = lambda *a: types.SimpleNamespace(
    name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
)
cpu.current_device = lambda: 0
cpu.reset_peak_memory_stats = lambda *a: None
cpu.empty_cache = lambda: None
cpu.memory_stats = lambda *a: {}
