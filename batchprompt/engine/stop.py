"""When does a request stop: EOS, stop tokens, stop strings, max_tokens, the context length."""
from __future__ import annotations

from .request import Request


def check_stop(req: Request, eos_token_ids: frozenset[int], max_model_len: int, tokenizer) -> str | None:
    """The finish reason after the request's newest token, or None to go on."""
    p = req.params
    token = req.output_token_ids[-1]
    if len(req.output_token_ids) < p.min_tokens:  # the sampler kept EOS and stop tokens out
        return "length" if req.num_tokens >= max_model_len else None
    if not p.ignore_eos and token in eos_token_ids:  # first, as vLLM: an EOS also in stop_token_ids
        return "stop"  # is no stop_reason (it said the EOS id)
    if token in p.stop_token_ids:
        req.stop_reason = token
        if not p.include_stop_str_in_output and tokenizer is not None:  # as vLLM: the stop token's text is
            req.stop_text_len = len(tokenizer.decode(req.output_token_ids[:-1]))  # left out (it was kept)
        return "stop"
    if p.stop and tokenizer is not None:
        text = tokenizer.decode(req.output_token_ids)
        if len(req.output_token_ids) == p.min_tokens:  # as vLLM: a stop string counts once it ends after these tokens
            req.stop_floor = len(text.rstrip("\ufffd"))
        else:
            # Only a match that ends in the new text: what came before was searched at earlier steps
            # (all of the new text, however long its tokens; a few characters more, for a character
            # that a token completed).
            tail_from = max(0, req.stop_scanned - max(len(s) for s in p.stop) - 4)
            hits = [(i, i + len(s), s) for i, s in ((text.find(s, max(tail_from, req.stop_floor - len(s) + 1)), s)
                                                    for s in p.stop) if i >= 0]
            if hits:
                start, end, matched = min(hits)
                req.stop_text_len = end if p.include_stop_str_in_output else start
                req.stop_reason = matched
                return "stop"
            req.stop_scanned = len(text.rstrip("\ufffd"))
    if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None
