"""cli.data: where the shipped traces are found."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli import data

pytestmark = pytest.mark.unit


def test_the_checkout_ships_the_three_published_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(data.TRACES_DIR_ENV, raising=False)
    assert data.traces_dir() == data.CHECKOUT_TRACES
    for name in (data.INFERCEPT, data.CONTINUUM, data.MOONCAKE):
        assert data.trace_file(name).stat().st_size > 100_000


def test_the_variable_moves_the_folder_and_a_missing_file_names_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(data.TRACES_DIR_ENV, str(tmp_path))
    assert data.traces_dir() == tmp_path
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / data.INFERCEPT}.*{data.TRACES_DIR_ENV}"):
        data.trace_file(data.INFERCEPT)
    (tmp_path / data.INFERCEPT).write_text("{}")
    assert data.trace_file(data.INFERCEPT) == tmp_path / data.INFERCEPT
