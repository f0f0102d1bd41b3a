"""Answer parser: a model's text in, a joint plan or a classified parse failure out. Never raises.

Accepted: one line per agent, ``Agent 1: RIGHT DOWN WAIT`` (also ``agent1 -``, ``A1:``, ``**Agent 1**:``, list
bullets), moves as words (``UP DOWN LEFT RIGHT WAIT``, any case, ``STAY`` for ``WAIT``) or letters (``U D L R W``),
separated by spaces, commas, arrows or nothing for letters (``RRDW``). Text around the answer is ignored: when
``<answer>...</answer>`` is present the last such block is read, ``<think>...</think>`` is dropped, and lines that
name no agent are skipped. Remarks in parentheses after the moves are dropped. Anything else in an agent's line is a
parse failure naming the token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from envgen.core.grid import Move

MAX_MOVES = 256
"""Longest move list accepted per agent; longer answers are runaway repetition (``too_long``)."""
MAX_CHARS = 20_000
"""Text beyond this many characters is not read (``too_long`` if no answer was found before it)."""

_TOKENS: dict[str, Move] = {
    "UP": Move.UP, "U": Move.UP, "DOWN": Move.DOWN, "D": Move.DOWN, "LEFT": Move.LEFT, "L": Move.LEFT,
    "RIGHT": Move.RIGHT, "R": Move.RIGHT, "WAIT": Move.WAIT, "W": Move.WAIT, "STAY": Move.WAIT,
}
_THINK = re.compile(r"<think>.*?(</think>|$)", re.S | re.I)
_ANSWER = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.S | re.I)
_AGENT = re.compile(r"^[\s>*_#`\-+•|]*(?:agent|a)[\s_#]*(\d{1,3})[\s*_`]*[:：.)\-=>]+(.*)$", re.I)
_PARENS = re.compile(r"\([^()]*\)|\[[^\[\]]*\]")
_SPLIT = re.compile(r"[\s,;/|>→\-–—.*`_'\"]+")


class ParseError(str, Enum):
    """Why an answer could not be read as a plan."""

    EMPTY = "empty"
    """No text (or only whitespace / an empty answer block)."""
    NO_AGENT_LINES = "no_agent_lines"
    """No line of the form ``Agent N: moves``."""
    UNKNOWN_MOVE = "unknown_move"
    """An agent's line holds a token that is not a move."""
    DUPLICATE_AGENT = "duplicate_agent"
    """Two lines for the same agent."""
    MISSING_AGENT = "missing_agent"
    """Some agent 1..N has no line."""
    EXTRA_AGENT = "extra_agent"
    """A line for an agent number outside 1..N."""
    TOO_LONG = "too_long"
    """More than ``MAX_MOVES`` moves for an agent, or no answer within ``MAX_CHARS`` characters."""


@dataclass(frozen=True)
class ParsedPlan:
    """A readable answer: per agent its moves."""

    moves: tuple[tuple[Move, ...], ...]
    parsed = True

    def words(self) -> list[list[str]]:
        return [[m.value for m in agent] for agent in self.moves]


@dataclass(frozen=True)
class ParseFailure:
    """An unreadable answer and why."""

    reason: ParseError
    detail: str
    parsed = False


ParseResult = ParsedPlan | ParseFailure


def parse_answer(text: object, num_agents: int) -> ParseResult:
    """Read a joint plan for ``num_agents`` agents from a model's answer.

    >>> parse_answer("Sure!\\n<answer>\\n**Agent 1:** RIGHT, down\\nAgent 2: W L (then done)\\n</answer>", 2).words()
    [['RIGHT', 'DOWN'], ['WAIT', 'LEFT']]
    >>> parse_answer("Agent 1: RIGHT JUMP", 1).reason.value
    'unknown_move'
    """
    try:
        return _parse(text, num_agents)
    except Exception as e:  # noqa: BLE001 - the contract is to classify every input, whatever happens
        return ParseFailure(ParseError.NO_AGENT_LINES, f"unreadable answer ({type(e).__name__})")


def _parse(text: object, num_agents: int) -> ParseResult:
    if not isinstance(text, str):
        text = "" if text is None else str(text)
    truncated = len(text) > MAX_CHARS
    text = _THINK.sub(" ", text[:MAX_CHARS])
    blocks = _ANSWER.findall(text)
    body = blocks[-1] if blocks else text
    if not body.strip():
        if truncated:
            return ParseFailure(ParseError.TOO_LONG, f"nothing but blanks in the first {MAX_CHARS} characters")
        return ParseFailure(ParseError.EMPTY, "the answer is empty")
    found: dict[int, tuple[Move, ...]] = {}
    for line in body.splitlines():
        m = _AGENT.match(line)
        if not m:
            continue
        agent = int(m.group(1))
        rest = _PARENS.sub(" ", m.group(2))
        moves: list[Move] = []
        for token in _SPLIT.split(rest.upper()):
            if not token:
                continue
            move = _TOKENS.get(token)
            if move is not None:
                moves.append(move)
            elif set(token) <= set("UDLRW"):
                moves.extend(_TOKENS[ch] for ch in token)  # letters written together: "RRDW"
            else:
                return ParseFailure(ParseError.UNKNOWN_MOVE, f"agent {agent}: {token[:20]!r} is not a move")
            if len(moves) > MAX_MOVES:
                return ParseFailure(ParseError.TOO_LONG, f"agent {agent}: more than {MAX_MOVES} moves")
        if agent in found:
            return ParseFailure(ParseError.DUPLICATE_AGENT, f"agent {agent} has two lines")
        if not 1 <= agent <= num_agents:
            return ParseFailure(ParseError.EXTRA_AGENT, f"agent {agent} does not exist (agents 1..{num_agents})")
        found[agent] = tuple(moves)
    if not found:
        if truncated:
            return ParseFailure(ParseError.TOO_LONG, f"no agent line in the first {MAX_CHARS} characters")
        return ParseFailure(ParseError.NO_AGENT_LINES, "no line of the form 'Agent N: moves'")
    missing = [a for a in range(1, num_agents + 1) if a not in found]
    if missing:
        return ParseFailure(ParseError.MISSING_AGENT, f"no line for agent(s) {missing}")
    return ParsedPlan(tuple(found[a] for a in range(1, num_agents + 1)))
