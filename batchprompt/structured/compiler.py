"""GrammarCompiler: grammars to llguidance matchers for one tokenizer, compiled once each."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

from .grammar import Grammar
from .validate import ENDLESS, dead_end, endless, is_no_match


class GrammarError(ValueError):
    """The grammar engine rejected a grammar (a bad regex, an unsupported schema feature)."""


class GrammarCompiler:
    """Builds llguidance's view of the vocabulary on first use (about a second), so requests
    without a grammar never pay for it. Each distinct grammar is validated and compiled once;
    every request gets a cheap copy of the compiled matcher."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: Iterable[int], cache_size: int = 256):
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer = None
        self._compiled: OrderedDict[Grammar, object] = OrderedDict()
        self._compiling: dict[Grammar, threading.Event] = {}  # set once its compile has ended
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab_size,
                                                               eos_token=self._eos or None)
            return self._tokenizer

    def matcher(self, grammar: Grammar):
        """A fresh matcher at the start of `grammar`; GrammarError if it cannot be compiled."""
        template = self.compile(grammar)
        if isinstance(template, GrammarError):
            raise template
        return template.deep_copy()

    def is_compiled(self, grammar: Grammar) -> bool:
        """Whether `grammar` is compiled (or known to fail) already."""
        with self._lock:
            return grammar in self._compiled

    def compile(self, grammar: Grammar):
        """The compiled matcher of `grammar` (not to be used: copy it), or its GrammarError.
        Each distinct grammar compiles once, outside the lock: a caller that compiles one
        beforehand (a big list of labels, seconds) never holds up the engine's thread, which
        then finds it compiled, nor its other grammars."""
        while True:
            with self._lock:
                template = self._compiled.get(grammar)
                if template is not None:
                    self._compiled.move_to_end(grammar)
                    return template
                pending = self._compiling.get(grammar)
                mine = pending is None
                if mine:
                    pending = self._compiling[grammar] = threading.Event()
            if not mine:
                pending.wait()  # another thread compiles it: then it is in the cache (or evicted: again)
                continue
            try:
                try:
                    template = self._compile(grammar)
                except GrammarError as e:  # remembered: a batch repeats its grammar many times
                    template = e
                with self._lock:
                    self._compiled[grammar] = template
                    if len(self._compiled) > self._cache_size:
                        self._compiled.popitem(last=False)
                return template
            finally:
                with self._lock:
                    del self._compiling[grammar]
                pending.set()

    def _compile(self, grammar: Grammar):
        from llguidance import LLMatcher

        try:
            text = grammar.to_llguidance()
        except ValueError as e:
            raise GrammarError(f"the {grammar.kind} cannot be used: {e}") from None
        limits = _limits(grammar, text)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, self.tokenizer, limits=limits)
        matcher = None if is_error else LLMatcher(self.tokenizer, text, log_level=0, limits=limits)
        error = messages[0] if is_error else matcher.get_error() if matcher.is_error() else None
        if error is not None:
            raise GrammarError(f"the grammar engine rejected the {grammar.kind}: {_short(error, grammar)}")
        if endless(matcher.deep_copy()):  # `a: "x" a` with the model's own tokens (Lark that names them)
            raise GrammarError(f"the {grammar.kind} cannot be satisfied: {ENDLESS}")
        reason = dead_end(matcher.deep_copy())  # one mask: a grammar that nothing matches fails now
        if reason is not None:
            raise GrammarError(f"the {grammar.kind} cannot be satisfied: no text the model can write matches it; "
                               f"fix the {grammar.kind}" if is_no_match(reason) else
                               f"the grammar engine stopped on the {grammar.kind}: {reason}")
        return matcher


#: llguidance's assertion (a panic) for a grammar of more than 65,525 symbols (see
#: api/structured.py for how a long list of labels stays within them).
TOO_MANY_SYMBOLS = "grammar.symbols.len() < u16::MAX"


def _short(message: str, grammar: Grammar) -> str:
    """llguidance's message without the Rust backtrace of a panic (a hundred lines of
    addresses), and its symbol limit in the user's terms."""
    message = message.split("<backtrace>", 1)[0].strip()
    if TOO_MANY_SYMBOLS in message:
        what = f"{grammar.num_labels} labels" if grammar.kind == "choices" else f"this {grammar.kind}"
        return (f"{what} make more than the 65,525 symbols the grammar engine takes: make the "
                f"{grammar.kind} smaller" + (" (fewer labels)" if grammar.kind == "choices" else ""))
    return message


def _limits(grammar: Grammar, text: str):
    """llguidance's parser limits: its own, but a row as wide as the grammar's alternatives
    (its default of 2,000 items a row failed a list of more labels, or a Lark rule of more
    alternatives, at its first token). A Lark rule's alternatives are bounded by its "|"s."""
    from llguidance import LLParserLimits

    if grammar.kind == "choices":
        labels = grammar.labels
        if not grammar.has_token_ids:
            # Labels as text are one lexeme: the lexer's fuel, not the parser's row, bounds them
            # (its default failed 50,000 labels after their first token, "too many expressions
            # constructed"). About 2x their bytes was enough; 4x, and never below the default.
            fuel = 4 * sum(len(label.encode()) for label in labels)
            defaults = LLParserLimits()
            return LLParserLimits(initial_lexer_fuel=max(defaults.initial_lexer_fuel, fuel),
                                  step_lexer_fuel=max(defaults.step_lexer_fuel, fuel))
        width = len(labels)
    elif grammar.kind == "lark":
        width = text.count("|")
    elif grammar.is_json:
        # An object's optional properties make a row of items for each (2,003 for 500 of them, and
        # the default refused it with "consider making your grammar left-recursive"): bounded by
        # the schema's size.
        width = len(grammar.source)
    else:
        return None
    return LLParserLimits(max_items_in_row=max(2000, 2 * width + 16))
