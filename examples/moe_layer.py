"""A DeepSeek-V3-style MoE FFN block on jax_ep, in plain JAX.

Pieces (all functional; parameters are plain dict pytrees):

* router: ``scores = sigmoid(x @ W)`` (or softmax), group-limited top-k
  (experts split into ``n_groups`` groups, only the best ``topk_groups`` groups
  are eligible per token), an aux-loss-free per-expert ``bias`` that is added to
  the scores for the *selection only* (the weights use the raw scores), weights
  normalised over the top-k (sigmoid) and multiplied by ``route_scale``.
* routed experts: SwiGLU ``down(silu(g) * u)`` with ``[g, u] = x @ gate_up``
  (gate and up projections stored as one fused ``[E, H, 2F]`` weight, so the
  forward reads x once and the backward runs one dx matmul of contraction 2F),
  run as two grouped matmuls (``jax_ep.grouped_matmul``: a Pallas Mosaic-GPU
  kernel on Hopper, ``jax.lax.ragged_dot`` elsewhere) over the rows
  :func:`jax_ep.dispatch` grouped by local expert (``expert_major`` layout,
  the default capacity), then :func:`jax_ep.combine` (which applies the routing
  weights on the expert side and sums over ranks in f32). Rows of ``d.x``
  past ``sum(d.group_sizes)`` are never read (they may hold garbage) except by
  the grouped matmul and combine, which skip them.
  ``expert_impl="grouped_fp8"`` runs the same layer in fp8 as DeepSeek-V3
  does: fp8 dispatch (``EpConfig.fp8_dispatch``: e4m3 rows with per-128
  scales), both expert matmuls as fp8 grouped matmuls (the weights quantized
  to 128 x 128 blocks inside the step, ``jax_ep.quantize_weights_pair``; the SwiGLU
  output cast with ``jax_ep.quantize_swiglu``), the expert output in
  bf16 into combine. Gradients pass the casts straight through. Needs
  ``d_model`` and ``d_ff`` divisible by 128.
  ``expert_impl="padded"`` runs the experts as batched einsums over a fixed
  number of rows per local expert instead (rows past that capacity are dropped
  and counted); ``expert_impl="ragged_dot"`` calls ``jax.lax.ragged_dot``
  directly (XLA's own lowering: ~100x slower than a matmul on H200, and its
  backward can run out of memory at DeepSeek-V3 sizes).
* a shared expert (a plain SwiGLU every token goes through, fused ``gate_up``
  ``[H, 2S]`` likewise).
* :func:`update_routing_bias`: DeepSeek-V3's bias update
  ``bias += rate * sign(mean_load - load)``, using the per-expert load the layer
  returns.

Sharding. On a mesh with an EP axis (default ``'ep'``) and other axes (e.g.
``('data', 'ep')``), only the routed part runs inside ``jax.shard_map``: tokens
are split over *all* ``token_axes`` (every device gets ``N / num_devices``
tokens), the expert weights ``[E, ...]`` are sharded ``P('ep')`` (each rank
holds its ``L = E / R`` experts, replicated over the other axes). Router and
shared expert stay ordinary jitted code, so the block composes with pjit-style
sharded layers around it.

:func:`moe_block_dense` is the same layer without EP (every token through its
top-k experts with a dense einsum + gather): the oracle for tests.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jax_ep
from jax_ep.gmm import GROUP_ALIGNMENT, grouped_matmul  # Pallas Mosaic-GPU; ragged_dot off Hopper

F32 = jnp.float32
EXPERT_IMPLS = ("grouped", "grouped_fp8", "padded", "ragged_dot")
GROUPED = ("grouped", "grouped_fp8")   # jax_ep.grouped_matmul experts


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shapes and routing options of one MoE block.

    Attributes:
      d_model: model width H.
      d_ff: hidden width of each routed expert.
      num_experts: routed experts E (divisible by the EP axis size).
      topk: experts per token K.
      n_groups / topk_groups: group-limited routing (E divisible by n_groups;
        ``n_groups=1`` disables it).
      score_func: ``"sigmoid"`` (V3) or ``"softmax"`` (V2).
      norm_topk_prob: renormalise the K selected scores to sum to 1 (V3 does
        this for sigmoid scores).
      route_scale: routed scaling factor applied to the weights (V3: 2.5).
      n_shared: shared experts (merged into one SwiGLU of width
        ``n_shared * d_ff``; 0 = none).
      dtype: parameter / activation dtype of the experts (router math is f32).
    """

    d_model: int
    d_ff: int
    num_experts: int
    topk: int
    n_groups: int = 1
    topk_groups: int = 1
    score_func: str = "sigmoid"
    norm_topk_prob: bool = True
    route_scale: float = 1.0
    n_shared: int = 1
    dtype: jnp.dtype = jnp.float32

    def __post_init__(self):
        if self.num_experts % self.n_groups:
            raise ValueError("num_experts must be divisible by n_groups")
        if not 1 <= self.topk_groups <= self.n_groups:
            raise ValueError("need 1 <= topk_groups <= n_groups")
        if self.topk > self.topk_groups * (self.num_experts // self.n_groups):
            raise ValueError("topk exceeds the experts in the topk_groups groups")
        if self.score_func not in ("sigmoid", "softmax"):
            raise ValueError("score_func must be 'sigmoid' or 'softmax'")


# ----------------------------------------------------------------------------- params


def init_moe_params(key: jax.Array, cfg: MoEConfig) -> dict:
    """Parameters: ``{"router": {"kernel" [H, E]}, "experts": {"gate_up" [E, H, 2F],
    "down" [E, F, H]}, "shared": {"gate_up" [H, 2S], "down" [S, H]}}`` with
    ``S = n_shared * F``. ``gate_up[..., :F]`` is the gate projection and
    ``gate_up[..., F:]`` the up projection (both ``N(0, 1/H)``)."""
    H, F, E = cfg.d_model, cfg.d_ff, cfg.num_experts
    ks = jax.random.split(key, 5)

    def normal(k, shape, fan_in, dtype):
        return (jax.random.normal(k, shape, F32) / math.sqrt(fan_in)).astype(dtype)

    p = {
        "router": {"kernel": normal(ks[0], (H, E), H, F32)},
        "experts": {
            "gate_up": normal(ks[1], (E, H, 2 * F), H, cfg.dtype),
            "down": normal(ks[2], (E, F, H), F, cfg.dtype),
        },
    }
    if cfg.n_shared > 0:
        S = cfg.n_shared * F
        p["shared"] = {
            "gate_up": normal(ks[3], (H, 2 * S), H, cfg.dtype),
            "down": normal(ks[4], (S, H), S, cfg.dtype),
        }
    return p


def init_routing_bias(cfg: MoEConfig) -> jax.Array:
    """The aux-loss-free selection bias ``[E]`` (state, not a trained parameter)."""
    return jnp.zeros((cfg.num_experts,), F32)


def param_specs(params: dict, ep_axis: str = "ep") -> dict:
    """PartitionSpecs: routed experts ``P(ep_axis)`` on their expert dim, the rest replicated."""
    def spec(path, _):
        keys = [getattr(k, "key", None) for k in path]
        return P(ep_axis) if "experts" in keys else P()
    return jax.tree_util.tree_map_with_path(spec, params)


# ----------------------------------------------------------------------------- routing


def route(params: dict, bias: jax.Array, x: jax.Array, cfg: MoEConfig):
    """Router of DeepSeek-V3. ``x [N, H]`` -> (topk_idx ``[N, K]`` int32,
    topk_weights ``[N, K]`` f32, scores ``[N, E]`` f32)."""
    N = x.shape[0]
    E, K, G = cfg.num_experts, cfg.topk, cfg.n_groups
    logits = jnp.dot(x.astype(F32), params["router"]["kernel"].astype(F32))
    if cfg.score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    sel = jax.lax.stop_gradient(scores) + jax.lax.stop_gradient(bias)[None, :]
    if G > 1:
        grouped = sel.reshape(N, G, E // G)
        if E // G >= 2:  # V3: sum of the best two scores of each group
            group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        else:
            group_score = grouped[..., 0]
        _, top_groups = jax.lax.top_k(group_score, cfg.topk_groups)  # [N, topk_groups]
        keep = jnp.any(top_groups[:, :, None] == jnp.arange(G)[None, None, :], axis=1)
        sel = jnp.where(jnp.repeat(keep, E // G, axis=1), sel, -jnp.inf)
    _, idx = jax.lax.top_k(sel, K)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    w = w * cfg.route_scale
    return idx.astype(jnp.int32), w.astype(F32), scores


def expert_load(topk_idx: jax.Array, num_experts: int) -> jax.Array:
    """Tokens routed to each expert, ``[E]`` int32 (over the whole global batch under jit)."""
    valid = topk_idx >= 0
    return jnp.zeros((num_experts,), jnp.int32).at[jnp.where(valid, topk_idx, 0)].add(
        valid.astype(jnp.int32))


def update_routing_bias(bias: jax.Array, load: jax.Array, rate: float = 1e-3) -> jax.Array:
    """Aux-loss-free load balancing (DeepSeek-V3 §2.1.2): raise the bias of
    under-loaded experts, lower it for over-loaded ones, by ``rate`` per step."""
    load = load.astype(F32)
    return bias + rate * jnp.sign(jnp.mean(load) - load)


# ----------------------------------------------------------------------------- experts


def silu_mul(gu):
    """``[..., 2F]`` (gate | up, the output of the fused gate_up matmul) ->
    ``silu(gate) * up [..., F]``."""
    g, u = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(g) * u


def swiglu(x, gate_up, down):
    """Dense SwiGLU: ``x [N, H]``, ``gate_up [H, 2S]``, ``down [S, H]`` -> ``[N, H]``."""
    h = silu_mul(jnp.dot(x, gate_up))
    return jnp.dot(h.astype(down.dtype), down)


def mask_tail_rows(x, group_sizes):
    """``x [C, ...]`` with the rows past ``sum(group_sizes)`` set to zero (they
    may hold garbage: the dispatch kernels do not zero-fill the tail)."""
    valid = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(group_sizes).astype(jnp.int32)
    return jnp.where(valid.reshape((-1,) + (1,) * (x.ndim - 1)), x, jnp.zeros((), x.dtype))


def routed_experts_grouped(x, gate_up, down, group_sizes, gmm_config=None):
    """SwiGLU over rows grouped by local expert with ``jax_ep.grouped_matmul``
    (``out[rows of group g] = x[rows of group g] @ w[g]``): ``x [C, H]`` (rows
    past ``sum(group_sizes)`` ignored), ``gate_up [L, H, 2F]``, ``down [L, F, H]``
    -> ``[C, H]`` (zero past ``sum(group_sizes)``). One grouped matmul of width
    2F for gate and up together; ``gmm_config``: a ``GroupedMatmulConfig``
    (None: its defaults)."""
    h = silu_mul(grouped_matmul(x, gate_up, group_sizes, config=gmm_config))
    return grouped_matmul(h.astype(down.dtype), down, group_sizes, config=gmm_config)


def routed_experts_fp8(x, x_scales, gate_up, down, group_sizes, gmm_config=None,
                       quantized=None):
    """The SwiGLU experts in fp8: ``x [C, H]`` e4m3 with ``x_scales [C, H/128]``
    (fp8 dispatch's rows), ``gate_up [L, H, 2F]`` and ``down [L, F, H]`` (bf16 /
    f32, quantized here to 128 x 128 blocks in both layouts at once,
    ``jax_ep.quantize_weights_pair``: one pass over each weight on a GPU, and
    the fp8 kernel's K-major copy needs no transpose) -> bf16 ``[C, H]`` (zero past
    ``sum(group_sizes)``). The SwiGLU output is cast per row and 128 columns
    (dispatch's cast) for the down projection (``jax_ep.quantize_swiglu``).
    ``quantized``: this rank's :func:`quantize_experts` made earlier, used
    instead of quantizing here (both layouts: no transpose in the step
    either)."""
    def weights(name, w):
        if quantized is None:
            return jax_ep.quantize_weights_pair(w)
        q = quantized[name]
        return jax_ep.quantize_weights(w, quantized=q["gkn"]), q["gnk"]

    (gu_q, gu_s), gu_t = weights("gate_up", gate_up)
    (dn_q, dn_s), dn_t = weights("down", down)
    gu = grouped_matmul(x, gu_q, group_sizes, x_scales=x_scales, w_scales=gu_s,
                        w_transposed=gu_t, config=gmm_config)
    h_q, h_s = jax_ep.quantize_swiglu(gu)
    return grouped_matmul(h_q, dn_q, group_sizes, x_scales=h_s, w_scales=dn_s,
                          w_transposed=dn_t, config=gmm_config)


def quantize_experts(experts: dict) -> dict:
    """``{"gate_up": {"gkn": (q, s), "gnk": (q, s)}, "down": ...}``: the routed
    experts' weights (``params["experts"]``) quantized to fp8 with 128 x 128
    block scales in both layouts (the forward reads ``"gnk"``, dx ``"gkn"``),
    for ``moe_block(experts_fp8=...)``; under ``jit`` the results keep the
    weights' expert sharding."""
    return {k: {layout: jax_ep.quantize_weights(experts[k], layout=layout)
                for layout in ("gkn", "gnk")} for k in ("gate_up", "down")}


def routed_experts_local(x, gate_up, down, group_sizes):
    """The same SwiGLU through ``jax.lax.ragged_dot`` (XLA's own lowering); the
    tail rows are masked to zero first, so garbage there cannot leak in."""
    x = mask_tail_rows(x, group_sizes)
    h = silu_mul(jax.lax.ragged_dot(x, gate_up, group_sizes))
    return jax.lax.ragged_dot(h.astype(down.dtype), down, group_sizes)


def routed_experts(x, gate_up, down, group_sizes, expert_impl: str = "grouped",
                   expert_capacity: Optional[int] = None, gmm_config=None, x_scales=None,
                   quantized=None):
    """Routed SwiGLU experts on one rank's ``expert_major`` rows: ``x [C, H]``,
    ``gate_up [L, H, 2F]``, ``down [L, F, H]``, ``group_sizes [L]`` -> (y
    ``[C, H]``, rows dropped by a padded capacity, int32). ``gmm_config``: the
    ``GroupedMatmulConfig`` of ``"grouped"`` / ``"grouped_fp8"``; ``x_scales``:
    the scales of an fp8 ``x`` and ``quantized`` the weights quantized earlier
    (``"grouped_fp8"``: :func:`routed_experts_fp8`)."""
    if expert_impl == "grouped_fp8":
        return (routed_experts_fp8(x, x_scales, gate_up, down, group_sizes, gmm_config,
                                   quantized), jnp.int32(0))
    if expert_impl == "grouped":
        return (routed_experts_grouped(x, gate_up, down, group_sizes, gmm_config),
                jnp.int32(0))
    if expert_impl == "ragged_dot":
        return routed_experts_local(x, gate_up, down, group_sizes), jnp.int32(0)
    if expert_impl == "padded":
        return routed_experts_padded(x, gate_up, down, group_sizes,
                                     expert_capacity or x.shape[0])
    raise ValueError(f"expert_impl must be one of {EXPERT_IMPLS}, got {expert_impl!r}")


def routed_experts_padded(x, gate_up, down, group_sizes, expert_capacity: int):
    """The same SwiGLU with plain batched matmuls: each local expert's group is
    gathered into a fixed ``[L, expert_capacity, H]`` block (rows past the
    capacity are dropped, and counted), run through ``einsum``, and scattered
    back to ``[C, H]``. Use it where ``ragged_dot`` lowers poorly (XLA may
    expand ragged_dot into an ``[L, C, H]`` dense problem, notably for the
    weight gradient). -> (y ``[C, H]``, dropped rows int32)."""
    C, H = x.shape
    starts = jnp.cumsum(group_sizes) - group_sizes  # [L]
    j = jnp.arange(expert_capacity, dtype=group_sizes.dtype)
    valid = j[None, :] < group_sizes[:, None]  # [L, Ce]
    rows = starts[:, None] + j[None, :]
    xg = jnp.where(valid[..., None], x[jnp.where(valid, rows, 0)], jnp.zeros((), x.dtype))
    h = silu_mul(jnp.einsum("leh,lhf->lef", xg, gate_up))
    yg = jnp.einsum("lef,lfh->leh", h.astype(down.dtype), down)
    y = jnp.zeros((C, yg.shape[-1]), yg.dtype).at[jnp.where(valid, rows, C)].set(
        yg, mode="drop")
    dropped = jnp.sum(jnp.maximum(group_sizes - expert_capacity, 0)).astype(jnp.int32)
    return y, dropped


def make_ep_config(cfg: MoEConfig, tokens_per_rank: int, ep_axis: str = "ep",
                   backend: str = "auto", expert_impl: str = "grouped",
                   **overrides) -> jax_ep.EpConfig:
    """The :class:`jax_ep.EpConfig` of this block for ``tokens_per_rank`` tokens per device.

    With the grouped-matmul experts each expert group starts at a multiple of
    ``jax_ep.gmm.GROUP_ALIGNMENT`` (64) rows unless ``overrides`` says
    otherwise: the dw kernel then never zeroes foreign rows (12% faster V3
    layer step at EP 1); the padding rows are zeros and cost up to
    63 rows per local expert of capacity. ``"grouped_fp8"`` also sets
    ``fp8_dispatch``."""
    if expert_impl in GROUPED:
        overrides = dict({"expert_alignment": GROUP_ALIGNMENT}, **overrides)
    if expert_impl == "grouped_fp8":
        overrides = dict({"fp8_dispatch": True}, **overrides)
    return jax_ep.EpConfig(num_experts=cfg.num_experts, topk=cfg.topk,
                           max_tokens_per_rank=tokens_per_rank, hidden=cfg.d_model,
                           axis_name=ep_axis, backend=backend, **overrides)


def routed_ep(experts: dict, x: jax.Array, topk_idx: jax.Array, topk_w: jax.Array,
              mesh: Mesh, ep_cfg: jax_ep.EpConfig, token_axes: Sequence[str],
              expert_impl: str = "grouped", expert_capacity: Optional[int] = None,
              gmm_config=None, experts_fp8=None):
    """The routed part: ``shard_map`` over ``token_axes`` with dispatch ->
    SwiGLU experts -> combine. Global ``x [N, H]`` -> (``[N, H]``, dropped
    pairs ``[num_devices]`` int32, one count per device). ``experts_fp8``:
    :func:`quantize_experts` of ``experts`` (``"grouped_fp8"``), sharded as they are."""
    tok = P(tuple(token_axes))
    ep = P(ep_cfg.axis_name)
    if expert_impl not in EXPERT_IMPLS:
        raise ValueError(f"expert_impl must be one of {EXPERT_IMPLS}, got {expert_impl!r}")
    if ep_cfg.layout != "expert_major":
        raise ValueError("the MoE block needs EpConfig.layout='expert_major'")
    if experts_fp8 is not None and expert_impl != "grouped_fp8":
        raise ValueError(f"experts_fp8 (weights quantized earlier) is for "
                         f"expert_impl='grouped_fp8', got expert_impl={expert_impl!r}; drop it "
                         "or run the fp8 experts")

    def per_rank(x, idx, w, gate_up, down, quantized):
        d = jax_ep.dispatch(x, idx, w, ep_cfg)
        cap = expert_capacity
        if expert_impl == "padded" and cap is None:
            # R*T: the most rows one expert can receive (dropless)
            R = jax.lax.axis_size(ep_cfg.axis_name)
            cap = min(d.x.shape[0], R * x.shape[0])
        y, over = routed_experts(d.x, gate_up, down, d.group_sizes, expert_impl, cap,
                                 gmm_config, d.x_scales, quantized)
        dropped = d.num_dropped + over
        # fp8 experts: their bf16 output goes into combine as is
        y = y if expert_impl == "grouped_fp8" else y.astype(x.dtype)
        out = jax_ep.combine(y, d, ep_cfg)
        return out, dropped.reshape(1)

    fp8_specs = jax.tree.map(lambda _: ep, experts_fp8)
    fn = jax.shard_map(per_rank, mesh=mesh,
                       in_specs=(tok, tok, tok, ep, ep, fp8_specs),
                       out_specs=(tok, tok), check_vma=True)
    args = (x, topk_idx, topk_w, experts["gate_up"], experts["down"], experts_fp8)
    explicit = _explicit_axes(mesh)
    if not explicit:  # Auto axes: shard_map moves the operands where they must be
        return fn(*args)
    # Explicit-sharding mesh: move the operands ourselves and put the result back
    # where x was, so the caller sees no change of sharding.
    x_spec = jax.typeof(x).sharding.spec
    args = jax.tree.map(lambda a, s: jax.sharding.reshard(a, NamedSharding(mesh, s)), args,
                        (tok, tok, tok, ep, ep, fp8_specs))
    out, dropped = fn(*args)
    return jax.sharding.reshard(out, NamedSharding(mesh, x_spec)), dropped


def _explicit_axes(mesh) -> bool:
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def make_mesh(shape: Sequence[int], names: Sequence[str], devices=None) -> Mesh:
    """``jax.make_mesh`` with Auto axes (jit places the non-EP parts of the model)."""
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    kw = {} if devices is None else {"devices": devices}
    return jax.make_mesh(tuple(shape), tuple(names), axis_types=auto, **kw)


# ----------------------------------------------------------------------------- the block


def moe_block(params: dict, bias: jax.Array, x: jax.Array, cfg: MoEConfig, mesh: Mesh,
              *, ep_axis: str = "ep", token_axes: Optional[Sequence[str]] = None,
              backend: str = "auto", ep_overrides: Optional[dict] = None,
              expert_impl: str = "grouped", expert_capacity: Optional[int] = None,
              gmm_config=None, experts_fp8=None):
    """The MoE FFN block through jax_ep. Call under ``jax.jit``.

    Args:
      params: from :func:`init_moe_params` (experts sharded ``P(ep_axis)``).
      bias: ``[E]`` routing bias (selection only, no gradient).
      x: ``[..., H]`` tokens; the leading dims are flattened to N, which must
        be divisible by the number of devices in ``token_axes``.
      mesh: a mesh holding ``ep_axis``.
      token_axes: mesh axes the tokens are split over inside the routed part
        (default: all axes of ``mesh``, EP axis included).
      backend: jax_ep backend ("auto" | "reference" | "native").
      ep_overrides: extra :class:`jax_ep.EpConfig` fields (capacity,
        expert_alignment, ...).
      expert_impl: ``"grouped"`` (default; ``jax_ep.grouped_matmul`` on the
        grouped rows), ``"grouped_fp8"`` (fp8 dispatch, fp8 grouped matmuls,
        bf16 combine; ``d_model``, ``d_ff`` divisible by 128), ``"padded"``
        (:func:`routed_experts_padded`, batched matmuls over
        ``expert_capacity`` rows per local expert; default capacity R*T =
        dropless) or ``"ragged_dot"`` (``jax.lax.ragged_dot``).
      expert_capacity: rows per local expert of ``"padded"``.
      gmm_config: ``jax_ep.gmm.GroupedMatmulConfig`` of ``"grouped"`` /
        ``"grouped_fp8"`` (None: the defaults).
      experts_fp8: ``"grouped_fp8"``: :func:`quantize_experts` of
        ``params["experts"]`` made earlier (once per optimizer step for its
        micro-batches, or for inference), used instead of quantizing the
        expert weights in every call; gradients still reach ``params``.

    Returns:
      ``(out [..., H], aux)`` with ``aux = {"load": [E] int32 tokens per expert,
      "num_dropped": int32 total (token, expert) pairs dropped}``.
    """
    token_axes = tuple(mesh.axis_names if token_axes is None else token_axes)
    lead, H = x.shape[:-1], x.shape[-1]
    xf = x.reshape(-1, H)
    N = xf.shape[0]
    n_dev = math.prod(mesh.shape[a] for a in token_axes)
    if N % n_dev:
        raise ValueError(f"{N} tokens do not split over {n_dev} devices of axes {token_axes}")
    idx, w, _ = route(params, bias, xf, cfg)
    ep_cfg = make_ep_config(cfg, N // n_dev, ep_axis, backend, expert_impl,
                            **(ep_overrides or {}))
    routed, dropped = routed_ep(params["experts"], xf.astype(cfg.dtype), idx, w, mesh, ep_cfg,
                                token_axes, expert_impl, expert_capacity, gmm_config,
                                experts_fp8)
    out = routed.astype(F32)
    if "shared" in params:
        s = params["shared"]
        out = out + swiglu(xf.astype(cfg.dtype), s["gate_up"], s["down"]).astype(F32)
    aux = {"load": expert_load(idx, cfg.num_experts), "num_dropped": jnp.sum(dropped)}
    return out.astype(x.dtype).reshape(*lead, H), aux


def moe_block_dense(params: dict, bias: jax.Array, x: jax.Array, cfg: MoEConfig):
    """The same block with no EP and no communication: every token through its
    top-k experts via a dense einsum over all experts plus a gather. For tests
    (cost O(N * E)); returns ``(out, aux)`` like :func:`moe_block`."""
    lead, H = x.shape[:-1], x.shape[-1]
    xf = x.reshape(-1, H)
    idx, w, _ = route(params, bias, xf, cfg)
    e = params["experts"]
    xe = xf.astype(cfg.dtype)
    h = silu_mul(jnp.einsum("nh,ehf->nef", xe, e["gate_up"]))
    y_all = jnp.einsum("nef,efh->neh", h.astype(e["down"].dtype), e["down"])  # [N, E, H]
    y_sel = jnp.take_along_axis(y_all, idx[:, :, None], axis=1)  # [N, K, H]
    out = jnp.einsum("nk,nkh->nh", w, y_sel.astype(F32))
    if "shared" in params:
        s = params["shared"]
        out = out + swiglu(xe, s["gate_up"], s["down"]).astype(F32)
    aux = {"load": expert_load(idx, cfg.num_experts), "num_dropped": jnp.int32(0)}
    return out.astype(x.dtype).reshape(*lead, H), aux


def shard_params(params: dict, mesh: Mesh, ep_axis: str = "ep") -> dict:
    """Place ``params`` on ``mesh``: experts ``P(ep_axis)``, the rest replicated."""
    specs = param_specs(params, ep_axis)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
