import random
import string

import pytest

from envgen.core.grid import Move
from envgen.core.instance import Instance
from envgen.llm.parse import MAX_MOVES, ParsedPlan, ParseError, ParseFailure, parse_answer
from envgen.llm.prompt import PromptStyle, build_messages
from envgen.core.simulate import paths_to_moves

from tests.helpers import random_solved

INST = Instance(("FFH", "FFF", "HFF"), ((0, 0), (2, 2)), ((2, 1), (0, 1)))


def test_prompt_states_rules_board_and_format():
    system, user = build_messages(INST)
    assert system["role"] == "system" and "hole (H)" in system["content"] and "UP DOWN LEFT RIGHT WAIT" in system["content"]
    assert user["content"].splitlines()[:4] == ["  0 1 2", "0 A b H", "1 . . .", "2 H a B"]
    assert "Agent 1: A (0,0) to a (2,1)" in user["content"] and "<answer></answer>" in user["content"]


@pytest.mark.parametrize("style", [
    PromptStyle(moves="letters"), PromptStyle(view="coords"), PromptStyle(think=True), PromptStyle(answer_tags=False),
    PromptStyle(system=False), PromptStyle(numbers=False),
])
def test_prompt_variants(style):
    msgs = build_messages(INST, style)
    text = "\n".join(m["content"] for m in msgs)
    assert len(msgs) == (2 if style.system else 1)
    assert ("U=up" in text) == (style.moves == "letters")
    assert ("Holes: (0,2) (2,0)" in text) == (style.view == "coords")
    assert ("<think>" in text) == style.think
    assert ("<answer>" in text) == style.answer_tags
    assert ("  0 1 2" in text) == (style.view == "grid" and style.numbers)
    with pytest.raises(ValueError, match="view"):
        PromptStyle(view="picture")


@pytest.mark.parametrize("text, moves", [
    ("Agent 1: RIGHT DOWN\nAgent 2: LEFT", [["RIGHT", "DOWN"], ["LEFT"]]),
    ("<answer>\nagent 1: right, down\nAGENT 2: wait\n</answer>", [["RIGHT", "DOWN"], ["WAIT"]]),
    ("Let me think.\n<think>Agent 1: UP</think>\n**Agent 1:** R D W\n**Agent 2:** L", [["RIGHT", "DOWN", "WAIT"], ["LEFT"]]),
    ("- A1: RRD\n- A2: w l", [["RIGHT", "RIGHT", "DOWN"], ["WAIT", "LEFT"]]),
    ("Agent 2 -> LEFT\nAgent 1 -> UP -> UP", [["UP", "UP"], ["LEFT"]]),
    ("<answer>Agent 1: DOWN</answer> oops <answer>Agent 1: UP\nAgent 2: STAY</answer>", [["UP"], ["WAIT"]]),
    ("Agent 1: RIGHT (goal reached)\nAgent 2:", [["RIGHT"], []]),
    ("```\nAgent 1: UP.\nAgent 2: DOWN.\n```", [["UP"], ["DOWN"]]),
])
def test_tolerant_parsing(text, moves):
    result = parse_answer(text, 2)
    assert isinstance(result, ParsedPlan), result
    assert result.words() == moves


@pytest.mark.parametrize("text, reason", [
    ("", ParseError.EMPTY),
    ("<answer>   </answer>", ParseError.EMPTY),
    ("I cannot solve this.", ParseError.NO_AGENT_LINES),
    ("Agent 1: RIGHT JUMP\nAgent 2: UP", ParseError.UNKNOWN_MOVE),
    ("Agent 1: UP\nAgent 1: DOWN", ParseError.DUPLICATE_AGENT),
    ("Agent 1: UP", ParseError.MISSING_AGENT),
    ("Agent 1: UP\nAgent 2: UP\nAgent 3: UP", ParseError.EXTRA_AGENT),
    ("Agent 1: " + "DOWN " * (MAX_MOVES + 1) + "\nAgent 2: UP", ParseError.TOO_LONG),
    ("x" * 30_000, ParseError.TOO_LONG),
])
def test_failures_are_classified(text, reason):
    result = parse_answer(text, 2)
    assert isinstance(result, ParseFailure) and result.reason is reason and result.detail


@pytest.mark.parametrize("moves", ["words", "letters"])
def test_solver_plans_written_in_the_prompt_format_parse_back(moves):
    for seed in range(40):
        got = random_solved(seed, 3 + seed % 5, 0.2, 1 + seed % 3)
        if got is None:
            continue
        inst, sol = got
        plan = paths_to_moves(sol.paths)
        vocab = {m: (m.value if moves == "words" else m.value[0]) for m in Move}
        text = "<answer>\n" + "\n".join(f"Agent {a + 1}: {' '.join(vocab[m] for m in p)}" for a, p in enumerate(plan)) + "\n</answer>"
        result = parse_answer(text, inst.num_agents)
        assert isinstance(result, ParsedPlan) and [list(p) for p in result.moves] == plan


def test_fuzz_never_raises_and_always_classifies():
    rng = random.Random(1234)
    good = "<answer>\nAgent 1: RIGHT DOWN WAIT\nAgent 2: LEFT UP\n</answer>"
    alphabet = string.printable + "→—•：<>/\u200b\x00ÄÖ漢字"
    pieces = ["Agent", "agent 1:", "A2:", "<answer>", "</answer>", "<think>", "</think>", "UP", "RIGHT", "W", "(", ")",
              "**", "\n", "-", ":", "1", "2", "99999999999999999999", " "]
    seen = set()
    for i in range(10_000):
        kind = i % 4
        if kind == 0:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        elif kind == 1:
            text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))
        elif kind == 2:
            chars = list(good)
            for _ in range(rng.randint(1, 8)):
                op = rng.randrange(3)
                pos = rng.randrange(len(chars) + 1)
                if op == 0 and chars:
                    del chars[min(pos, len(chars) - 1)]
                elif op == 1:
                    chars.insert(pos, rng.choice(alphabet))
                else:
                    chars[pos:pos] = list(rng.choice(pieces))
            text = "".join(chars)
        else:
            text = rng.choice([None, 42, b"bytes", ["Agent 1: UP"], good * rng.randint(1, 50)])
        result = parse_answer(text, rng.randint(1, 3))
        assert isinstance(result, (ParsedPlan, ParseFailure))
        seen.add(result.reason if isinstance(result, ParseFailure) else "parsed")
    assert "parsed" in seen and len(seen) >= 5
