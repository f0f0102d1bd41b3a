"""Instance generator: draws solved MAPF-FrozenLake instances for an :class:`~envgen.core.config.EnvConfig`.

Layout of a stage. ``config.allocation()`` splits the budget over the sizes (largest remainder, each size within one
instance of its exact share). Within a size, exactly ``round(wait_ratio * count)`` slots ask for an instance that needs
coordination (optimal sum of costs above the sum of individual shortest paths) and the rest for one that does not;
the two kinds are interleaved evenly. So the achieved data ratio of a size is within ``1 / budget`` of its share and the
achieved wait ratio within ``0.5 / count`` of the target; the hole ratio is exact up to rounding to whole cells.

A draw for slot ``index``: ``round(hole_ratio * N * N)`` holes placed uniformly at random; each agent's goal uniform
over the free cells no other agent has as goal, then its start uniform over the free cells at distance at least
``min_path_length`` from that goal that no other agent starts on. Slots that need coordination alternate these draws
with head-on draws (see :func:`draw_instance`), in which the second agent walks part of the first one's shortest path
in reverse: natural draws rarely need a wait on open grids (under 1% on an empty 10x10), head-on draws often do.

The draw is solved (:func:`envgen.solver.cbs.solve`, within ``GeneratorOptions.solver``) and every draw ends in exactly one
outcome, counted per slot (:class:`DrawCounts`): accepted; rejected as **unsolvable** (proved: a goal out of reach, or
an exhaustive search); rejected as **over solver budget** (not proved either way: the only outcome that can drop a
solvable instance, so it is counted and reported, never silent); rejected as the wrong kind (needs a wait, or not);
a **duplicate** of an earlier or excluded instance (e.g. the benchmark's); or no placement for the starts and goals.
The counts of a stage go into its instances file (:func:`draw_statistics`) and the reports of the steps that write
one. The default budget decides 999 of 1,000 draws of 5 agents on 10x10 boards with half the cells holes (solved or
proved unsolvable; docs/lab-notes/solver.md); its limits count work, not time (the time limit is a safety net), so a stage is
the same on every machine. Earlier versions (:data:`GENERATOR_VERSIONS`) stay available, so a file regenerates byte for byte.

Every draw of slot ``index`` comes from one random stream seeded by ``(seed, index)``, so a stage is reproducible and an
instance can be regenerated from its record (given the hashes taken before it). After ``max_attempts`` rejected draws a
:class:`GenerationError` names the size, its knobs, the rejection counts and a fix.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from dataclasses import asdict, dataclass, field
from typing import Any

from envgen.solver import cbs_v1
from envgen.solver.cbs import Solved, SolveResult, SolverBudget, Unsolved, shortest_paths_agree, solve
from envgen.solver.cbs_search import CBSOptions
from envgen.core.config import EnvConfig, SizeConfig
from envgen.core.grid import Grid, grid_of
from envgen.core.instance import FREE, HOLE, Instance

GENERATOR_VERSION = "mapf-frozenlake-gen/3"
"""The current version, the default. 2: draws solved by the improved CBS and its exhaustive back-ups within a budget of
work (more hard draws accepted, other optimal plans), and the draw counts in every file it writes. 3: as 2, and a group
of agents that CBS and the exhaustive joint A* leave undecided is split by independence detection before the draw is
counted over budget (:func:`envgen.solver.cbs.independent_groups`); every draw version 2 decided is decided alike."""


class GenerationError(RuntimeError):
    """The generator could not fill a slot: the message names the infeasible part of the configuration, and ``size``
    says which map size."""

    def __init__(self, message: str, size: int | None = None) -> None:
        super().__init__(message)
        self.size = size


@dataclass(frozen=True)
class GeneratorVersion:
    """What a generator version solves draws with. The draws themselves are the same in every version; the solver
    decides which are accepted (over budget or not) and which optimal plan and node count a file records.

    Attributes:
        name: written into every row and file (``generator_version``).
        solve: the solver, ``solve(instance, budget)``.
        budget: its default solver budget.
        screens: a draw for a slot that needs a wait is rejected as "needs no wait" without a solve when the agents'
            shortest paths already agree (:func:`envgen.solver.cbs.shortest_paths_agree`), which is what the solve would say;
            the search of version 1 might run out of nodes on such a draw and count it otherwise, so it solves every
            draw.
    """

    name: str
    solve: Callable[[Instance, SolverBudget], SolveResult]
    budget: SolverBudget
    screens: bool = False


GENERATOR_VERSIONS: dict[int, GeneratorVersion] = {
    1: GeneratorVersion("mapf-frozenlake-gen/1", cbs_v1.solve, SolverBudget(max_nodes=2000, max_seconds=5.0)),
    2: GeneratorVersion("mapf-frozenlake-gen/2",
                        partial(solve, options=CBSOptions(independence=False, conflict_ties="earliest",
                                                          rectangle_starts=False, merge_order="breadth",
                                                          interleave=False, bypass_conflicts="all")),
                        SolverBudget(max_nodes=20_000, max_seconds=120.0, max_joint_states=100_000), screens=True),
    3: GeneratorVersion(GENERATOR_VERSION, partial(solve, options=CBSOptions(conflict_ties="earliest",
                                                                             rectangle_starts=False,
                                                                             merge_order="breadth",
                                                                             interleave=False,
                                                                             bypass_conflicts="all")),
                        SolverBudget(max_nodes=20_000, max_seconds=120.0, max_joint_states=100_000), screens=True),
}
"""Every version the generator can still produce, byte for byte. Version 1 (plain CBS, :mod:`envgen.solver.cbs_v1`, 2,000
nodes or 5 s per draw) is kept for the files written with it, such as the starting policy's demonstrations. Versions
2 and 3 count work, not time (the time limit only guards against a runaway solve): their node and state limits
decide every draw of the measured distributions (docs/lab-notes/solver.md), so a stage is the same on every machine."""


@dataclass(frozen=True)
class GeneratorOptions:
    """Settings of the generator itself (not of the environment, so not in the engineer's YAML).

    Attributes:
        max_attempts: rejected draws allowed per instance before :class:`GenerationError`.
        version: the generator version (:data:`GENERATOR_VERSIONS`); an earlier one regenerates its files exactly.
        solver: the budget of each draw's solve (:class:`envgen.solver.cbs.SolverBudget`; None: the version's default); a draw
            neither solved nor proved unsolvable within it is rejected as "over solver budget" and counted
            (:class:`DrawCounts`), since it may be a solvable instance left out.
    """

    max_attempts: int = 5000
    version: int = 3
    solver: SolverBudget | None = None

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"GeneratorOptions.max_attempts = {self.max_attempts}: must be at least 1")
        if self.version not in GENERATOR_VERSIONS:
            raise ValueError(f"GeneratorOptions.version = {self.version}: use one of {sorted(GENERATOR_VERSIONS)}")

    @property
    def budget(self) -> SolverBudget:
        """The solver budget in force: ``solver``, else the version's default."""
        return self.solver or GENERATOR_VERSIONS[self.version].budget

    @property
    def version_name(self) -> str:
        return GENERATOR_VERSIONS[self.version].name


