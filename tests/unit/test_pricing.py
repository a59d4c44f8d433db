import pytest

from xlserve.openai.pricing import PriceTable


def test_cached_input_is_discounted():
    cost = PriceTable().cost(prompt_tokens=1_000_000, cached_tokens=800_000, completion_tokens=100_000)
    assert cost["input"] == pytest.approx(0.12) and cost["cached_input"] == pytest.approx(0.08)
    assert cost["output"] == pytest.approx(0.30) and cost["total"] == pytest.approx(0.50)
    with pytest.raises(ValueError):
        PriceTable(input=-1)
