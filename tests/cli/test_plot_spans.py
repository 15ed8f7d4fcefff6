"""``gradientmail plot`` draws each unit from its first to its last batch (progress records'
``unit_spans``), falls back to claim times where there are none, and says which; the demo's bars
say what they show."""

from __future__ import annotations

import io
import itertools
import json
import uuid
from datetime import timedelta

import pytest
import torch

from gradientmail import LocalMailbox, MemoryMailbox, Session
from gradientmail.patterns.shared_queue import shared_queue
from gradientmail.plot import describe_spans, spans_from_run
from gradientmail.queue.unit_timing import BatchWatch, UnitTimes
from gradientmail.status import read_run

T0 = 1_700_000_000.0


def write_run(mailbox, *, spans: dict | None) -> None:
    """Two units claimed by node-A at t0 and t0 + 1 (claimed ahead), trained 5-7 and 7-10."""
    mailbox.put_if_absent("run.json", json.dumps({"units": 2, "created": T0}).encode())
    for index, claimed in enumerate((0.0, 1.0)):
        body = {
            "learner": "node-A",
            "token": f"t{index}",
            "host": "h",
            "pid": 1,
            "worker": 0,
            "claimed_at": T0 + claimed,
        }
        mailbox.put_if_absent(f"units/u{index}", json.dumps(body).encode())
    record = {
        "learner": "node-A",
        "steps": 8,
        "samples": 64,
        "started": T0,
        "last_seen": T0 + 10,
        "finished": True,
        "units": 2,
    }
    if spans is not None:
        record["unit_spans"] = spans
    mailbox.put("progress/node-A.json", json.dumps(record).encode())


KNOWN = {
    "recent": [
        {"unit": "u0", "first": T0 + 5, "last": T0 + 7, "batches": 4},
        {"unit": "u1", "first": T0 + 7, "last": T0 + 10, "batches": 4},
    ],
    "older": {"units": 0, "batches": 0, "busy_s": 0.0},
}


def test_plot_draws_units_from_first_to_last_batch():
    box = MemoryMailbox(f"plot-{uuid.uuid4().hex}")
    write_run(box, spans=KNOWN)
    spans = spans_from_run(read_run(box))
    assert [(s.unit, s.start - T0, s.end - T0, s.measured) for s in spans] == [
        ("u0", 5.0, 7.0, True),
        ("u1", 7.0, 10.0, True),
    ]
    assert describe_spans(spans) == "bars: first to last batch"


def test_plot_falls_back_to_claim_times_and_says_so():
    box = MemoryMailbox(f"plot-{uuid.uuid4().hex}")
    write_run(box, spans=None)
    spans = spans_from_run(read_run(box))
    assert [(s.unit, s.start - T0, s.end - T0, s.measured) for s in spans] == [
        ("u0", 0.0, 1.0, False),
        ("u1", 1.0, 10.0, False),
    ]
    assert describe_spans(spans).startswith("bars: claim to next claim")


def test_units_without_spans_keep_claim_bars_outside_the_measured_ones():
    box = MemoryMailbox(f"plot-{uuid.uuid4().hex}")
    write_run(box, spans={"recent": [KNOWN["recent"][1]]})  # u0 is older: summed up only
    spans = spans_from_run(read_run(box))
    assert [(s.unit, s.start - T0, s.end - T0, s.measured) for s in spans] == [
        ("u0", 0.0, 1.0, False),
        ("u1", 7.0, 10.0, True),
    ]
    assert describe_spans(spans) == (
        "bars: first to last batch (1), claim to next claim (1, units without batch times)"
    )


@pytest.mark.parametrize(
    "spans, problem",
    [
        ({"recent": [{"unit": "u0", "first": T0 + 7, "last": T0 + 5, "batches": 1}]}, "ends before"),
        ({"recent": [{"unit": "u0", "first": -1e300, "last": T0, "batches": 1}]}, "unix time"),
        ({"recent": "u0"}, "not a list"),
        ({"recent": [], "older": {"units": -1}}, "'older' field 'units'"),
    ],
)
def test_unusable_unit_spans_are_reported_not_drawn(spans, problem):
    box = MemoryMailbox(f"plot-{uuid.uuid4().hex}")
    write_run(box, spans=spans)
    run = read_run(box)
    assert [u.key for u in run.unreadable] == ["progress/node-A.json"]
    assert "unit_spans" in run.unreadable[0].problem and problem in run.unreadable[0].problem
    assert run.unit_spans == {}
    assert not any(s.measured for s in spans_from_run(run))


