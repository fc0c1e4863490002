"""leto.integrity.replica without processes: the parity digest against its slow twin, that
a single flipped bit of data or parity changes it, which ranks a disagreement names,
and what ``ReplicaCheck.check`` raises and logs (the collective stood in for).

The multi-process path — faultkit's ``sdc-update`` detected, named and EXACT under
``leto run`` — is ``test_sdc_update_is_detected_in_its_iteration_and_ends_exact`` in
tests/test_faultkit_inject.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from leto.erasure import ReedSolomon
from leto.errors import FatalFailure
from leto.integrity import replica
from leto.integrity.replica import ReplicaDisagreement, group_digest, group_digest_reference


def random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("words", [1, 2, 7, 4096])
def test_digest_matches_its_slow_twin_including_wrapping_sums(words):
    raw = random_bytes(8 * words, words)
    assert int(group_digest(raw)) == group_digest_reference(raw)
    ones = torch.full((8 * words,), 0xFF, dtype=torch.uint8)  # every word -1: wraps below
    assert int(group_digest(ones)) == group_digest_reference(ones) == -words


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 64), st.integers(0, 2**31), st.data())
def test_one_flipped_parity_bit_changes_the_digest(words, seed, data):
    raw = random_bytes(8 * words, seed)
    byte = data.draw(st.integers(0, 8 * words - 1))
    bit = data.draw(st.integers(0, 7))
    flipped = raw.clone()
    flipped[byte] ^= 1 << bit
    assert int(group_digest(flipped)) != int(group_digest(raw)), (byte, bit)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 16), st.integers(1, 8), st.integers(0, 2**31), st.data())
def test_one_flipped_data_bit_changes_the_groups_parity_digest(d, h, seed, data):
    # What the check relies on: replicas with equal pages have equal parity, and one
    # wrong bit in a data page (absorbed into consistent parity) changes the digest.
    page_bytes = 64
    pages = random_bytes(d * page_bytes, seed).view(d, page_bytes)
    rs = ReedSolomon(d, h)
    same = rs.encode(pages.clone())
    parity = rs.encode(pages)
    assert torch.equal(same, parity)
    assert int(group_digest(same.reshape(-1))) == int(group_digest(parity.reshape(-1)))
    wrong = pages.clone()
    wrong[data.draw(st.integers(0, d - 1)), data.draw(st.integers(0, page_bytes - 1))] ^= 1 << (
        data.draw(st.integers(0, 7))
    )
    other = rs.encode(wrong)
    assert int(group_digest(other.reshape(-1))) != int(group_digest(parity.reshape(-1)))


def test_suspects_name_the_minority_or_every_rank_without_a_majority():
    a, b = (1, 2), (1, 3)
    assert replica.suspects([a, a]) == ([], True)
    assert replica.suspects([a]) == ([], True)
    assert replica.suspects([a, a, b]) == ([2], True)
    assert replica.suspects([b, a, a, a]) == ([0], True)
    assert replica.suspects([a, b]) == ([0, 1], False)  # world 2: one against one
    assert replica.suspects([a, a, b, b]) == ([0, 1, 2, 3], False)


def _check(monkeypatch, tmp_path, rank: int, rows: list[list[int] | None], flags=None):
    """``ReplicaCheck.check`` on ``rank`` with the all_gather standing in: it hands back
    ``rows`` (one per rank; None: a rank without digests, zeros marked invalid), each
    with whether it had them and its rank's loss-guard flag after it, as gloo would."""
    monkeypatch.setattr(replica.dist, "new_group", lambda **kw: None)
    flags = flags or [0] * len(rows)
    n = max(len(r) for r in rows if r is not None)

    def words(r, f):
        return torch.tensor([*(r if r is not None else [0] * n), int(r is not None), f])

    def all_gather(out, mine, group=None):
        assert torch.equal(mine, words(rows[rank], flags[rank])), "this rank's words are sent"
        for o, r, f in zip(out, rows, flags, strict=True):
            o.copy_(words(r, f))

    monkeypatch.setattr(replica.dist, "all_gather", all_gather)
    log = tmp_path / f"rank{rank}.replica.jsonl"
    rc = replica.ReplicaCheck(rank, len(rows), log=log)
    return rc, log


