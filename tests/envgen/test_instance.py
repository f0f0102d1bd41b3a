import pytest

from envgen.core.instance import Instance, InstanceError

TEXT = """mapf-frozenlake v1
grid 3x4
FFHF
FHFF
FFFF
agent 1: 0,0 -> 2,3
agent 2: 2,0 -> 0,3
"""


def test_text_round_trip_and_fields():
    inst = Instance.from_str(TEXT)
    assert inst.to_str() == TEXT
    assert (inst.height, inst.width, inst.num_agents) == (3, 4, 2)
    assert inst.holes == ((0, 2), (1, 1))
    assert Instance.from_str(inst.to_str()) == inst


def test_comments_and_blank_lines_are_ignored():
    noisy = "# a comment\n\n" + TEXT.replace("grid 3x4", "grid 3x4  # shape")
    assert Instance.from_str(noisy) == Instance.from_str(TEXT)


def test_content_hash_is_stable_and_content_based():
    a = Instance.from_str(TEXT)
    b = Instance(a.rows, a.starts, a.goals)
    assert a.content_hash == b.content_hash
    import hashlib

    assert a.content_hash == hashlib.sha256(TEXT.encode()).hexdigest()
    assert len(a.content_hash) == 64
    swapped = Instance(a.rows, a.goals, a.starts)
    assert swapped.content_hash != a.content_hash
    assert hash(a) == hash(b) and a == b


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.replace("mapf-frozenlake v1", "hello"), "line 1: expected 'mapf-frozenlake v1'"),
        (lambda t: t.replace("grid 3x4", "grid 3 by 4"), "line 2: expected 'grid HxW'"),
        (lambda t: t.replace("FHFF", "FHXF"), "line 4: expected 4 cells"),
        (lambda t: t.replace("agent 2: 2,0 -> 0,3", "agent 3: 2,0 -> 0,3"), "line 7: expected 'agent 2"),
        (lambda t: t.replace("agent 2: 2,0 -> 0,3", "agent 2: 1,1 -> 0,3"), "is a hole"),
        (lambda t: t.replace("agent 2: 2,0 -> 0,3", "agent 2: 0,0 -> 0,3"), "share a cell"),
        (lambda t: t.replace("agent 2: 2,0 -> 0,3", "agent 2: 9,0 -> 0,3"), "outside the 3x4 grid"),
    ],
)
def test_malformed_text_names_the_problem(mutate, message):
    with pytest.raises(InstanceError, match=message):
        Instance.from_str(mutate(TEXT))


def test_constructor_validates():
    with pytest.raises(InstanceError, match="equally long"):
        Instance(("FF", "F"), ((0, 0),), ((0, 1),))
    with pytest.raises(InstanceError, match="2 starts but 1 goals"):
        Instance(("FF", "FF"), ((0, 0), (1, 1)), ((0, 1),))


def test_with_agents_prefix():
    inst = Instance.from_str(TEXT)
    assert inst.with_agents(1).starts == ((0, 0),)
    with pytest.raises(InstanceError):
        inst.with_agents(3)
