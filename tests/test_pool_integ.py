"""Multi-process tests of the Resilient Memory Pool on the CPU build.

A real state-manager process serves real trainer processes; "device" pages are memfds
and page loss uses the emulation that ``faultkit probe`` names on this machine. Every
comparison is bit-exact on bytes.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from leto.erasure import TooManyErasures
from leto.memory.client import PoolClient
from leto.memory.config import AllocationKind
from leto.memory.errors import (
    AllocationMismatch,
    FencedError,
    PoolAuthError,
    PoolError,
    PoolOwnedError,
)
from leto.memory.launch import private_dir, start_state_manager
from leto.proc import alive
from tests.pool_helpers import (
    PAGE,
    child_fill_then_scribble,
    child_hold_pool,
    pattern,
    small_config,
)

pytestmark = pytest.mark.integ  # a state manager process per test

SPAWN = mp.get_context("spawn")


@pytest.fixture
def pool():
    sm = start_state_manager(small_config())
    yield sm
    assert sm.stop() == 0, "state manager did not shut down cleanly"
    assert not sm.socket_path.exists(), "socket left behind after shutdown"


def test_reattach_after_sigkill_mid_write_keeps_every_byte(pool):
    n = 37 * PAGE + 123
    ready = SPAWN.Event()
    child = SPAWN.Process(
        target=child_fill_then_scribble, args=(str(pool.socket_path), pool.token, n, 5, ready)
    )
    child.start()
    assert ready.wait(60), "child trainer never filled its state"
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert child.exitcode == -signal.SIGKILL
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        assert c.epoch == 2, f"successor got epoch {c.epoch}"
        state = c.attach("state", n)
        assert torch.equal(state, pattern(n, 5)), (
            "retained bytes changed across the trainer's death"
        )
        scratch = c.attach("scratch", n)
        # The kill landed inside fill_: every byte holds one of the values written.
        assert int(scratch.max()) <= 250


def _fill_and_protect(c: PoolClient, allocations: dict[str, int]) -> dict[str, torch.Tensor]:
    want = {}
    for seed, (name, n) in enumerate(allocations.items()):
        t = c.attach(name, n)
        t.copy_(pattern(n, seed))
        want[name] = t.clone()
    marker = c.attach("marker", 100, kind=AllocationKind.RECORD)
    marker.copy_(pattern(100, 99))
    want["marker"] = marker.clone()
    c.attach("activations", 3 * PAGE, kind=AllocationKind.REUSABLE).fill_(3)
    c.encode_parity()
    return want


def test_lose_h1_pages_per_group_plus_tier1_pages_then_rebuild_bit_exact(pool):
    allocs = {"params": 20 * PAGE, "adam.m": 12 * PAGE + 7}  # 33 pages: groups 0, 1, 2
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        want = _fill_and_protect(c, allocs)
        groups = {g.gid: g.kind for g in c.layout()}
    assert [k for k in groups.values()].count("state") == 3
    with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
        f.inject_loss("data", "params", [0, 5, 6, 15])  # 4 = H1 pages of group 0
        f.inject_loss("tier1", 0, [2])  # and a tier-1 page of group 0: tier 2 rebuilds it
        f.inject_loss("data", "params", [16, 19])  # group 1 (pages 16.. of params)
        f.inject_loss("data", "adam.m", [0, 11, 12])  # 2 more in group 1, 1 in group 2
        f.inject_loss("tier2", 2, [0])
        f.inject_loss("data", "activations", [1])
        f.inject_loss("data", "marker", [0])
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        report = c.localize()
        assert report["allocations"]["params"]["failed_pages"] == [0, 5, 6, 15, 16, 19]
        assert report["groups"]["0"] == {"data": [0, 5, 6, 15], "tier1": [2], "tier2": []}
        assert report["allocations"]["activations"]["failed_pages"] == [1]
        assert (
            "memfd truncation" in report["mechanism"]["host"]
            or "HWPOISON" in report["mechanism"]["host"]
        )
        for name, n in allocs.items():
            c.attach(name, n)
        c.attach("marker", 100, kind=AllocationKind.RECORD)
        c.attach("activations", 3 * PAGE, kind=AllocationKind.REUSABLE)
        summary = c.reconstruct(report)
        assert (summary["data_pages"], summary["tier1_pages"], summary["tier2_pages"]) == (
            4 + 4 + 1 + 1,
            1,
            1,
        )
        for name, n in allocs.items():
            got = c.attach(name, n)
            diff = (got != want[name]).nonzero()
            assert diff.numel() == 0, f"{name} differs first at byte {int(diff[0])}"
        assert torch.equal(c.attach("marker", 100, kind=AllocationKind.RECORD), want["marker"])
        assert torch.equal(
            c.attach("activations", 3 * PAGE, kind=AllocationKind.REUSABLE)[PAGE : 2 * PAGE],
            torch.zeros(PAGE, dtype=torch.uint8),
        ), "a replaced reusable page must read as zeros"
        status = c.status()
        assert (status["failed_pages_total"], status["rebuilt_pages_total"]) == (13, 12)
        assert all(not any(g["pending"].values()) for g in status["groups"])
        # Parity stayed consistent: a second rebuild of other pages works too.
        for g in c.layout():
            assert c._code(g).verify(g.data, torch.stack(g.tier1), torch.stack(g.tier2))


def test_pending_marks_survive_a_trainer_that_dies_before_rebuilding(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        want = _fill_and_protect(c, {"w": 5 * PAGE})
    with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
        f.inject_loss("data", "w", [3])
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        assert c.localize()["groups"]["0"]["data"] == [3]
        # ... and this trainer dies without reconstructing.
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        report = c.localize()
        assert report["groups"]["0"]["data"] == [3], (
            "the successor must still see the unrebuilt page"
        )
        w = c.attach("w", 5 * PAGE)
        c.attach("marker", 100, kind=AllocationKind.RECORD)
        c.attach("activations", 3 * PAGE, kind=AllocationKind.REUSABLE)
        c.reconstruct(report)
        assert torch.equal(w, want["w"])


def test_more_than_h1_lost_pages_is_the_named_fatal_error(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        _fill_and_protect(c, {"w": 16 * PAGE})
    with PoolClient.connect(pool.socket_path, pool.token, role="faultkit") as f:
        f.inject_loss("data", "w", [0, 1, 2, 3, 4])  # H1 + 1
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        report = c.localize()
        c.attach("w", 16 * PAGE)
        c.attach("marker", 100, kind=AllocationKind.RECORD)
        c.attach("activations", 3 * PAGE, kind=AllocationKind.REUSABLE)
        with pytest.raises(TooManyErasures) as info:
            c.reconstruct(report)
        assert info.value.group == 0 and info.value.erased == 5 and info.value.tolerance == 4
        assert "protection group 0" in str(info.value)
        assert c.status()["groups"][0]["pending"]["data"] == [0, 1, 2, 3, 4], (
            "fatal groups stay marked"
        )


def test_a_live_trainer_is_fenced_only_on_takeover(pool):
    ready = SPAWN.Event()
    child = SPAWN.Process(target=child_hold_pool, args=(str(pool.socket_path), pool.token, ready))
    child.start()
    assert ready.wait(60)
    with pytest.raises(PoolOwnedError, match=f"PID {child.pid} owns the pool"):
        PoolClient.connect(pool.socket_path, pool.token)
    with PoolClient.connect(pool.socket_path, pool.token, takeover=True) as c:
        child.join(10)
        assert child.exitcode == -signal.SIGKILL, (
            "the fenced trainer must be dead before the successor owns the pool"
        )
        assert c.epoch == 2
        assert int(c.attach("held", PAGE).sum()) == PAGE


def test_a_stale_epoch_is_refused(pool):
    old = PoolClient.connect(pool.socket_path, pool.token)
    new = PoolClient.connect(pool.socket_path, pool.token)  # same process: no kill needed
    try:
        assert (old.epoch, new.epoch) == (1, 2)
        with pytest.raises(FencedError, match="epoch 1 is stale"):
            old.attach("x", PAGE)
        assert new.attach("x", PAGE).numel() == PAGE
    finally:
        old.close()
        new.close()


def test_reattach_with_another_size_is_refused_and_changes_nothing(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        c.attach("w", 3 * PAGE).fill_(9)
        with PoolClient.connect(pool.socket_path, pool.token) as other:
            with pytest.raises(AllocationMismatch, match="exists as protected of 24576 bytes"):
                other.attach("w", 4 * PAGE)
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        assert int(c.attach("w", 3 * PAGE).sum()) == 9 * 3 * PAGE


def test_more_descriptors_than_one_message_carries(pool):
    n = 600 * PAGE  # 600 fds: three SCM_RIGHTS batches
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        t = c.attach("big", n)
        t.copy_(pattern(n, 1))
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        assert torch.equal(c.attach("big", n), pattern(n, 1))


def test_socket_and_directory_are_private(pool):
    assert stat.S_IMODE(pool.socket_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(pool.socket_path.stat().st_mode) == 0o600


def test_wrong_token_is_refused(pool):
    with pytest.raises(PoolAuthError, match="wrong job token"):
        PoolClient.connect(pool.socket_path, "not-the-token")


def test_faultkit_role_is_needed_to_inject(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        c.attach("w", PAGE)
        with pytest.raises(PoolAuthError, match="faultkit role required"):
            c.inject_loss("data", "w", [0])


def test_another_user_cannot_connect(pool):
    if os.geteuid() != 0:
        pytest.fail(
            "this test drops privileges and needs root (CI and the dev machines run as root)"
        )
    code = (
        "import os, socket, sys\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "try:\n s.connect(sys.argv[1])\nexcept PermissionError:\n sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(pool.socket_path)], timeout=30)
    assert r.returncode == 0, "a process of another user reached the state manager's socket"


def test_state_manager_refuses_a_shared_directory(tmp_path):
    d = tmp_path / "shared"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    with pytest.raises(Exception, match="did not report READY"):
        start_state_manager(small_config(), socket_dir=d, timeout_s=20)


def test_leto_pool_status_cli(pool):
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        c.attach("w", 20 * PAGE)
    env = dict(os.environ, LETO_POOL_TOKEN=pool.token)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "leto.cli",
            "pool",
            "status",
            "--socket-dir",
            str(pool.socket_dir),
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["allocations"][0]["name"] == "w" and status["allocations"][0]["pages"] == 20
    assert [g["data_pages"] for g in status["groups"]] == [16, 4]
    table = subprocess.run(
        [sys.executable, "-m", "leto.cli", "pool", "status", "--socket-dir", str(pool.socket_dir)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert table.returncode == 0 and "protection groups" in table.stdout


def test_state_manager_survives_many_trainer_deaths(pool):
    for i in range(5):
        ready = SPAWN.Event()
        child = SPAWN.Process(
            target=child_fill_then_scribble,
            args=(str(pool.socket_path), pool.token, 3 * PAGE, i, ready),
        )
        child.start()
        assert ready.wait(60)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
    assert pool.proc.poll() is None
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        assert torch.equal(c.attach("state", 3 * PAGE), pattern(3 * PAGE, 4))


def test_private_dir_helper_is_0700():
    d = private_dir()
    try:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    finally:
        d.rmdir()


def test_model_parameters_attach_by_name_from_a_meta_device_model(pool):
    def build():
        with torch.device("meta"):
            return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))

    meta = build()
    torch.manual_seed(0)
    real = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    x = torch.randn(5, 64)
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        for name, p in meta.named_parameters():
            c.attach_like(f"param/{name}", p).copy_(dict(real.named_parameters())[name].detach())
    # A new trainer rebuilds the module on the meta device and binds retained memory.
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        model = build()
        for name, p in list(model.named_parameters()):
            module_name, _, attr = name.rpartition(".")
            retained = c.attach_like(f"param/{name}", p)
            assert retained.dtype == p.dtype and retained.shape == p.shape
            setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(retained))
        with torch.no_grad():
            assert torch.equal(model(x), real(x))


def test_allocation_sets_keep_each_unit_inside_one_group(pool):
    # D = 16 and units of 1 + 2 + 2 pages: 3 units per group (15 pages), 7 units.
    names, nbytes, unit = ["p", "m", "v"], [7 * PAGE, 14 * PAGE - 5, 13 * PAGE], [1, 2, 2]
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        c.attach("before", PAGE)  # an ordinary allocation: its group is not shared
        reply = c.attach_set(names, nbytes, unit)
        assert (reply.units, reply.units_per_group, reply.first_group) == (7, 3, 1)
        groups = {g.gid: g for g in c.layout()}
        assert [len(groups[g].data) for g in (1, 2, 3)] == [15, 15, 5]
        for n, b in zip(names, nbytes, strict=True):
            c.attach(n, b).fill_(ord(n[0]))
        g1 = groups[1].data
        # unit 1 of group 1 = p page 1, m pages 2..3, v pages 2..3: consecutive in the group
        assert [int(x[0]) for x in g1[5:10]] == [ord("p"), ord("m"), ord("m"), ord("v"), ord("v")]
        c.attach("after", PAGE)
        assert [g.gid for g in c.layout()][-1] == 4, "a later allocation must open a new group"
    with PoolClient.connect(pool.socket_path, pool.token) as c:
        with pytest.raises(AllocationMismatch, match="differs from what exists"):
            c.attach_set(names, [7 * PAGE, 14 * PAGE, 13 * PAGE], unit)
        again = c.attach_set(names, nbytes, unit)
        assert again.first_group == 1 and int(c.attach("m", nbytes[1])[0]) == ord("m")


def test_a_stopped_state_manager_leaves_no_socket_directory():
    from leto.memory.launch import start_state_manager
    from tests.pool_helpers import small_config

    sm = start_state_manager(small_config())
    d = sm.socket_dir
    assert d.is_dir() and d.name.startswith("leto-pool-"), d
    sm.stop()
    assert not d.exists(), f"{d} was left behind"


def test_a_state_manager_outlives_no_launcher_killed_outright():
    """A launcher SIGKILLed (no clean-up runs) closes the manager's lifeline: the manager
    stops and removes its socket directory instead of holding the pool forever."""
    code = (
        "import sys, time\n"
        "from leto.memory.launch import start_state_manager\n"
        "from tests.pool_helpers import small_config\n"
        "sm = start_state_manager(small_config())\n"
        "print(sm.pid, sm.socket_dir, flush=True)\n"
        "time.sleep(60)\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid, d = launcher.stdout.readline().split()
    pid, d = int(pid), Path(d)
    assert d.is_dir()
    launcher.kill()
    launcher.wait(10)
    launcher.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (alive(pid) or d.exists()):
        time.sleep(0.05)
    assert not alive(pid), "the state manager outlived its SIGKILLed launcher"
    assert not d.exists(), f"{d} was left behind"


def test_a_first_trainer_connects_while_its_state_manager_starts():
    # leto run starts the first trainers beside their state managers: the trainer's
    # connect (starting=True) waits for the socket; the launcher waits for READY after.
    sm = start_state_manager(small_config(), wait=False)
    try:
        with PoolClient.connect(sm.socket_path, sm.token, starting=True, timeout_s=30) as c:
            assert int(c.attach("w", PAGE).count_nonzero()) == 0
            # (a fresh interpreter listens after ~0.1 s: the wait is measured, and said)
            assert c.waited_s > 0
        sm.wait_ready()
        with PoolClient.connect(sm.socket_path, sm.token, starting=True, timeout_s=30) as c:
            assert c.waited_s == 0.0  # listening already: no wait
    finally:
        assert sm.stop() == 0


def test_a_state_manager_that_never_listens_is_a_clear_error_either_way(tmp_path):
    path = tmp_path / "pool.sock"
    t0 = time.monotonic()
    with pytest.raises(PoolError, match="no state manager at .* within 0.3 s"):
        PoolClient.connect(path, "token", starting=True, timeout_s=0.3)
    assert 0.25 <= time.monotonic() - t0 < 5
    with pytest.raises(PoolError, match="no state manager at"):  # not starting: at once
        PoolClient.connect(path, "token", timeout_s=30)
