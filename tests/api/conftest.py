"""The batch API on the embedded model in float32, where batching changes no greedy token."""
from __future__ import annotations

import pytest

import batchprompt as bp

from ..conftest import SPAM_SYSTEM, sms_rows


@pytest.fixture()
def lm(engine32):
    session = bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32, max_tokens=6)
    yield session
    session.destroy()


@pytest.fixture(scope="session")
def messages():
    return [text for _, text in sms_rows(24)]
