"""A deliberately naive plan checker, written independently of envgen.core.simulate, for differential tests.

Same rules and the same ordering of failures: by time step; at one step an agent's own fault (off grid, unknown move,
hole) before a conflict; lower agent index first; vertex before edge conflicts at one step.
"""

from __future__ import annotations

DELTA = {"UP": (-1, 0), "DOWN": (1, 0), "LEFT": (0, -1), "RIGHT": (0, 1), "WAIT": (0, 0)}


def reference_check(instance, plan):
    """Returns ("valid", soc, makespan) or (category, agent, step)."""
    n = instance.num_agents
    if len(plan) != n:
        return ("wrong_agent_count", None, 0)
    h, w = instance.height, instance.width
    horizon = max((len(p) for p in plan), default=0)
    pos = [tuple(s) for s in instance.starts]
    history = [list(pos)]
    for t in range(1, horizon + 1):
        new = []
        for a in range(n):
            if t - 1 < len(plan[a]):
                word = plan[a][t - 1]
                if word not in DELTA:
                    return ("illegal_move", a, t)
                dr, dc = DELTA[word]
                r, c = pos[a][0] + dr, pos[a][1] + dc
                if not (0 <= r < h and 0 <= c < w):
                    return ("off_grid", a, t)
                if instance.rows[r][c] == "H":
                    return ("hole", a, t)
                new.append((r, c))
            else:
                new.append(pos[a])
        for a in range(n):
            for b in range(a + 1, n):
                if new[a] == new[b]:
                    return ("vertex_conflict", a, t)
        for a in range(n):
            for b in range(a + 1, n):
                if new[a] == pos[b] and new[b] == pos[a] and new[a] != pos[a]:
                    return ("edge_conflict", a, t)
        pos = new
        history.append(list(pos))
    costs = []
    for a in range(n):
        if pos[a] != tuple(instance.goals[a]):
            return ("goal_not_reached", a, len(plan[a]))
        cost = 0
        for t, snapshot in enumerate(history):
            if snapshot[a] != tuple(instance.goals[a]):
                cost = t + 1
        costs.append(cost)
    return ("valid", sum(costs), max(costs))