REJECTIONS = ("no placement for starts/goals", "duplicate", "unsolvable", "over solver budget", "needs a wait",
              "needs no wait")
"""Why a draw is rejected: the keys of :class:`DrawCounts`'s ``rejected``."""


@dataclass(frozen=True)
class DrawCounts:
    """What the draws of one slot (or, summed, of a stage) came to: every draw is accepted or rejected for exactly one
    reason of :data:`REJECTIONS`."""

    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)

    @property
    def draws(self) -> int:
        return self.accepted + sum(self.rejected.values())

    @property
    def over_budget(self) -> int:
        """Draws that were neither solved nor proved unsolvable within the solver budget."""
        return self.rejected.get("over solver budget", 0)

    def __add__(self, other: DrawCounts) -> DrawCounts:
        both = Counter(self.rejected) + Counter(other.rejected)
        return DrawCounts(self.accepted + other.accepted, {k: both[k] for k in REJECTIONS if both[k]})


@dataclass(frozen=True)
class Slot:
    """What slot ``index`` of a stage asks for."""

    index: int
    size: int
    needs_wait: bool


@dataclass(frozen=True)
class Generated:
    """One generated instance with its ground truth and provenance."""

    slot: Slot
    instance: Instance
    solution: Solved
    draw_seed: int
    attempts: int
    counts: DrawCounts = DrawCounts()
    version: str = GENERATOR_VERSION
    """The generator version that made it (:attr:`GeneratorVersion.name`)."""