def test_agreeing_replicas_pass_and_log_nothing(monkeypatch, tmp_path):
    rc, log = _check(monkeypatch, tmp_path, 1, [[5, -7], [5, -7], [5, -7]])
    rc.check(3, torch.tensor([5, -7]), gids=[0, 1])
    assert rc.checks == 1 and not log.exists()


def test_a_minority_rank_is_named_and_the_iteration_is_fatal(monkeypatch, tmp_path):
    rc, log = _check(monkeypatch, tmp_path, 0, [[5, -7], [5, -7], [5, 8]])
    with pytest.raises(ReplicaDisagreement, match=r"iteration 3: .*group\(s\) \[11\].*\[2\]") as e:
        rc.check(3, torch.tensor([5, -7]), gids=[10, 11])
    assert isinstance(e.value, FatalFailure), "the runtime's fatal path: checkpoint fallback"
    (rec,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert rec["iteration"] == 3 and rec["named"] == [2] and rec["majority"], rec
    assert rec["groups"] == [11], rec


def test_a_data_parallel_group_names_its_ranks_by_their_global_numbers(monkeypatch, tmp_path):
    # Tensor x data parallel (Megatron): the replicas of tensor-parallel position 1 are
    # global ranks 1, 3 and 5 of a world of 6; the gather runs over their group only.
    _check(monkeypatch, tmp_path, 0, [[5, -7], [5, -7], [5, 8]])
    rc = replica.ReplicaCheck(
        3, 6, log=tmp_path / "g.jsonl", pg="their gloo group", members=(1, 3, 5)
    )
    assert rc.world == 3 and rc.pg == "their gloo group"
    with pytest.raises(
        ReplicaDisagreement, match=r"rank\(s\) \[5\] disagree with the majority of the 3"
    ):
        rc.check(3, torch.tensor([5, -7]), gids=[10, 11])
    (rec,) = [json.loads(x) for x in (tmp_path / "g.jsonl").read_text().splitlines()]
    assert rec["named"] == [5], rec


def test_at_world_2_both_ranks_are_named_and_the_message_says_why(monkeypatch, tmp_path):
    rc, log = _check(monkeypatch, tmp_path, 1, [[1], [2]])
    with pytest.raises(ReplicaDisagreement, match="no majority names one") as e:
        rc.check(0, torch.tensor([2]), gids=[0])
    assert "the fallback's redo of iteration 0 will tell" in str(e.value)
    (rec,) = [json.loads(x) for x in log.read_text().splitlines()]
    assert rec["named"] == [0, 1] and not rec["majority"], rec
    assert rec["digests"] == [[1], [2]], rec


def test_at_world_2_the_fallbacks_redo_names_the_rank_that_computed_wrong(
    monkeypatch, tmp_path, capsys
):
    # Generation 0: rank 1's state differed after iteration 4 (no majority at world 2).
    rc, log = _check(monkeypatch, tmp_path, 0, [[3, 1], [3, 9]])
    with pytest.raises(ReplicaDisagreement):
        rc.check(4, torch.tensor([3, 1]), gids=[0, 1])
    # After the fallback a new trainer reads the log; iteration 3 passes (not pending),
    # then iteration 4 is redone and agrees with what rank 0 had: rank 1 is named.
    rc, log = _check(monkeypatch, tmp_path, 0, [[3, 1], [3, 1]])
    rc.check(3, torch.tensor([3, 1]), gids=[0, 1])
    assert len(log.read_text().splitlines()) == 1
    rc.check(4, torch.tensor([3, 1]), gids=[0, 1])
    last = json.loads(log.read_text().splitlines()[-1])
    assert last["resolved"] and last["iteration"] == 4 and last["named"] == [1], last
    assert "rank(s) [1] held different state" in capsys.readouterr().err
    # Resolved once: a third trainer reading the log has nothing pending.
    rc, log = _check(monkeypatch, tmp_path, 0, [[3, 1], [3, 1]])
    rc.check(4, torch.tensor([3, 1]), gids=[0, 1])
    assert len(log.read_text().splitlines()) == 2


def test_the_loss_guards_flag_travels_in_the_same_gather_and_names_its_ranks(monkeypatch, tmp_path):
    # Rank 2's loss was NaN: every rank learns it from the one all_gather, and the
    # digests (here differing too) are not judged — the caller fails the iteration.
    rc, log = _check(monkeypatch, tmp_path, 0, [[5, -7], [5, -7], [5, 8]], flags=[0, 0, 1])
    assert rc.check(3, torch.tensor([5, -7]), gids=[0, 1], flag=0) == [2]
    assert not log.exists()
    rc, _ = _check(monkeypatch, tmp_path, 1, [[5], [5]], flags=[1, 1])
    assert rc.check(3, torch.tensor([5]), gids=[0], flag=1) == [0, 1]
    rc, _ = _check(monkeypatch, tmp_path, 1, [[5], [5]])
    assert rc.check(3, torch.tensor([5]), gids=[0]) == []


def test_the_check_is_on_unless_leto_run_turned_it_off(monkeypatch):
    monkeypatch.delenv(replica.ENV_REPLICA_CHECK, raising=False)
    assert replica.enabled()
    monkeypatch.setenv(replica.ENV_REPLICA_CHECK, "0")
    assert not replica.enabled()


def test_a_disagreement_the_scrub_resolves_is_not_fatal(monkeypatch, tmp_path):
    # A wrong tier-1 page on one rank (harmless: the scrub repairs it) makes its digest
    # differ too: the ranks scrub the differing groups and compare again.
    rows = [[5, -7], [5, 9]]
    rc, log = _check(monkeypatch, tmp_path, 0, rows)
    asked = []

    def recheck(groups):
        asked.append(groups)
        rows[1] = [5, -7]  # what every rank's second all_gather returns: repaired
        return torch.tensor(rows[0])

    rc.check(2, torch.tensor([5, -7]), gids=[0, 1], recheck=recheck)
    assert asked == [[1]] and not log.exists()
    rows[1] = [5, 9]

    def still(groups):
        return torch.tensor(rows[0])  # the other rank's words still differ

    with pytest.raises(ReplicaDisagreement, match=r"group\(s\) \[1\], also after a scrub"):
        rc.check(3, torch.tensor([5, -7]), gids=[0, 1], recheck=still)


def test_a_rank_without_digests_compares_nothing_but_still_carries_flags(monkeypatch, tmp_path):
    # A trainer that took over mid-job has no unchecked update: it sends none, and the
    # replicas' digests (here differing) are not judged that once; flags still count.
    rc, log = _check(monkeypatch, tmp_path, 0, [[5, -7], None, [5, 8]])
    assert rc.check(3, torch.tensor([5, -7]), gids=[0, 1]) == [] and not log.exists()
    rc, log = _check(monkeypatch, tmp_path, 1, [[5, -7], None, [5, -7]], flags=[0, 0, 1])
    assert rc.check(3, None, gids=[0, 1]) == [2]


class _Replica:
    """Stands in for ReplicaCheck in RetainedTraining's deferral: records each check."""

    def __init__(self):
        self.got = []

    def check(self, t, digests, gids, recheck=None, flag=0):
        self.got.append((t, None if digests is None else digests.clone(), flag))
        return []


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_updates_digests_are_compared_before_the_next_update_changes_them(device):
    # The deferral (leto.trainer.retained): the digests of iteration 4's update are
    # copied in stream order (on a GPU: pinned, behind an event) and compared later, even
    # though the next update overwrites the device tensor they came from; a check with
    # nothing pending sends none.
    from types import SimpleNamespace

    from leto.trainer.retained import RetainedTraining as R

    up = SimpleNamespace(
        digests=torch.tensor([11, -3], dtype=torch.int64, device=device),
        digest_complete=True,
        groups=[SimpleNamespace(gid=0), SimpleNamespace(gid=1)],
    )
    from leto.trainer.dp_group import DPGroup

    job = SimpleNamespace(up=up, device=torch.device(device), replica=_Replica(), guard=None,
                          _unchecked=None, _recheck=None, dp=DPGroup.world(2))  # fmt: skip
    if device == "cuda":
        torch.cuda._sleep(50_000_000)  # the copy is queued behind work still running
    job._unchecked = (4, R._digests_copy(job), 0, 1.5)
    up.digests.fill_(7)  # the next update's digests, written in stream order after it
    R._check_replicas(job)
    R._check_replicas(job)
    (t, got, flag), (t2, none, _) = job.replica.got
    assert t == 4 and flag == 0 and got.device.type == "cpu"
    assert torch.equal(got, torch.tensor([11, -3])), got
    assert none is None and job._unchecked is None
    up.digest_complete = False  # an update a recovery finished: nothing to compare
    assert R._digests_copy(job) is None
