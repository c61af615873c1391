"""Finding the SMS data: $BATCHPROMPT_DATA, then beside the repository, then from the current
directory, and one clear error naming what was tried."""
from __future__ import annotations

import pytest

from batchprompt import data

ROWS = [("spam", "Win a prize now"), ("ham", 'He said "ok"\tthen left')]


def _write_tsv(directory):
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sms_spam.tsv"
    path.write_text("label\ttext\n" + "".join(f"{label}\t{text}\n" for label, text in ROWS), encoding="utf-8")
    return path


@pytest.fixture
def no_repo_data(monkeypatch, tmp_path):
    """As if the package were installed away from a checkout: nothing beside the repository."""
    monkeypatch.delenv("BATCHPROMPT_DATA", raising=False)
    monkeypatch.setattr(data, "REPO_DATA", tmp_path / "nowhere", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.mark.parametrize("point_at", ["directory", "file"])
def test_the_env_var_says_where_the_data_is(monkeypatch, tmp_path, point_at):
    path = _write_tsv(tmp_path / "mydata")
    monkeypatch.setenv("BATCHPROMPT_DATA", str(path.parent if point_at == "directory" else path))
    assert data.read_sms() == ROWS
    assert data.read_sms(limit=1) == ROWS[:1]


def test_a_wrong_env_var_is_an_error_naming_it(monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHPROMPT_DATA", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="BATCHPROMPT_DATA=.*missing") as e:
        data.read_sms()
    assert str(tmp_path / "missing" / "sms_spam.tsv") in str(e.value)


def test_the_current_directory_is_the_last_place_looked(no_repo_data, monkeypatch, tmp_path):
    """Run from a checkout whose package is installed elsewhere: ../shared/data from the cwd."""
    checkout = tmp_path / "work" / "checkout"
    checkout.mkdir(parents=True)
    _write_tsv(tmp_path / "work" / "shared" / "data")
    monkeypatch.chdir(checkout)
    assert data.read_sms() == ROWS


def test_nothing_found_names_every_path_and_the_env_var(no_repo_data, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        data.read_sms()
    message = str(e.value)
    assert str(tmp_path / "nowhere" / "sms_spam.tsv") in message
    assert str(tmp_path.parent / "shared" / "data" / "sms_spam.tsv") in message
    assert "BATCHPROMPT_DATA" in message


def test_an_explicit_missing_path_is_named():
    with pytest.raises(FileNotFoundError, match="no-such.tsv"):
        data.read_sms("no-such.tsv")
