"""The reference bulk workload: the SMS spam set beside the checkout."""
from __future__ import annotations

from pathlib import Path

SPAM_SYSTEM = ("You are a spam filter for SMS messages. Read the message and answer with "
               "exactly one word: spam or ham.")
DEFAULT_SMS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sms_spam.tsv"


def read_sms(path: str | Path = DEFAULT_SMS, limit: int | None = None) -> list[tuple[str, str]]:
    """(label, text) rows. Each line is split on its first tab: texts hold quote characters."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SMS data not found at {path}: pass the path of sms_spam.tsv")
    rows = []
    with open(path, encoding="utf-8") as f:
        next(f)
        for line in f:
            label, _, text = line.rstrip("\n").partition("\t")
            rows.append((label, text))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def predicted_label(text: str) -> str:
    """The label an answer names: 'spam' if it says spam, else 'ham'."""
    return "spam" if "spam" in text.lower() else "ham"
