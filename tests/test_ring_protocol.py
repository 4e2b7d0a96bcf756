"""A model of the staging rings' protocol (cc/transport/ring.cuh), run under
random interleavings on CPU.

One thread block index on R ranks (blocks of one index only talk to each
other): a sender per rank writes its chunks i = 0, 1, ... into slot i % depth of
every peer's ring, waiting for every peer's credit of chunk i - depth first;
W receiver warps per rank drain the slots. Dispatch receivers walk (chunk,
peer) chunk-major and wait for every peer; combine receivers walk their own
items and wait for the peers their token needs, or, when the ring wraps, for
every peer (the rule cc/intranode/combine.cu follows). A slot's credit
goes back when the expected number of warps has drained it (a shared counter,
as in drain_slot). The model asserts what the kernels rely on: no deadlock,
and no slot rewritten while a warp still reads it (every read sees the chunk
it expects). With the old combine rule (wait only for the peers the token
needs) the model finds the race the review found.
"""
from __future__ import annotations

import random

import pytest


class Sim:
    def __init__(self, R, n_chunks, depth, W, items, need, wraps_rule, seed):
        self.R, self.n, self.depth, self.W = R, n_chunks, depth, W
        self.items = items          # items[ci] -> per warp list of item ids (combine)
        self.need = need            # need[r][ci][item] -> set of peers that item reads
        self.wraps_rule = wraps_rule
        self.rng = random.Random(seed)
        self.slot = {}              # (dest r, src s, q) -> chunk id held
        self.ready = {}             # (dest r, src s, q) -> chunk id + 1 published
        self.credit = {}            # (src s, dest r, q) -> chunk id + 1 drained
        self.count = {}             # (r, key, q) -> drains counted
        self.send_ci = [0] * R
        self.violations = []

    # -- agents -----------------------------------------------------------------
    def sender_step(self, s):
        ci = self.send_ci[s]
        if ci >= self.n:
            return False
        q = ci % self.depth
        if ci >= self.depth:
            for r in range(self.R):
                if r != s and self.credit.get((s, r, q), 0) < ci - self.depth + 1:
                    return False   # waits for a credit
        for r in range(self.R):
            if r != s:
                self.slot[(r, s, q)] = ci
                self.ready[(r, s, q)] = ci + 1
        self.send_ci[s] += 1
        return True

    def drain(self, r, key, q, ci, expect, peers):
        c = self.count.get((r, key, q), 0) + 1
        if c == expect:
            self.count[(r, key, q)] = 0
            if ci + self.depth < self.n:   # some sender will wait for it
                for s in peers:
                    self.credit[(s, r, q)] = ci + 1
        else:
            self.count[(r, key, q)] = c

    def schedule(self, agents, step):
        """Moves a random runnable agent until none can move."""
        while True:
            live = [a for a in agents if step(a, True)]
            if not live:
                return
            step(self.rng.choice(live), False)

    def read(self, r, s, q, ci):
        if self.slot.get((r, s, q)) != ci:
            self.violations.append((r, s, q, ci, self.slot.get((r, s, q))))


class Dispatch(Sim):
    """Receiver warp w of rank r: (ci, pi) chunk-major, every peer."""

    def run(self):
        R = self.R
        cur = {(r, w): (0, 1) for r in range(R) for w in range(self.W)}
        agents = [("s", s) for s in range(R)] + [("w", k) for k in cur]
        self.schedule(agents, lambda a, probe: self._step(a, cur, probe))
        return all(self._finished(c) for c in cur.values()) and min(self.send_ci) >= self.n

    def _finished(self, c):
        return c[0] >= self.n

    def _advance(self, ci, pi):
        """The cursor after (chunk ci, peer pi): every peer of a chunk first."""
        pi += 1
        return (ci + 1, 1) if pi == self.R else (ci, pi)

    def _step(self, a, cur, probe):
        kind, who = a
        if kind == "s":
            if probe:
                return self.send_ci[who] < self.n and self._can_send(who)
            return self.sender_step(who)
        r, w = who
        ci, pi = cur[who]
        if self._finished((ci, pi)) or self.R == 1:
            return False
        s, q = (r + pi) % self.R, ci % self.depth
        if self.ready.get((r, s, q), 0) < ci + 1:
            return False
        if probe:
            return True
        self.read(r, s, q, ci)
        self.drain(r, s, q, ci, self.W, [s])
        cur[who] = self._advance(ci, pi)
        return True

    def _can_send(self, s):
        ci = self.send_ci[s]
        q = ci % self.depth
        return ci < self.depth or all(self.credit.get((s, r, q), 0) >= ci - self.depth + 1
                                      for r in range(self.R) if r != s)


