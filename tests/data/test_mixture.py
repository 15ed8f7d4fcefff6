"""``mix``: several sources interleaved by weight, in proportion at every prefix of the run."""

from __future__ import annotations

import math
import random
from collections import Counter
from fractions import Fraction

import pytest

from gradientmail import InvalidKeyError
from gradientmail.data import SourceUnit, epochs, mix
from gradientmail.data.mixture import apportion, interleave
from gradientmail.layout import claim_key
from gradientmail.queue.claims import validate_identifiers


def units(name: str, count: int) -> dict[str, int]:
    return {f"{name}-{i:04d}": i for i in range(count)}


def assert_in_proportion(order: list[str], shares: dict[str, int]) -> None:
    """After every prefix, each source's count is within one unit of its share of the prefix."""
    total = sum(shares.values())
    taken: Counter[str] = Counter()
    for t, source in enumerate(order, start=1):
        taken[source] += 1
        for name, share in shares.items():
            assert abs(taken[name] - Fraction(t * share, total)) < 1, (t, name, dict(taken))
    assert taken == Counter(shares)


def test_proportions_hold_at_every_prefix_for_many_weightings():
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 6)
        shares = [rng.randint(1, 60) for _ in range(k)]
        order = interleave(shares)
        assert_in_proportion([str(s) for s in order], {str(s): share for s, share in enumerate(shares)})


def test_a_ninety_ten_mixture():
    mixed = mix({"web": (units("w", 1000), 0.9), "code": (units("c", 50), 0.1)})
    assert len(mixed) == 500, "the default size: the most that no source runs out of"
    values = list(mixed.values())
    assert_in_proportion([item.source for item in values], {"web": 450, "code": 50})
    web = [item.identifier for item in values if item.source == "web"]
    assert web == list(units("w", 1000))[:450], "each source's units from the front, in its order"
    assert all(key.endswith(f"-{item.source}/{item.identifier}") for key, item in mixed.items())
    assert all(item.unit == int(item.identifier[2:]) for item in values)


def test_keys_sort_in_the_mixtures_order_and_are_valid_identifiers():
    """The claimer lists claims in key order: interleaved sources under plain ``source/`` keys
    cost it nearly twice the requests per claim, so each key starts with its position."""
    mixed = mix({"b": (units("x", 300), 1), "a": (units("y", 200), 2), "c": (units("z", 90), 0.3)}, size=330)
    keys = [claim_key(key) for key in mixed]
    assert keys == sorted(keys)
    assert validate_identifiers(mixed) == list(mixed)


def test_size_and_weights():
    mixed = mix({"a": (units("a", 10), 2), "b": (units("b", 10), 1)}, size=9)
    assert Counter(item.source for item in mixed.values()) == {"a": 6, "b": 3}
    assert apportion(10, [Fraction(1, 3)] * 3) == [4, 3, 3]
    assert mix({"only": (units("o", 3), 5)}).keys() == {"0000-only/o-0000", "0001-only/o-0001", "0002-only/o-0002"}


def test_a_mixture_of_epochs_keeps_each_sources_passes():
    """Shuffle and repeat each source with ``epochs``; ``mix`` keeps their orders."""
    web, code = epochs(units("w", 30), 2, seed=0), epochs(units("c", 5), 4, seed=1)
    mixed = mix({"web": (web, 3), "code": (code, 1)})
    assert len(mixed) == 80
    by_source = {name: [item.unit for item in mixed.values() if item.source == name] for name in ("web", "code")}
    assert by_source == {"web": list(web.values()), "code": list(code.values())}
    pairs = Counter((item.unit.epoch, item.unit.identifier) for item in mixed.values() if item.source == "code")
    assert len(pairs) == 20 and set(pairs.values()) == {1}
    assert isinstance(next(iter(mixed.values())), SourceUnit)


@pytest.mark.parametrize(
    ("sources", "size", "error", "match"),
    [
        ({}, None, ValueError, "at least one source"),
        ({"a": (units("a", 3), 1), "b": ({}, 1)}, None, ValueError, "source 'b' has no units"),
        ({"a": (units("a", 3), 0)}, None, ValueError, "weight 0 is not > 0"),
        ({"a": (units("a", 3), -1.5)}, None, ValueError, "is not > 0"),
        ({"a": (units("a", 3), math.nan)}, None, ValueError, "a finite number > 0"),
        ({"a": (units("a", 3), math.inf)}, None, ValueError, "a finite number > 0"),
        ({"a": (units("a", 3), True)}, None, ValueError, "a finite number > 0"),
        ({"a": (units("a", 3), "1")}, None, ValueError, "a finite number > 0"),
        ({"a": units("a", 3)}, None, ValueError, r"give \(units, weight\)"),
        ({"a/b": (units("a", 3), 1)}, None, InvalidKeyError, "without '/'"),
        ({"": (units("a", 3), 1)}, None, InvalidKeyError, "non-empty"),
        ({".a": (units("a", 3), 1)}, None, InvalidKeyError, "not a valid key segment"),
        ({"a": ({"ok": 0, "x/.y": 1}, 1)}, None, InvalidKeyError, "source 'a', unit 'x/.y'"),
        ({"a": (units("a", 3), 1), "b": (units("b", 3), 1)}, 8, ValueError, r"repeat it \(epochs\(units, 2\)\)"),
        ({"a": (units("a", 3), 1)}, 0, ValueError, "size must be an int >= 1"),
    ],
)
def test_bad_arguments_are_refused(sources, size, error, match):
    with pytest.raises(error, match=match):
        mix(sources, size=size)
