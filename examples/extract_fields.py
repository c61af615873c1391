"""Field extraction into a pydantic model over many messages, with JSON-schema constrained
decoding: every answer parses into the class, or comes back as a clear error.

Each SMS becomes an `SmsFields` (sender type, urgency, whether it contains a link). One shared
prompt (system prompt and one worked example, computed once) serves every message. The
script checks that every result is a valid `SmsFields`, and compares `contains_link` with a
plain look for links in the text, as a sanity check of what a 135M model extracts.

    python examples/extract_fields.py [--rows 200]      (make example-extract)
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import batchprompt as bp  # noqa: E402
from batchprompt.data import read_sms  # noqa: E402


class SmsFields(BaseModel):
    sender_type: Literal["person", "business", "automated"] = Field(
        description="who wrote it: a person, a business, or an automated service")
    urgency: Literal["low", "medium", "high"]
    contains_link: bool = Field(description="the text has a web address or URL")


SYSTEM = ("You extract fields from SMS messages. Answer with JSON: sender_type (person, business or "
          "automated), urgency (low, medium or high), contains_link (true if the text has a web address).")
EXAMPLE = [
    {"role": "user", "content": "Your parcel is waiting. Track it at www.parcel-track.co.uk/x7 before 5pm today"},
    {"role": "assistant", "content": '{"sender_type":"automated","urgency":"high","contains_link":true}'},
    {"role": "user", "content": "Hey, are we still on for dinner tonight?"},
    {"role": "assistant", "content": '{"sender_type":"person","urgency":"medium","contains_link":false}'},
]
LINK = re.compile(r"https?://|www\.|\.(com|co\.uk|net|org|biz)\b", re.IGNORECASE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200)
    args = ap.parse_args()
    texts = [t for _, t in read_sms(limit=args.rows)]

    t0 = time.perf_counter()
    lm = bp.LanguageModel.create(system=SYSTEM, initial_prompts=EXAMPLE, json_schema=SmsFields, max_tokens=48)
    print(f"model and shared prompt ready in {time.perf_counter() - t0:.1f}s")
    t0 = time.perf_counter()
    results = lm.batch_prompt(texts, progress=True)
    elapsed = time.perf_counter() - t0

    valid = [r for r in results if r.ok and isinstance(r.parsed, SmsFields)]
    for text, r in list(zip(texts, results))[:6]:
        print(f"  {text[:56]!r:60} -> {r.parsed if r.ok else r.error}")
    tokens = sum(r.usage.completion_tokens for r in results)
    print(f"\n{len(texts)} messages in {elapsed:.1f}s ({len(texts) / elapsed:.1f}/s, {tokens} generated tokens); "
          f"valid SmsFields: {len(valid)}/{len(texts)}")
    for r in results:
        if not r.ok:
            print(f"  [{r.index}] {r.error}")
    print("sender_type:", dict(Counter(r.parsed.sender_type for r in valid)),
          " urgency:", dict(Counter(r.parsed.urgency for r in valid)))
    has_link = [bool(LINK.search(t)) for t in texts]
    agree = sum(r.parsed.contains_link == h for r, h in zip(results, has_link) if r.ok)
    print(f"contains_link agrees with a look for links in the text on {agree}/{len(valid)} messages "
          f"({sum(has_link)} texts have one)")
    lm.destroy()
    return 0 if len(valid) == len(texts) else 1


if __name__ == "__main__":
    raise SystemExit(main())
