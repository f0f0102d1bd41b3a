"""Prompts: an instance rendered into chat messages that state the rules and the answer format.

The answer format is one line per agent, ``Agent 1: RIGHT DOWN WAIT``, optionally inside ``<answer>...</answer>``.
:class:`PromptStyle` chooses the map view (ASCII grid or coordinate list), the move vocabulary (full words as in the
paper, or single letters ``U D L R W`` that small tokenizers encode as one token each), an optional thinking section,
and whether the answer tags are asked for. The rules are kept short: on a small model the prompt is most of the
compute of a rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from envgen.core.grid import DELTAS, Move
from envgen.core.instance import Instance
from envgen.core.render import agent_letter, ascii_grid, render_coords

WORDS = ("UP", "DOWN", "LEFT", "RIGHT", "WAIT")
LETTERS = ("U", "D", "L", "R", "W")


@dataclass(frozen=True)
class PromptStyle:
    """How an instance is shown to the model.

    Attributes:
        view: ``"grid"`` (ASCII picture with row/column numbers) or ``"coords"`` (coordinate list).
        moves: ``"words"`` (UP DOWN LEFT RIGHT WAIT) or ``"letters"`` (U D L R W).
        think: ask for reasoning inside ``<think>...</think>`` before the answer.
        answer_tags: ask for the answer inside ``<answer>...</answer>`` (the parser accepts it either way).
        system: put the rules in a system message (else at the top of the user message).
        numbers: print row and column numbers around the grid (about a third of a grid's tokens).
        trace: ask the model to write, after every move, the cell it reaches, e.g. ``R (0,1) D (1,1)``: a running
            position a small model can condition its next move on. The parser drops the cells.
    """

    view: Literal["grid", "coords"] = "grid"
    moves: Literal["words", "letters"] = "words"
    think: bool = False
    answer_tags: bool = True
    system: bool = True
    numbers: bool = True
    trace: bool = False

    def __post_init__(self) -> None:
        if self.view not in ("grid", "coords"):
            raise ValueError(f"PromptStyle.view = {self.view!r}: use 'grid' or 'coords'")
        if self.moves not in ("words", "letters"):
            raise ValueError(f"PromptStyle.moves = {self.moves!r}: use 'words' or 'letters'")

    @property
    def vocabulary(self) -> tuple[str, ...]:
        return WORDS if self.moves == "words" else LETTERS


def rules(style: PromptStyle) -> str:
    """The task's rules in a few sentences."""
    u, d, l, r, w = style.vocabulary
    moves = f"{u} {d} {l} {r} {w}" if style.moves == "words" else f"{u}=up {d}=down {l}=left {r}=right {w}=wait"
    return (f"Route every agent from its start to its goal on the grid. Each step, every agent makes one move: {moves}. "
            "Never leave the grid or enter a hole (H). Two agents may not share a cell or swap cells. "
            "An agent stays on its goal after its last move. Use as few moves as possible.")


def answer_format(instance: Instance, style: PromptStyle) -> str:
    """How to answer, with an example line per agent."""
    u, d, l, r, w = style.vocabulary
    if style.trace:
        example = "\n".join(f"Agent {a + 1}: " + (f"{r} (0,1) {d} (1,1) {w} (1,1)" if a % 2 == 0 else f"{w} (2,2) {l} (2,1) {u} (1,1)")
                             for a in range(min(instance.num_agents, 2)))
        what = "one line per agent, each move followed by the cell it reaches"
    else:
        example = "\n".join(f"Agent {a + 1}: {' '.join((r, d, w) if a % 2 == 0 else (w, l, u))}" for a in range(min(instance.num_agents, 2)))
        what = "one line per agent"
    think = "Think inside <think></think>, then give " if style.think else "Give "
    where = " inside <answer></answer>" if style.answer_tags else ""
    return f"{think}{what}{where}, like:\n{example}"


def board(instance: Instance, style: PromptStyle) -> str:
    """The map and the agents' tasks."""
    if style.view == "coords":
        return render_coords(instance)
    tasks = "\n".join(f"Agent {a + 1}: {agent_letter(a)} ({s[0]},{s[1]}) to {agent_letter(a).lower()} ({g[0]},{g[1]})"
                      for a, (s, g) in enumerate(zip(instance.starts, instance.goals)))
    return f"{ascii_grid(instance, numbers=style.numbers)}\n{tasks}"


def format_answer(instance: Instance, moves: list[list[str]], style: PromptStyle = PromptStyle()) -> str:
    """A plan written exactly in the answer format the prompt asks for (used for demonstrations).

    >>> from envgen.core.instance import Instance
    >>> inst = Instance(("FF", "FF"), ((0, 0),), ((1, 1),))
    >>> print(format_answer(inst, [["RIGHT", "DOWN"]], PromptStyle(moves="letters", trace=True)))
    <answer>
    Agent 1: R (0,1) D (1,1)
    </answer>
    """
    letter = {m: (m.value if style.moves == "words" else m.value[0]) for m in Move}
    lines = []
    for a, agent_moves in enumerate(moves):
        r, c = instance.starts[a]
        parts = []
        for word in agent_moves:
            move = Move(word)
            dr, dc = DELTAS[move]
            r, c = r + dr, c + dc
            parts.append(f"{letter[move]} ({r},{c})" if style.trace else letter[move])
        lines.append(f"Agent {a + 1}: {' '.join(parts)}".rstrip())
    body = "\n".join(lines)
    return f"<answer>\n{body}\n</answer>" if style.answer_tags else body


def build_messages(instance: Instance, style: PromptStyle = PromptStyle()) -> list[dict[str, str]]:
    """Chat messages (``role``/``content``) for one instance.

    >>> from envgen.core.instance import Instance
    >>> msgs = build_messages(Instance(("FF", "FH"), ((0, 0),), ((1, 0),)))
    >>> print(msgs[1]["content"])
      0 1
    0 A .
    1 a H
    Agent 1: A (0,0) to a (1,0)
    Give one line per agent inside <answer></answer>, like:
    Agent 1: RIGHT DOWN WAIT
    """
    user = f"{board(instance, style)}\n{answer_format(instance, style)}"
    if style.system:
        return [{"role": "system", "content": rules(style)}, {"role": "user", "content": user}]
    return [{"role": "user", "content": f"{rules(style)}\n{user}"}]