def test_unit_times_keep_recent_units_one_by_one_and_sum_up_older_ones():
    times = UnitTimes(keep=2)
    for index, unit in enumerate(["a", "b", "c"]):
        times.add(unit, T0 + index, T0 + index + 0.5)
    times.add("c", T0 + 2.5, T0 + 3.0)
    record = times.record()
    assert [entry["unit"] for entry in record["recent"]] == ["b", "c"]
    assert record["recent"][1] == {"unit": "c", "first": T0 + 2, "last": T0 + 3.0, "batches": 2}
    assert record["older"] == {"units": 1, "batches": 1, "busy_s": 0.5}


def test_a_batch_watch_times_a_unit_from_its_first_batch_to_the_end_of_its_last():
    clock = itertools.count(10.0)  # 10, 11, 12, ...
    times = UnitTimes()
    watch = BatchWatch(times, clock=lambda: float(next(clock)))
    watch.taken("a")  # 10
    watch.ended()  # 11
    watch.taken("a")  # 12
    watch.ended()  # 13
    watch.taken("b")  # 14
    watch.ended()  # 15
    watch.ended()  # nothing open: no clock read
    assert times.record()["recent"] == [
        {"unit": "a", "first": 10.0, "last": 13.0, "batches": 2},
        {"unit": "b", "first": 14.0, "last": 15.0, "batches": 1},
    ]
    assert (watch.batches, watch.units) == (3, 2)


def load_three(value: int):
    for step in range(3):
        yield value * 3 + step, torch.full((4, 2), float(value))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_session_progress_record_carries_the_queue_unit_spans(tmp_path, workers):
    box = LocalMailbox(tmp_path / "run")
    learner = f"node-S{workers}-{uuid.uuid4().hex[:6]}"
    model = torch.nn.Linear(2, 1)
    units = {f"u{i}": i for i in range(4)}
    trained: dict[str, int] = {}
    with (
        Session(model, mailbox=box, learner_id=learner, every=timedelta(hours=1)) as session,
        shared_queue(units, mailbox=box, learner_id=learner, load=load_three, workers=workers, prefetch=2) as batches,
    ):
        for step, batch in batches:
            trained[f"u{step // 3}"] = trained.get(f"u{step // 3}", 0) + 1
            session.step(samples=len(batch))
    record = json.loads(box.get(f"progress/{learner}.json"))
    recent = record["unit_spans"]["recent"]
    assert {entry["unit"]: entry["batches"] for entry in recent} == trained == dict.fromkeys(units, 3)
    assert all(entry["first"] <= entry["last"] for entry in recent)
    spans = spans_from_run(read_run(box))
    assert len(spans) == 4 and all(span.measured for span in spans)


def test_the_demo_bars_say_what_they_show():
    rich = pytest.importorskip("rich.console")
    from gradientmail.cli.demo_plan import Plan
    from gradientmail.cli.demo_views import BarView, NodeState

    output = io.StringIO()
    console = rich.Console(file=output, width=200, force_terminal=False)
    plan = Plan(["A", "B"], [1.0, 2.0], 10, 2, 0.1)
    nodes = [NodeState(0, "A", "node-A", 0.1), NodeState(1, "B", "node-B", 0.2)]
    view = BarView(console, plan, nodes)
    with view:
        nodes[0].units, nodes[0].batches, nodes[0].loss = 1, 2, 0.5
        view.update(nodes[0], {"event": "batch"})
        view.update(nodes[0], {"event": "done"})
        view.progress.refresh()
    text = output.getvalue()
    assert "out of all 10" in text
    assert "1 units" not in text and "1 unit " in text
    assert "done," not in text and "no unit left: trained 10% of the run" in text


def test_spans_of_another_run_in_this_process_stay_out_of_the_record(tmp_path):
    learner = f"node-X-{uuid.uuid4().hex[:6]}"
    first = MemoryMailbox(f"plot-{uuid.uuid4().hex}")
    with shared_queue({"u0": 0}, mailbox=first, learner_id=learner, load=load_three, workers=0) as batches:
        list(batches)
    box = LocalMailbox(tmp_path / "second")
    with Session(torch.nn.Linear(2, 1), mailbox=box, learner_id=learner, every=timedelta(hours=1)):
        pass
    assert "unit_spans" not in json.loads(box.get(f"progress/{learner}.json"))
