"""The internode kernels' region: laid out for a window of W tokens.

Per call parity, dispatch rows ``(N + R + 1) * W`` and combine rows
``(G + 2) * N * W`` (G = R / N; each with its put staging), f32 wide (any row
dtype fits), plus flags; computed by the extension
(``cc/internode/region_layout.h``). W is the largest ``max_tokens_per_rank``
of the configs, or fewer where the region would exceed ``internode_bytes``;
calls of more tokens run as windows of W tokens (docs/internode.md, "Windows").
"""
from __future__ import annotations

from .. import extension, hosts as _hosts
from ..config import EpConfig
from ..region import Region

DEFAULT_BYTES = 1 << 30   # bound on the region when no config sets internode_bytes
NONE = (0, 0, 0, 0)       # (nodes, ranks, W, H) of no region


def window_for(region_bytes, nodes: int, ranks: int, tokens: int, hidden: int,
               bound=None) -> int:
    """The largest W <= ``tokens`` whose region ``region_bytes(nodes, ranks, W,
    hidden)`` (the extension's ``internode_region_bytes``) fits ``bound``
    (None: :data:`DEFAULT_BYTES`); a clear error when not even one token does."""
    bound = DEFAULT_BYTES if bound is None else int(bound)
    if region_bytes(nodes, ranks, tokens, hidden) <= bound:
        return tokens
    if region_bytes(nodes, ranks, 1, hidden) > bound:
        raise ValueError(
            f"EpConfig.internode_bytes ({bound}) is below the internode region of one token "
            f"per window ({region_bytes(nodes, ranks, 1, hidden)} bytes at {nodes} nodes, "
            f"{ranks} ranks, hidden {hidden})")
    lo, hi = 1, tokens          # region(lo) fits, region(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if region_bytes(nodes, ranks, mid, hidden) <= bound else (lo, mid)
    return lo


def window(config: EpConfig, num_ranks: int) -> int:
    """W for one config with ``num_nodes > 1``: the tokens per rank one
    internode kernel moves. Needs ``jax_ep._C``."""
    C = extension.require("jax_ep.internode.region.window")
    return window_for(C.internode_region_bytes, config.num_nodes, num_ranks,
                      config.max_tokens_per_rank, config.hidden, config.internode_bytes)


def region_bytes(config: EpConfig, num_ranks: int) -> int:
    """Bytes of the region ``initialize(config=config)`` adds to each buffer (0
    when ``num_nodes == 1``; on a job that spans hosts ``initialize`` lays it
    out for one node per host instead: :func:`shape_of`), at most
    ``internode_bytes``. Not covered by ``buffer_bytes``. Needs ``jax_ep._C``."""
    if config.num_nodes == 1:
        return 0
    C = extension.require("jax_ep.internode.region.region_bytes")
    return int(C.internode_region_bytes(config.num_nodes, num_ranks,
                                        window(config, num_ranks), config.hidden))


def configs_needing(configs, ranks: int, hosts) -> tuple:
    """``(N, the configs that need the region)``: those with ``num_nodes > 1``
    (which must agree on N), or where none has, every config with one node
    per host when ``ranks`` cannot fit on one host (``hosts.auto_nodes``);
    ``(0, [])`` when none needs it."""
    explicit = [c for c in configs if c.num_nodes > 1]
    if explicit:
        nodes = {c.num_nodes for c in explicit}
        if len(nodes) > 1:
            raise ValueError(f"jax_ep.initialize: configs with different num_nodes "
                             f"{sorted(nodes)}; the internode region is sized for one")
        return nodes.pop(), explicit
    auto = _hosts.auto_nodes(hosts, ranks)
    return (auto, list(configs)) if auto > 1 and configs else (0, [])


def shape_of(configs, ranks: int, region_bytes=None, hosts=None) -> tuple:
    """(nodes, ranks, W, H) of the region for the configs given to
    ``initialize``, or :data:`NONE`. ``ranks``: the EP size initialize assumes
    (every process, or every GPU with peer memory). Nodes: the configs'
    ``num_nodes`` (> 1, which must agree), or where none gives one, one node
    per host when ``ranks`` cannot fit on one host (``hosts``: host of each
    PE). H: the largest ``hidden``. W: the largest ``max_tokens_per_rank``, or
    fewer where the region would exceed the smallest ``internode_bytes``
    (:func:`window_for` with ``region_bytes``, the extension's
    ``internode_region_bytes``; None: no bound applied)."""
    N, inter = configs_needing(configs, ranks, hosts)
    if not inter:
        return NONE
    if ranks % N != 0:
        raise ValueError(f"jax_ep.initialize: EpConfig.num_nodes ({N}) must divide the "
                         f"{ranks} EP ranks of this job")
    T, H = max(c.max_tokens_per_rank for c in inter), max(c.hidden for c in inter)
    if region_bytes is not None:
        bounds = [c.internode_bytes for c in inter if c.internode_bytes is not None]
        T = window_for(region_bytes, N, ranks, T, H, min(bounds) if bounds else None)
    return (N, ranks, T, H)


def plan(C, configs, ranks: int, hosts=None) -> Region:
    """The region for ``initialize`` (extension ``C``)."""
    shape = shape_of(configs, ranks, C.internode_region_bytes, hosts)
    return Region("internode", shape, int(C.internode_region_bytes(*shape)))


def check_live(live_shape: tuple, configs, hosts) -> None:
    """A later ``initialize(config=...)`` on a live runtime: the configs that
    need the region (``num_nodes > 1``, or one node per host where the job
    spans hosts) must fit the one laid out at start (else their calls would
    fail with "pass this config to jax_ep.initialize" although the user did).
    Any T fits (calls run as windows of the region's T); nodes and hidden must."""
    wanted, inter = configs_needing(configs, len(hosts or []), hosts)
    if not inter:
        return
    n, _, _, h = live_shape
    bad = [c for c in inter if wanted != n or c.hidden > h]
    if bad:
        c = bad[0]
        raise ValueError(
            f"jax_ep.initialize(config=...): the runtime is already up with an internode region "
            f"for (nodes, ranks, T window, H) = {tuple(live_shape)} (zeros: none); this config "
            f"needs {wanted} nodes (num_nodes={c.num_nodes}"
            + (", one node per host" if c.num_nodes == 1 else "")
            + f") and hidden {c.hidden}. Call jax_ep.finalize() first")
