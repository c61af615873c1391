"""A constrained request's grammar, moved past each token the engine samples for it."""
from __future__ import annotations

from ..structured.validate import is_no_match
from .request import Request


def advance_grammar(req: Request, token: int, jump_forward: bool, max_model_len: int,
                    tokenizer, eos_token_ids: frozenset[int]) -> tuple[str | None, str | None]:
    """Move the request's grammar past `token`: ('stop', None) once the grammar is complete,
    ('error', message) when it cannot be, (None, None) to go on. The caller finishes the request
    (after taking it off the scheduler, which leaves a request already finished where it is).

    Jump-forward: where the grammar allows one continuation only (a JSON key, the rest of
    a label), those tokens are appended at once and computed together in the next step,
    like a piece of prompt, instead of one decode step each."""
    m = req.matcher
    # A matcher in error here hit a dead end while computing this step's mask (no text
    # continues the output to a match) and let only EOS through: that EOS is no answer.
    if m.is_error():  # not this token's fault: the engine was stopped before it (a limit, a dead end)
        return "error", _failure(req, None, tokenizer, eos_token_ids)
    if not m.consume_token(token):
        return "error", _failure(req, token, tokenizer, eos_token_ids)
    p = req.params
    if jump_forward and not (m.is_stopped() or p.logprobs or p.stop or p.stop_token_ids):
        room = min(p.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens)
        forced = m.compute_ff_tokens()[:max(room, 0)]
        if forced and m.consume_tokens(forced):
            for t in forced:
                req.append_token(t, None)
    if not m.is_stopped():
        return None, None
    if m.is_accepting() and not m.is_error():
        return "stop", None
    return "error", _failure(req, token, tokenizer, eos_token_ids)


def _failure(req: Request, token: int | None, tokenizer, eos_token_ids: frozenset[int]) -> str:
    """Why the output cannot match; `token` is the one the grammar refused (None: the grammar
    engine had stopped before this step's token, which was then only the EOS it let through)."""
    kind = req.params.grammar.kind
    reason = req.matcher.get_error().split("\n", 1)[0]
    if reason and not is_no_match(reason):
        if token is None:  # "refused token 2" named the EOS, not the cause
            return f"the grammar engine stopped on the {kind}: {reason}"
        special = _special_text(tokenizer, token)
        if special is not None:  # llguidance offers a special token for its text, then refuses it
            return (f"the {kind} asks for the text {special!r}, which is the model's special token {token}: the "
                    f"grammar engine (llguidance) cannot write it as text; leave it out of the {kind}")
        return f"the grammar engine refused token {token}: {reason}"
    ids = [t for t in req.output_token_ids if t not in eos_token_ids]
    text = tokenizer.decode(ids) if ids else ""
    where = f"nothing can follow {text[-60:]!r} in it" if text else "no text matches it"
    return f"the {kind} cannot be satisfied: {where}; fix the {kind}"


def _special_text(tokenizer, token: int) -> str | None:
    """A special token's own text (`<|im_end|>`), or None for a token that is not one."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or token not in set(getattr(hf, "all_special_ids", ()) or ()) | set(
            getattr(hf, "added_tokens_decoder", {}) or {}):
        return None
    return hf.convert_ids_to_tokens(token)
