"""The Session's virtual-clock simulator (``benchmarks.session_sim``): faithful, repeatable, exact.

Its figures are checked against real ``Session``s (threads, each behind a ``PacedMailbox`` on one
store, as ``benchmarks.session_scale`` runs them) with the same store, model and schedule. The
phases a learner draws on entering decide which learners fold the same fragment together (two
whose phases nearly meet fold every fragment together, and one of them reads the other's
contribution each time: 0.96 to 1.3 model sizes read per exchange at 4 learners), so both runs
draw learner ``i``'s phase from ``session_scale.phase_generator(seed, i)``, as ``Session`` would
from its own generator.
"""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from benchmark_runs import finite, quick_run  # tests/helpers/ is on sys.path (tests/conftest.py)

from benchmarks import session_scale
from benchmarks._simulated_store import WRITE, SimulatedMailbox, SimulatedStore, StoreModel
from benchmarks._virtual_clock import VirtualClock
from benchmarks.session_sim import Run, SimConfig, learners_by_fragments, simulate
from gradientmail import MemoryMailbox
from gradientmail.errors import ValueTooLargeError
from gradientmail.layout import FRAGMENTS_PREFIX
from gradientmail.records import MAX_RECORD_BYTES
from gradientmail.session.chain import TOMBSTONE
from gradientmail.session.overlap import OVERLAP

pytestmark = pytest.mark.slow  # real sessions for seconds; simulations of a few seconds

LATENCY_S, BANDWIDTH = 0.015, 40e6
PARAMS = 262_144  # float32: 1 MB, 16 fragments of 64 KiB
SMALL = SimConfig(learners=6, every=10.0, intervals=3, params=1e8, steps_per_s=4.0, speed_spread=0.3)


def test_a_request_over_its_prefix_limit_waits_its_turn_and_bodies_are_billed_at_scale() -> None:
    clock = VirtualClock()
    store = SimulatedStore(
        MemoryMailbox("sim-store-limit"),
        clock,
        StoreModel(latency_s=0.0, bandwidth_bytes_s=1e6, writes_per_s=2.0, reads_per_s=None, latency_spread=0.0),
    )
    store.inner.clear()
    landed: list[float] = []

    def writer(name: str) -> None:
        SimulatedMailbox(store).put(f"folder/{name}", b"{}")
        landed.append(clock.now)

    for name in "abc":
        clock.spawn(lambda name=name: writer(name))
    clock.run()
    assert landed == pytest.approx([0.0, 0.5, 1.0], abs=1e-3)  # 2 writes a second on one prefix
    assert store.peak(WRITE) == ("folder", 2)
    header = b'{"__metadata__":{}}'
    body = len(header).to_bytes(8, "little") + header + bytes(100)
    assert StoreModel(body_scale=1000.0).billed(body) == 8 + len(header) + 100 * 1000.0
    assert StoreModel(body_scale=1000.0).billed(b'{"a record": 1}') == 15.0


def test_a_bounded_read_of_a_larger_body_carries_only_the_bound_and_is_refused_as_on_s3() -> None:
    """As the S3 mailbox reads with ``max_bytes`` (one GET of the first ``max_bytes + 1`` bytes):
    a read-back bounded to a record's size does not download a modelled 100 MB contribution (a
    bound reckoned on the real bytes is the modelled body's, capped at a record's size)."""
    clock = VirtualClock()
    store = SimulatedStore(
        MemoryMailbox("sim-store-bounded"),
        clock,
        StoreModel(latency_s=0.0, bandwidth_bytes_s=1e6, body_scale=1e6, latency_spread=0.0),
    )
    store.inner.clear()
    header = b'{"__metadata__":{}}'
    store.inner.put("folder/body", len(header).to_bytes(8, "little") + header + bytes(100))
    box = SimulatedMailbox(store)
    outcome: list[object] = []

    def reader() -> None:
        try:
            box.get("folder/body", max_bytes=1000)
        except ValueTooLargeError as error:
            outcome.append(error)
        outcome.append(clock.now)

    clock.spawn(reader)
    clock.run()
    store.inner.clear()
    assert isinstance(outcome[0], ValueTooLargeError)
    assert outcome[1] == pytest.approx((MAX_RECORD_BYTES + 1) / 1e6) and box.bytes_read == MAX_RECORD_BYTES + 1


def test_the_simulation_is_the_same_for_a_seed_on_greenlets_or_threads() -> None:
    first, second = simulate(SMALL), simulate(SimConfig(**{**SMALL.__dict__, "threads": True}))
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second
    assert OVERLAP.get() is None  # the clock's way to overlap requests stayed inside its tasks
    other = simulate(SimConfig(**{**SMALL.__dict__, "seed": 1}))
    other.pop("wall_s")
    assert other != first


def test_every_sample_is_in_the_run_exactly_once_with_contributions_left_pending_and_unequal_speeds() -> None:
    figures = simulate(SimConfig(**{**SMALL.__dict__, "learners": 12}))
    assert figures["pending_writes"] > 0  # folds found a peer's claim or lost: others absorbed them
    assert figures["exact"] == 1.0


ATTEMPTS = 3
LATE_S = 0.05
"""A reference run whose steps started later than this behind schedule measured a busy machine."""


