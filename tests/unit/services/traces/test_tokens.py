"""approx_token_count: the offline BPE estimate importers use when a trace records text."""

from __future__ import annotations

import pytest

from services.traces import approx_token_count

pytestmark = pytest.mark.unit

PROSE = (
    "The quick brown fox jumps over the lazy dog. I've uploaded a python code repository in the "
    "directory /testbed. Consider the following PR description: the widget breaks form validation "
    "with disabled fields, and it's been reported by several users since version 1.2.3 of the library."
)
CODE = """def decompress(self, value):
    if value is not None:
        if isinstance(value, (list, tuple)):
            return value
        return [value.amount, value.currency]
    return [None, self.default_currency]
"""


def test_empty_text_has_no_tokens() -> None:
    assert approx_token_count("") == 0


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("hello", 1),
        ("hello world", 2),  # the space rides with the word, as in BPE
        ("internationalization", 3),  # long words split, 1 token per started 8 letters
        ("don't", 2),  # "don" + "'t"
        ("12345", 2),  # digits in groups of three
        ("a == b", 3),  # "==" is one token
        ("x\n\n\ny", 3),  # a run of newlines is one token
    ],
)
def test_pieces_cost_what_bpe_typically_charges(text: str, tokens: int) -> None:
    assert approx_token_count(text) == tokens


def test_english_prose_comes_to_about_four_to_five_characters_per_token() -> None:
    assert 4.0 <= len(PROSE) / approx_token_count(PROSE) <= 5.0


def test_code_comes_to_three_and_a_half_to_four_and_a_half_characters_per_token() -> None:
    assert 3.5 <= len(CODE) / approx_token_count(CODE) <= 4.5


def test_a_concatenation_counts_about_the_sum_of_its_parts() -> None:
    assert abs(approx_token_count(PROSE + CODE) - approx_token_count(PROSE) - approx_token_count(CODE)) <= 2
