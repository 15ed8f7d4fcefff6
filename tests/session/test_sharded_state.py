"""The shards' cut of the run's state and how the headers say it (no processes: the cut is
computed from shapes; ``test_fsdp_groups.py`` runs real FSDP2 groups)."""

from __future__ import annotations

import pytest
import torch

from gradientmail import MemoryMailbox, Session, consensus
from gradientmail.errors import MailRejectedError, UnusableStateError
from gradientmail.session.chain import FragmentChain, RunCut, run_cut
from gradientmail.session.mail import Contribution, PendingHeader, StateHeader, metadata_of
from gradientmail.session.mail import encode as encode_state
from gradientmail.session.shards import per_shard, plan_for_run, shard_layout


def test_an_unsharded_header_is_as_it_always_was_and_a_sharded_one_says_its_shards():
    plain = StateHeader(version=3, learner="a", time=1.0, fragment=1, fragments=4).to_metadata()
    assert "shards" not in plain and plain["fragment"] == "1/4"
    sharded = StateHeader(version=3, learner="a", time=1.0, fragment=1, fragments=4, shards=2)
    assert StateHeader.from_metadata(sharded.to_metadata(), key="k").shards == 2
    line = Contribution(seq=0, step=0, samples=0, time=0.0)
    assert "shards" not in PendingHeader(learner="a", contribution=line).to_metadata()
    sharded_pending = PendingHeader(learner="a", contribution=line, fragment=3, fragments=4, shards=4).to_metadata()
    assert PendingHeader.from_metadata(sharded_pending, key="k").shards == 4


@pytest.mark.parametrize("shards", ["3", "0", "-1", "x", "5"])
def test_a_header_whose_shards_do_not_divide_its_fragments_is_unusable(shards):
    metadata = StateHeader(version=0, learner="a", time=1.0, fragment=0, fragments=4).to_metadata()
    metadata["shards"] = shards
    with pytest.raises(UnusableStateError, match="shards"):
        StateHeader.from_metadata(metadata, key="k")


def _sharded_run(box, model: torch.nn.Module, shards: int, count: int) -> None:
    """Bases of every fragment as a sharded group of ``shards`` ranks cuts ``model``."""
    plan = plan_for_run(model, RunCut(shards * count, shards))
    values = {name: t.detach().reshape(-1) for name, t in model.state_dict().items()}
    for fragment in plan.fragments:
        spec = {p.name: ((p.size,), None) for p in fragment.pieces}
        tensors = {p.name: values[p.name][p.start : p.stop] for p in fragment.pieces}
        FragmentChain(box, fragment.index, plan.run_count, spec, shards=shards).create_base(tensors, "g")


def test_the_plain_cut_of_a_sharded_run_follows_fully_shards_rows():
    # Linear(3, 5): weight rows 5 -> 3 + 2 (torch.chunk), bias 5 -> 3 + 2.
    plan = plan_for_run(torch.nn.Linear(3, 5), RunCut(fragments=2, shards=2))
    assert [[(p.name, p.start, p.stop) for p in f.pieces] for f in plan.fragments] == [
        [("weight", 0, 9), ("bias", 0, 3)],
        [("weight", 9, 15), ("bias", 3, 5)],
    ]
    assert (plan.run_count, plan.shards) == (2, 2)
    # An entry with fewer rows than shards: the last shard holds none of it.
    assert per_shard({"w": (1, 4), "b": (3,)}, 2, None) == 1


def test_every_rank_cuts_its_shard_into_as_many_fragments_whatever_its_size():
    # 10 rows over 3 shards: 4, 4, 2 rows of 20_000 values: the automatic count is the largest
    # shard's, the same on every rank; an asked count is clamped to the smallest shard's size.
    shapes = {"w": (10, 20_000)}
    assert per_shard(shapes, 3, None) == 5  # ceil(4 * 20_000 * 4 bytes / 64 KiB), at most 16
    assert per_shard(shapes, 3, 50) == 50
    assert per_shard({"w": (5, 2)}, 2, 8) == 4  # shard 1 holds 4 values
    assert per_shard({"w": (64, 64)}, 8, 1024) == 128  # 1,024 fragments in all, at most
    with pytest.raises(ValueError, match="holds nothing"):
        per_shard({"w": (1, 4)}, 2, None)


def test_consensus_loads_a_sharded_run_into_a_plain_model_whole():
    box = MemoryMailbox("test-shards-consensus")
    box.clear()
    torch.manual_seed(1)
    written = torch.nn.Linear(3, 5)
    _sharded_run(box, written, shards=2, count=2)
    assert run_cut(box) == RunCut(4, 2)
    loaded = torch.nn.Linear(3, 5)
    assert consensus(box, loaded) == {}  # bases only: no learner has folded yet
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, written.state_dict()[name])


def test_a_plain_learner_is_refused_by_a_sharded_run_and_nothing_is_written():
    box = MemoryMailbox("test-shards-refused")
    box.clear()
    _sharded_run(box, torch.nn.Linear(2, 2), shards=2, count=1)
    before = sorted(box.list(""))
    with pytest.raises(MailRejectedError, match="shard"):
        with Session(torch.nn.Linear(2, 2), mailbox=box, learner_id="plain", fragments=2):
            pass
    assert not [key for key in box.list("session/fragments/") if key not in before]


def test_a_plain_model_has_no_shard_layout():
    assert shard_layout(torch.nn.Linear(2, 2)) is None


def test_a_stored_sharded_version_round_trips(tmp_path):
    header = StateHeader(version=0, learner="a", time=1.0, fragment=1, fragments=2, shards=2)
    data = encode_state({"w": torch.zeros(2)}, header)
    assert metadata_of(data, "k")["shards"] == "2"