class Combine(Dispatch):
    """Receiver warp w of rank r walks its items of chunks 0, 1, ...; an item
    waits for the peers its token needs (or all peers when the ring wraps and
    the rule is on); after its last item of a chunk the warp drains the slot of
    every peer at once, expecting the number of warps with items there."""

    def run(self):
        R = self.R
        cur = {(r, w): (0, 0) for r in range(R) for w in range(self.W)}   # (ci, item index)
        for k in list(cur):
            cur[k] = self._settle(k, 0)
        agents = [("s", s) for s in range(R)] + [("w", k) for k in cur]
        self.schedule(agents, lambda a, probe: self._cstep(a, cur, probe))
        return all(c[0] >= self.n for c in cur.values()) and min(self.send_ci) >= self.n

    def _settle(self, k, ci):
        while ci < self.n and not self.items[ci][k[1]]:
            ci += 1
        return (ci, 0)

    def _cstep(self, a, cur, probe):
        kind, who = a
        if kind == "s":
            return self._step(a, cur, probe)
        r, w = who
        ci, j = cur[who]
        if ci >= self.n:
            return False
        q = ci % self.depth
        item = self.items[ci][w][j]
        wraps = self.wraps_rule and self.depth < self.n
        peers = [s for s in range(self.R) if s != r
                 and (wraps or s in self.need[r][ci][item])]
        if any(self.ready.get((r, s, q), 0) < ci + 1 for s in peers):
            return False
        if probe:
            return True
        for s in self.need[r][ci][item]:
            self.read(r, s, q, ci)
        j += 1
        if j == len(self.items[ci][w]):   # done with chunk ci: drain every peer's slot
            expect = sum(1 for ww in range(self.W) if self.items[ci][ww])
            self.drain(r, "all", q, ci, expect, [s for s in range(self.R) if s != r])
            cur[who] = self._settle(who, ci + 1)
        else:
            cur[who] = (ci, j)
        return True


def _combine_case(R, n, depth, W, per_chunk, p_need, seed, rule):
    rng = random.Random(seed)
    items = [[list(range(w, per_chunk, W)) for w in range(W)] for _ in range(n)]
    need = [[[{s for s in range(R) if s != r and rng.random() < p_need}
              for _ in range(per_chunk)] for _ in range(n)] for r in range(R)]
    return Combine(R, n, depth, W, items, need, rule, seed)


@pytest.mark.slow
@pytest.mark.parametrize("R,n,depth,W", [(2, 9, 2, 3), (4, 7, 1, 2), (8, 6, 2, 4), (8, 5, 1, 8)])
def test_dispatch_rings_no_deadlock_no_overwrite(R, n, depth, W):
    for seed in range(40):
        sim = Dispatch(R, n, depth, W, None, None, True, seed)
        assert sim.run(), f"deadlock (seed {seed})"
        assert not sim.violations, sim.violations[:3]


@pytest.mark.parametrize("R,n,depth,W,per_chunk", [(2, 9, 2, 3, 3), (8, 6, 2, 4, 6),
                                                   (8, 7, 1, 8, 8), (4, 8, 3, 4, 3)])
@pytest.mark.slow
def test_combine_rings_no_deadlock_no_overwrite(R, n, depth, W, per_chunk):
    for seed in range(40):
        sim = _combine_case(R, n, depth, W, per_chunk, 0.3, seed, rule=True)
        assert sim.run(), f"deadlock (seed {seed})"
        assert not sim.violations, sim.violations[:3]


def test_combine_old_rule_races():
    """Waiting only for the peers a token needs lets a fast warp count its drain
    of chunk ci + depth before a slow warp drained ci: a slot is rewritten while
    still being read (a race a review found)."""
    bad = 0
    for seed in range(200):
        sim = _combine_case(2, 8, 1, 4, 4, 0.2, seed, rule=False)
        sim.run()
        bad += bool(sim.violations)
    assert bad > 0


class _PeerMajor(Dispatch):
    """Receivers that walk peer-major (every chunk of one peer, then the next),
    the pre-ring dispatch order."""

    def _finished(self, c):
        return c[1] >= self.R

    def _advance(self, ci, pi):
        return (0, pi + 1) if ci + 1 == self.n else (ci + 1, pi)


def test_peer_major_receivers_deadlock_on_a_bounded_ring():
    """Why the receivers drain chunk-major: walking one peer's chunks at a time,
    a sender that waits for a credit from a receiver busy with another peer
    closes a cycle once the ring is shorter than a block's chunks (R >= 3)."""
    assert not any(_PeerMajor(3, 8, 2, 2, None, None, True, s).run() for s in range(20))
    assert all(_PeerMajor(3, 8, 8, 2, None, None, True, s).run() for s in range(20))  # no wrap
