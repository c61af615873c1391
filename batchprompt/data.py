"""The reference bulk workload: the SMS spam set beside the checkout (or where $BATCHPROMPT_DATA says)."""
from __future__ import annotations

import os
from pathlib import Path

SPAM_SYSTEM = ("You are a spam filter for SMS messages. Read the message and answer with "
               "exactly one word: spam or ham.")
#: Labelled examples for the shared prompt, as chat turns (the prefix cache makes them free
#: after the first prompt). Two come from the set itself; evaluations leave those out.
SPAM_EXAMPLES = [
    ("spam", "Free entry in 2 a wkly comp to win FA Cup final tkts 21st May 2005. Text FA to 87121 to "
             "receive entry question(std txt rate)T&C's apply 08452810075over18's"),
    ("ham", "I'm gonna be home soon and i don't want to talk about this stuff anymore tonight, k? "
            "I've cried enough today."),
    ("spam", "URGENT! You have won a 1 week FREE membership in our £100,000 Prize Jackpot! Txt the word: "
             "CLAIM to No: 81010 T&C www.dbuk.net LCCLTD POBOX 4403LDNW1A7RW18"),
    ("ham", "Ok lar... Joking wif u oni..."),
]
SMS_FILE = "sms_spam.tsv"
DATA_ENV = "BATCHPROMPT_DATA"
#: The data beside the checkout: <repository>/../shared/data (the repository found from this file).
REPO_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
DEFAULT_SMS = REPO_DATA / SMS_FILE


def data_candidates(name: str) -> list[Path]:
    """Where a data file is looked for. $BATCHPROMPT_DATA (a directory holding it, or the file
    itself) when set, and then only there: a wrong setting is an error, not a silent fallback.
    Otherwise the shared data beside the repository, then ../shared/data from the current
    directory (an installed, not editable, package run from a checkout)."""
    env = os.environ.get(DATA_ENV)
    if env:
        given = Path(env).expanduser()
        return [given if given.name == name else given / name]
    return [REPO_DATA / name, Path.cwd().parent / "shared" / "data" / name]


def find_data(name: str) -> Path:
    """The first existing candidate for `name`, or one error naming every path tried."""
    tried = data_candidates(name)
    for path in tried:
        if path.is_file():
            return path
    where = (f"{DATA_ENV}={os.environ[DATA_ENV]} points to {tried[0]}" if os.environ.get(DATA_ENV)
             else f"looked at {', '.join(map(str, tried))}")
    raise FileNotFoundError(f"{name} not found: {where}. Set {DATA_ENV} to the directory that holds "
                            f"it (or to the file itself), or pass its path")


def read_sms(path: str | Path | None = None, limit: int | None = None) -> list[tuple[str, str]]:
    """(label, text) rows of `path`, by default sms_spam.tsv wherever `find_data` finds it. Each
    line is split on its first tab: texts hold quote characters."""
    if path is None:
        path = find_data(SMS_FILE)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"SMS data not found at {path}: pass the path of {SMS_FILE}, or leave it "
                                f"out to search ${DATA_ENV} and ../shared/data")
    rows = []
    with open(path, encoding="utf-8") as f:
        next(f)
        for line in f:
            label, _, text = line.rstrip("\n").partition("\t")
            rows.append((label, text))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def example_turns() -> list[dict[str, str]]:
    """SPAM_EXAMPLES as user/assistant turns, for `initial_prompts`."""
    turns = []
    for label, text in SPAM_EXAMPLES:
        turns += [{"role": "user", "content": text}, {"role": "assistant", "content": label}]
    return turns


def label_scores(gold: list[str], predicted: list[str], labels: list[str]) -> dict[str, float]:
    """Accuracy, and each label's recall (share of its messages predicted as it)."""
    pairs = list(zip(gold, predicted, strict=True))
    scores = {"accuracy": sum(g == p for g, p in pairs) / max(len(pairs), 1)}
    for c in labels:
        scores[f"{c}_recall"] = sum(p == c for g, p in pairs if g == c) / max(sum(g == c for g in gold), 1)
    return scores


def predicted_label(text: str) -> str:
    """The label an answer names: 'spam' if it says spam, else 'ham'."""
    return "spam" if "spam" in text.lower() else "ham"
