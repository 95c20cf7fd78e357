"""Structured outputs: grammars that hold a reply to a JSON schema, a regex, a choice, an EBNF grammar or
well-formed tool calls, on the xgrammar library (chosen by measurement: docs/benchmarks.md, "Grammar
libraries"). Below the engine: imports ``specd.model`` (the built-in tokenizer) and nothing above it.

Vocabulary:

- **spec** (:class:`GrammarSpec`): what one request asks for, read from its fields once
  (:func:`grammar_spec`: ``response_format``, vLLM's ``structured_outputs`` / ``guided_*``, ``tools``);
  refusals are :class:`GrammarError` (code, message): an HTTP 400.
- **grammar** (:class:`Grammar`): a spec compiled for one :class:`Vocabulary` (the target's
  tokenizer and logits width) by the :class:`GrammarCompiler` (cached, off-thread, bounded).
- **matcher** (:class:`Matcher`): one request's state in its grammar: the tokens it has consumed,
  the mask of the next one, rollback, forced tokens.
- **mask**: which tokens may come next; packed as a **bitmask** row of ``ceil(V/32)`` int32 words
  (:mod:`specd.structured.masks`), applied to logits as -inf.
- **draft tree masks** (:func:`tree_masks`): one mask per node of a draft tree, each the grammar
  state after that node's path; nodes whose token the grammar forbids are *pruned*.
- **forced tokens**: the continuation the grammar leaves no choice about, as token ids (jump-forward).
- **tool calls** (:mod:`specd.structured.tools`, :mod:`specd.structured.tool_parser`): the text format,
  the grammar per ``tool_choice`` (lazy for ``auto``), and the parser to OpenAI ``tool_calls``.
"""

from typing import TYPE_CHECKING

from specd.structured.errors import GrammarError
from specd.structured.limits import GrammarLimits
from specd.structured.request import grammar_spec, response_format_spec, structured_outputs_spec, text_format_spec
from specd.structured.spec import GrammarSpec
from specd.structured.tool_parser import ToolCall, ToolCallDelta, ToolCallParser, parse_tool_calls
from specd.structured.tools import TOOL_CLOSE, TOOL_OPEN, ToolCallSpec, ToolFunction, tools_system_prompt

# The names on xgrammar and torch load on first use: the server process reads specs, renders tool prompts and
# parses tool calls but compiles nothing (the engine process does, through its link), and importing xgrammar
# (which imports torch) cost it ~0.5 s of its start and ~250 MB of resident memory.
_LAZY = {
    "CompilerConfig": "compiler",
    "Grammar": "compiler",
    "GrammarCompiler": "compiler",
    "apply_bitmask_": "masks",
    "full_bitmask": "masks",
    "pack": "masks",
    "unpack": "masks",
    "Matcher": "matcher",
    "prune_tree": "tree",
    "tree_alive": "tree",
    "tree_masks": "tree",
    "Vocabulary": "vocab",
    "builtin_vocabulary": "vocab",
}

if TYPE_CHECKING:
    from specd.structured.compiler import CompilerConfig, Grammar, GrammarCompiler
    from specd.structured.masks import apply_bitmask_, full_bitmask, pack, unpack
    from specd.structured.matcher import Matcher
    from specd.structured.tree import prune_tree, tree_alive, tree_masks
    from specd.structured.vocab import Vocabulary, builtin_vocabulary


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"specd.structured.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specd.structured' has no attribute {name!r}")


__all__ = [
    "TOOL_CLOSE",
    "TOOL_OPEN",
    "CompilerConfig",
    "Grammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarLimits",
    "GrammarSpec",
    "Matcher",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallParser",
    "ToolCallSpec",
    "ToolFunction",
    "Vocabulary",
    "apply_bitmask_",
    "builtin_vocabulary",
    "full_bitmask",
    "grammar_spec",
    "pack",
    "parse_tool_calls",
    "prune_tree",
    "response_format_spec",
    "structured_outputs_spec",
    "text_format_spec",
    "tools_system_prompt",
    "tree_alive",
    "tree_masks",
    "unpack",
]
