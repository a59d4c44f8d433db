"""``xlserve bench engine``'s rounds: each figure the median of the rounds' fresh processes,
with their min-max in the table; a failed round left out; the goals of the engine issue."""

import pytest

from xlserve.bench.engine_bench import BenchOptions, median_run, spread
from xlserve.bench.report import engine_goals, engine_table


def _round(decode, prefill, uncached, cached):
    return {"decode_b1_tok_s": decode, "prefill_1000_tok_s": prefill, "ttft_uncached_s": uncached,
            "ttft_cached_s": cached, "weights_bytes": 7}


def test_rounds_give_medians_and_spread_and_skip_a_failed_round():
    rounds = [_round(50.0, 400.0, 3.0, 0.2), {"system": "xlserve", "error": ["died"]}, _round(70.0, 380.0, 3.4, 0.3),
              _round(60.0, 420.0, 3.2, 0.25)]
    merged = median_run(rounds)
    assert (merged["decode_b1_tok_s"], merged["prefill_1000_tok_s"], merged["runs"]) == (60.0, 400.0, 3)
    assert merged["weights_bytes"] == 7  # what is not a figure comes from a good round
    assert spread(rounds)["decode_b1_tok_s"] == (50.0, 70.0)
    failed = [{"system": "x", "error": ["a"]}, {"system": "x", "error": ["b"]}]
    assert median_run(failed) == failed[0] and spread(failed) == {}


def test_table_shows_each_median_with_its_spread_and_ratios_of_medians():
    results = {"systems": {"xlserve": median_run([_round(50.0, 400.0, 3.0, 0.2), _round(70.0, 400.0, 3.0, 0.2)]),
                           "llama.cpp": median_run([_round(40.0, 250.0, 4.0, 0.3)])},
               "weight_file_read_s": 0.1}
    results["spread"] = {name: spread([r]) for name, r in results["systems"].items()}
    results["spread"]["xlserve"]["decode_b1_tok_s"] = (50.0, 70.0)
    table = engine_table(results)
    assert "| decode tok/s, batch 1 | 60 (50–70) | 40 | 1.500× |" in table
    assert "| prefill tok/s, 1,000 tokens | 400 | 250 | 1.600× |" in table  # one distinct figure: no range
    goals = {desc: met for desc, _, met in engine_goals(results)}
    assert goals["decode b1 vs llama.cpp"] is True and goals["prefill 1,000 vs llama.cpp"] is True  # ≥ 1.2, ≥ 1.5


@pytest.mark.parametrize("field", ["repeats", "rounds"])
def test_rounds_and_repeats_must_be_positive(field):
    with pytest.raises(ValueError, match=f"{field} must be at least 1"):
        BenchOptions(**{field: 0})