def reference_run(config: session_scale.Config, seed: int) -> dict[str, float]:
    """Real sessions' figures, from a run whose steps kept their schedule (the learners' threads
    got the CPU they asked for); skips the test when the machine never let them."""
    for _ in range(ATTEMPTS):
        random.seed(seed)
        real = session_scale.measure(config)
        if real["late_ms"] <= 1000 * LATE_S and real["step_rate"] == 1.0:
            return real
    pytest.skip(f"the real sessions never kept their step schedule on this machine (last: {real})")


def test_the_protocol_retires_old_versions_on_virtual_time() -> None:
    """Retirement waits for a version to be old enough by the node's clock: seconds of virtual
    time, which a simulation passes in a fraction of a real second."""
    run = Run(SMALL)
    try:
        run.run()
        versions = [key for key in run.inner.list(FRAGMENTS_PREFIX) if "/versions/" in key]
        retired = [key for key in versions if run.inner.get(key) == TOMBSTONE]
    finally:
        run.inner.clear()
    assert retired, versions


@pytest.mark.parametrize("learners", [4, 8])
def test_the_simulation_agrees_with_real_sessions_on_a_paced_store(learners: int) -> None:
    seed = 3
    config = session_scale.Config(
        learners=learners,
        seconds=10.0,
        every=2.0,
        params=PARAMS,
        steps_per_s=10.0,
        latency_s=LATENCY_S,
        bandwidth_bytes_s=BANDWIDTH,
        phase_seed=seed,
    )
    real = reference_run(config, seed)
    simulated = simulate(
        SimConfig(
            learners=learners,
            every=config.every,
            intervals=config.seconds / config.every,
            params=PARAMS,
            wire_dtype=torch.float32,
            real_params=PARAMS,
            steps_per_s=config.steps_per_s,
            speed_spread=0.0,
            store=StoreModel(LATENCY_S, BANDWIDTH, reads_per_s=None, writes_per_s=None, latency_spread=0.0),
            seed=seed,
            phase_seed=seed,
        )
    )
    assert real["errors"] == 0 and simulated["exact"] == 1.0, (real, simulated)
    assert simulated["fragments"] == real["fragments"] == 16
    assert simulated["exchange_rate"] == pytest.approx(real["exchange_rate"], abs=0.1), (real, simulated)
    assert simulated["lag_intervals"] == pytest.approx(real["lag_intervals"], abs=0.5)
    for figure in ("read_per_exchange", "written_per_exchange", "requests_per_exchange"):
        assert simulated[figure] == pytest.approx(real[figure], rel=0.15), (figure, real[figure], simulated[figure])
    # Per fragment fold: the versions lost to another writer.
    real_per_fold = real["conflicts_per_exchange"] / real["fragments"]
    assert simulated["conflicts_per_fold"] == pytest.approx(real_per_fold, abs=0.1)


def test_simulating_some_fragments_gives_the_figures_of_simulating_them_all() -> None:
    """Fragments' chains share nothing but their learners' time: a run that simulates 4 of 16
    fragments (the others' folds waits drawn from the simulated ones) finds the whole run's
    figures, per whole exchange."""
    config = SimConfig(learners=24, every=8.0, intervals=3, params=1e8, fragments=16, steps_per_s=4.0)
    whole, sampled = simulate(config), simulate(SimConfig(**{**config.__dict__, "simulated": 4}))
    assert sampled["simulated_fragments"] == 4 and whole["simulated_fragments"] == 16
    assert whole["exact"] == sampled["exact"] == 1.0
    assert sampled["exchange_rate_mean"] == pytest.approx(whole["exchange_rate_mean"], abs=0.03)
    assert sampled["lag_intervals"] == pytest.approx(whole["lag_intervals"], abs=0.2)
    for figure in ("read_per_exchange", "written_per_exchange", "requests_per_exchange"):
        assert sampled[figure] == pytest.approx(whole[figure], rel=0.15), (figure, whole[figure], sampled[figure])
    assert sampled["contributions_per_version"] == pytest.approx(whole["contributions_per_version"], rel=0.25)


def test_quick_session_sim_benchmark_prints_its_figures_as_json_last() -> None:
    lines, figures = quick_run("session_sim")
    assert any(line.startswith("learners") for line in lines), lines  # the table
    names = ("exchange_rate", "lag_intervals", "read_per_exchange", "written_per_exchange", "conflicts_per_fold")
    expected = [f"session_sim_{name}_{count}" for count in (4, 8) for name in (*names, "reads_per_s", "exact")]
    assert all(finite(figures[name]) for name in expected), figures
    assert figures["session_sim_exact_4"] == figures["session_sim_exact_8"] == 1.0


def test_a_run_or_store_that_cannot_be_simulated_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="learners >= 1"):
        SimConfig(learners=0)
    with pytest.raises(ValueError, match="real_params"):
        SimConfig(learners=4, params=1000, real_params=4096)
    with pytest.raises(ValueError, match="simulated must be at least 1 fragment"):
        SimConfig(learners=4, simulated=0)
    assert learners_by_fragments("1024:64:4") == (1024, 64, 4) and learners_by_fragments("64:16") == (64, 16, None)
    with pytest.raises(argparse.ArgumentTypeError, match="learners:fragments:simulated"):
        learners_by_fragments("1024:64:0")
    with pytest.raises(ValueError, match="latency_spread"):
        StoreModel(latency_spread=2.0)
    with pytest.raises(ValueError, match="request limit"):
        StoreModel(writes_per_s=0.0)