def slot_layout(config: EnvConfig) -> list[Slot]:
    """The stage's slots in order: sizes ascending, wait and no-wait slots interleaved within each size."""
    slots: list[Slot] = []
    for size, count in config.allocation().items():
        n_wait = round(config.sizes[size].wait_ratio * count)
        for j in range(count):
            # Bresenham-style interleaving: slot j needs a wait when the running quota steps up.
            wait = (j + 1) * n_wait // count > j * n_wait // count if count else False
            slots.append(Slot(len(slots), size, wait))
    return slots


def draw_seed(seed: int, index: int) -> int:
    """The seed of slot ``index``'s random stream (stable across Python versions and platforms)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def draw_instance(rng: random.Random, size: int, knobs: SizeConfig, num_agents: int, head_on: bool = False) -> Instance | None:
    """One random instance for a size, or None when the holes leave no valid placement for some agent.

    Goals are drawn first (uniform over free cells no other agent has as goal), then the start uniform over the free
    cells at distance at least ``min_path_length`` from the goal that no other agent starts on. With ``head_on``, the
    second agent instead walks a random stretch of a random shortest path of the first agent backwards (its start and
    goal both lie on that path, at least ``min_path_length`` apart): a proposal that often needs coordination.
    """
    cells = size * size
    holes = set(rng.sample(range(cells), round(knobs.hole_ratio * cells)))
    flat = [FREE] * cells
    for i in holes:
        flat[i] = HOLE
    text = "".join(flat)
    rows = tuple([text[r:r + size] for r in range(0, cells, size)])
    grid = grid_of(rows)
    free_cells = [i for i in range(cells) if i not in holes]
    min_len = knobs.min_path_length
    starts: list[int] = []
    goals: list[int] = []
    for a in range(num_agents):
        if head_on and a == 1:
            path = _random_shortest_path(rng, grid, starts[0], goals[0])
            span = len(path) - 1
            i = rng.randint(0, span - min_len)
            s, g = path[rng.randint(i + min_len, span)], path[i]
            if s in starts or g in goals:
                return None
        else:
            g = rng.choice([c for c in free_cells if c not in goals])
            dist = grid.distances_from(g)
            options = [c for c in free_cells if dist[c] >= min_len and c not in starts]
            if not options:
                return None
            s = rng.choice(options)
        starts.append(s)
        goals.append(g)
    return Instance(rows, tuple(divmod(s, size) for s in starts), tuple(divmod(g, size) for g in goals))


def _random_shortest_path(rng: random.Random, grid: Grid, start: int, goal: int) -> list[int]:
    """A shortest path chosen by uniform random tie-breaking at every step."""
    dist = grid.distances_from(goal)
    path = [start]
    u = start
    while u != goal:
        d = dist[u] - 1
        u = rng.choice([v for v in grid.neighbors[u] if dist[v] == d])
        path.append(u)
    return path


def fill_slot(slot: Slot, config: EnvConfig, options: GeneratorOptions, taken: set[str],
              drawn: list[str] | None = None) -> Generated:
    """Draw until an instance fits the slot; raises :class:`GenerationError` after ``options.max_attempts``. The
    accepted instance's hash is added to ``taken``; ``drawn``, when given, gets the hash of every instance drawn."""
    knobs = config.sizes[slot.size]
    seed = draw_seed(config.seed, slot.index)
    rng = random.Random(seed)
    rejected: Counter[str] = Counter()
    for attempt in range(1, options.max_attempts + 1):
        head_on = slot.needs_wait and config.num_agents > 1 and attempt % 2 == 0
        instance = draw_instance(rng, slot.size, knobs, config.num_agents, head_on)
        if instance is None:
            rejected["no placement for starts/goals"] += 1
            continue
        digest = instance.content_hash
        if drawn is not None:
            drawn.append(digest)
        if digest in taken:
            rejected["duplicate"] += 1
            continue
        version = GENERATOR_VERSIONS[options.version]
        if slot.needs_wait and version.screens and shortest_paths_agree(instance):
            rejected["needs no wait"] += 1
            continue
        result = version.solve(instance, options.budget)
        if isinstance(result, Unsolved):
            rejected["unsolvable" if result.reason.proven else "over solver budget"] += 1
            continue
        if result.needs_wait != slot.needs_wait:
            rejected["needs a wait" if result.needs_wait else "needs no wait"] += 1
            continue
        taken.add(digest)
        return Generated(slot, instance, result, seed, attempt,
                         DrawCounts(1, {k: rejected[k] for k in REJECTIONS if rejected[k]}), options.version_name)
    raise GenerationError(_infeasible_message(slot, config, options, rejected), slot.size)


