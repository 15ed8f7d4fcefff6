"""``python -m benchmarks.training --quick`` trains every method for real and reports its figures.

It checks that the benchmark runs end to end (node processes, DDP over gloo, the shared queue,
the Session, the monitor, consensus) and prints what it promises, never how good the figures
are: the quick run trains a few batches, so its losses are far from converged.
"""

from __future__ import annotations

import inspect

import pytest
from benchmark_runs import finite, quick_run  # tests/helpers/ is on sys.path (tests/conftest.py)

pytestmark = pytest.mark.slow  # every test here starts processes


RATIOS = ["loss_over_ddp", "loss_over_single", "makespan_over_ddp", "time_to_ddp_loss"]
OUTERS = ["average", "delayed_nesterov"]
KEYS = [
    *RATIOS,
    *(f"{name}_{suffix}" for name in RATIOS for suffix in ("min", "max")),
    *(f"{name}_{outer}" for name in RATIOS for outer in OUTERS),
    "val_loss_initial",
    "val_loss_single",
    "val_loss_ddp",
    "val_loss_fixed_split",
    "makespan_s_ddp",
    "makespan_s_fixed_split",
    *(f"val_loss_gradientmail_{outer}" for outer in OUTERS),
    *(f"makespan_s_gradientmail_{outer}" for outer in OUTERS),
    *(f"seconds_to_ddp_loss_{outer}" for outer in OUTERS),
    "drag",
    "read_per_exchange",
    "int8_loss_over_float32",
    "int8_bytes_over_float32",
    "repeats",
]
FINITE = [
    "val_loss_initial",
    "val_loss_single",
    "val_loss_ddp",
    "val_loss_fixed_split",
    "val_loss_gradientmail_average",
    "loss_over_ddp",
    "loss_over_single",
    "makespan_over_ddp",
    "makespan_s_ddp",
    "makespan_s_gradientmail_average",
]


def test_quick_training_benchmark_prints_its_figures_as_json_last() -> None:
    lines, figures = quick_run("training")
    assert any(line.startswith("method") for line in lines), lines  # the table
    missing = [key for key in KEYS if key not in figures]
    assert not missing, missing
    not_finite = {key: figures[key] for key in FINITE if not finite(figures[key])}
    assert not not_finite, not_finite
    assert figures["val_loss_ddp"] < figures["val_loss_initial"]  # it trained
    assert figures["val_loss_gradientmail_average"] < figures["val_loss_initial"]
    from gradientmail import Session

    if "outer" in inspect.signature(Session).parameters:
        assert finite(figures["val_loss_gradientmail_delayed_nesterov"])
    # Never reaching DDP's loss in the quick run is allowed (null), a negative time is not.
    assert figures["time_to_ddp_loss"] is None or figures["time_to_ddp_loss"] > 0
    # The simulated 8-bit wire trained, and it would send about a byte per value (plus headers).
    assert finite(figures["int8_loss_over_float32"])
    assert 0.25 <= figures["int8_bytes_over_float32"] < 0.5, figures["int8_bytes_over_float32"]


@pytest.mark.timeout(960)
def test_quick_groups_benchmark_reports_each_method_and_the_traffic_per_machine() -> None:
    lines, figures = quick_run("training", "--groups", timeout=900)  # 4 processes per method, on a busy machine
    assert any(line.startswith("method") for line in lines), lines
    for name in ("learners", "groups"):
        for figure in ("loss_over_ddp", "makespan_over_ddp", "read_per_machine", "written_per_machine"):
            assert finite(figures[f"{name}_{figure}"]), (name, figure, figures)
        assert figures[f"val_loss_{name}"] < 5.5  # it trained (the initial loss is about 5.58)
    assert finite(figures["group_step_ratio"]) and figures["group_step_ratio"] > 0
    assert figures["mode"] == "groups-quick"
