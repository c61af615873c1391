"""Structured outputs: grammars (choices, regex, JSON schema, Lark) compiled by llguidance into
per-request token masks that the engine applies in its sampling step."""
from .compiler import GrammarCompiler, GrammarError
from .grammar import Grammar

__all__ = ["Grammar", "GrammarCompiler", "GrammarError"]