def _infeasible_message(slot: Slot, config: EnvConfig, options: GeneratorOptions, rejected: Counter[str]) -> str:
    k = config.sizes[slot.size]
    n = slot.size
    want = "needs a wait" if slot.needs_wait else "needs no wait"
    why = ", ".join(f"{reason}: {count}" for reason, count in rejected.most_common())
    if slot.needs_wait and rejected["needs no wait"] >= options.max_attempts // 2:
        fix = f"lower sizes.{n}.wait_ratio (now {k.wait_ratio}), or raise hole_ratio/num_agents so agents meet more often"
    elif not slot.needs_wait and rejected["needs a wait"] >= options.max_attempts // 2:
        fix = f"raise sizes.{n}.wait_ratio (now {k.wait_ratio}) or lower hole_ratio (now {k.hole_ratio})"
    elif rejected["duplicate"] >= options.max_attempts // 2:
        fix = f"this size has too few distinct instances: lower sizes.{n}.data_ratio (now {k.data_ratio}) or the budget"
    else:
        fix = f"lower sizes.{n}.hole_ratio (now {k.hole_ratio}) or sizes.{n}.min_path_length (now {k.min_path_length})"
    return (f"sizes.{n}: no instance that {want} in {options.max_attempts} draws for slot {slot.index} "
            f"(num_agents={config.num_agents}, hole_ratio={k.hole_ratio}, wait_ratio={k.wait_ratio}, "
            f"min_path_length={k.min_path_length}); rejected draws: {why}. Fix: {fix}.")


def draw_statistics(generated: Iterable[Generated], options: GeneratorOptions | None = None) -> dict[str, Any]:
    """What a stage's draws came to, in total and per size, with the solver budget they were solved within (JSON-ready;
    no timings, so a stage's file stays byte-identical across runs)."""
    options = options or GeneratorOptions()
    total = DrawCounts()
    by_size: dict[int, DrawCounts] = {}
    for g in generated:
        total = total + g.counts
        by_size[g.slot.size] = by_size.get(g.slot.size, DrawCounts()) + g.counts
    return {
        "draws": total.draws,
        "accepted": total.accepted,
        "rejected": total.rejected,
        "over_budget": total.over_budget,
        "by_size": {str(n): {"draws": c.draws, "accepted": c.accepted, "rejected": c.rejected}
                    for n, c in sorted(by_size.items())},
        "generator_version": options.version_name,
        "solver_budget": asdict(options.budget),
    }


def generate(config: EnvConfig, options: GeneratorOptions | None = None, exclude: Iterable[str] = (),
             on_progress: Callable[[int], None] | None = None) -> Iterator[Generated]:
    """Yield the stage's instances in slot order. ``exclude`` holds content hashes that must not appear (for example
    the benchmark's); ``on_progress(1)`` is called after each instance."""
    options = options or GeneratorOptions()
    taken = set(exclude)
    for slot in slot_layout(config):
        yield fill_slot(slot, config, options, taken)
        if on_progress is not None:
            on_progress(1)
