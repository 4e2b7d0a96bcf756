"""Train a small MoE transformer LM on a synthetic copy task with jax_ep.

Each sequence is ``a_1..a_n SEP a_1..a_n`` with random tokens ``a_i``; the loss
is the next-token cross-entropy on the copied half (chance level: ln(V-2)).
The model: token + position embeddings, ``--layers`` blocks of
[RMSNorm -> causal multi-head attention] and [RMSNorm -> DeepSeek-V3-style MoE
FFN (examples/moe_layer.py: sigmoid router, group-limited top-k, aux-loss-free
bias, shared expert, routed SwiGLU experts through jax_ep dispatch ->
grouped matmul (``jax_ep.grouped_matmul``; ``--experts-impl``) -> combine)],
then RMSNorm and the unembedding. Adam (optax).

Sharding: a ``('data', 'ep')`` mesh; the batch is split over both axes, the
routed experts over ``'ep'`` (each EP rank holds E/ep experts), everything else
is replicated and left to ``jit``.

CPU (default; 8 fake CPU devices, reference backend, mesh data=2 x ep=4)::

    python examples/train_moe.py

GPUs (one process per GPU, NVSHMEM native backend)::

    python -m jax_ep.launch -n 2 examples/train_moe.py --backend native

GPUs, one process driving all of them (peer-memory transport; written, not
yet run on GPUs)::

    python examples/train_moe.py --backend native --symmetric-memory peer_memory

``--fp8``: the routed experts as DeepSeek-V3 runs them: fp8 dispatch (e4m3
rows, per-128 scales), fp8 grouped matmuls (expert weights quantized to
128 x 128 blocks inside the step; on CPU the dequantizing reference) and a
bf16 combine; gradients pass the fp8 casts straight through. It needs
``--d-model`` and ``--d-ff`` divisible by 128 (their default becomes 128).
Its loss curve stays within 3% (relative, at each of the first 12 steps;
1.8% measured, where bf16 and f32 runs differ by up to 0.9%) of the same run
without ``--fp8``, both at ``--dtype bfloat16`` with ``--d-model 128 --d-ff
128 --batch 16`` on CPU (tests/test_examples.py checks it; 1.6% with
``--fp8-dw``, the weight gradients in fp8 too). ``--fp8-kernel`` picks the fp8
kernels' family on a Hopper GPU (default: the device's tuned choice, CUDA on an
H200 and an H100). Later the copy
task's sharp drop in loss can come a few steps after bf16's (30 steps, seed 0:
the last loss 0.40 against 0.19)::

    python examples/train_moe.py --fp8

The output reports the loss every ``--log-every`` steps, tokens/s, and the
share of a training step spent in dispatch + combine, measured by timing a
jitted forward+backward of dispatch -> combine alone (same shapes, random
routing, same mesh) and comparing ``layers x`` that with the median step time.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=("reference", "native", "auto"), default="reference",
                   help="jax_ep backend (default reference; native needs GPUs + the launcher)")
    p.add_argument("--symmetric-memory", choices=("auto", "nvshmem", "peer_memory"),
                   default="auto",
                   help="jax_ep.initialize(symmetric_memory=): nvshmem, one GPU per process "
                        "(the launcher), or peer_memory (one process drives every GPU; not yet "
                        "run on GPUs)")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                   help="auto: gpu with --backend native or under the launcher on GPUs, else "
                        "cpu with 8 fake devices")
    p.add_argument("--data", type=int, default=None, help="data axis size (cpu default 2)")
    p.add_argument("--ep", type=int, default=None, help="ep axis size (cpu default 4)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--copy-len", type=int, default=12, help="n: tokens to copy")
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--d-model", type=int, default=None, help="default 64 (128 with --fp8)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--n-groups", type=int, default=4)
    p.add_argument("--topk-groups", type=int, default=2)
    p.add_argument("--d-ff", type=int, default=None, help="default 64 (128 with --fp8)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--bias-rate", type=float, default=1e-2,
                   help="aux-loss-free bias update rate (DeepSeek-V3 uses 1e-3 over long runs)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--experts-impl", choices=("grouped", "padded", "ragged_dot"),
                   default="grouped",
                   help="routed-expert matmuls (examples/moe_layer.py expert_impl): grouped = "
                        "jax_ep.grouped_matmul (default), padded = batched einsums over "
                        "R*T rows per expert, ragged_dot = jax.lax.ragged_dot")
    p.add_argument("--fp8", action="store_true",
                   help="fp8 dispatch -> fp8 grouped matmul experts -> bf16 combine "
                        "(expert_impl grouped_fp8; d-model and d-ff divisible by 128)")
    p.add_argument("--fp8-dw", action="store_true",
                   help="with --fp8: the weight gradients in fp8 too (GroupedMatmulConfig.fp8_dw)")
    p.add_argument("--fp8-kernel", choices=("pallas", "cuda"), default=None,
                   help="with --fp8: the fp8 matmul kernels on a Hopper GPU "
                        "(GroupedMatmulConfig.fp8_kernel; cuda: the native extension's; "
                        "default: the device's tuned choice)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-comm-timing", action="store_true",
                   help="skip the dispatch+combine share measurement")
    args = p.parse_args(argv)
    return _fp8_args(p, args)


def _fp8_args(p, args):
    """--fp8: the grouped experts in fp8, widths defaulting to 128 (the scale block)."""
    width = 128 if args.fp8 else 64
    args.d_model = width if args.d_model is None else args.d_model
    args.d_ff = width if args.d_ff is None else args.d_ff
    if args.fp8:
        if args.experts_impl != "grouped":
            p.error("--fp8 runs the grouped experts (--experts-impl grouped)")
        if args.d_model % 128 or args.d_ff % 128:
            p.error(f"--fp8 needs --d-model and --d-ff divisible by 128 (the fp8 scale "
                    f"blocks), got {args.d_model} and {args.d_ff}")
        args.experts_impl = "grouped_fp8"
    elif args.fp8_dw or args.fp8_kernel is not None:
        p.error("--fp8-dw and --fp8-kernel choose how --fp8 runs: add --fp8")
    return args


def gmm_config(args):
    """The experts' GroupedMatmulConfig (None: the defaults)."""
    if not args.fp8:
        return None
    from jax_ep.gmm import GroupedMatmulConfig
    return GroupedMatmulConfig(fp8_dw=args.fp8_dw, fp8_kernel=args.fp8_kernel)


def _want_gpu(args) -> bool:
    if args.platform != "auto":
        return args.platform == "gpu"
    return args.backend == "native" or os.environ.get("JAX_EP_PLATFORM") == "gpu"


def configure_platform(args) -> None:
    """Before jax is imported: 8 fake CPU devices unless GPUs are wanted."""
    if _want_gpu(args) or "JAX_EP_NUM_PROCESSES" in os.environ:
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()


if __name__ == "__main__":
    _ARGS = parse_args()
    configure_platform(_ARGS)

try:
    import jax_ep  # noqa: E402
except ImportError:  # running from a source checkout without `pip install`
    sys.path.insert(0, os.path.dirname(HERE))
    import jax_ep  # noqa: E402
sys.path.insert(0, HERE)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import moe_layer as ml  # noqa: E402

F32 = jnp.float32
SEP = 1


# ----------------------------------------------------------------------------- data


def copy_batch(rng: np.random.Generator, batch: int, n: int, vocab: int):
    """-> (inputs [B, 2n], targets [B, 2n], loss mask [B, 2n]) for ``a SEP a``."""
    a = rng.integers(2, vocab, size=(batch, n), dtype=np.int32)
    seq = np.concatenate([a, np.full((batch, 1), SEP, np.int32), a], axis=1)  # [B, 2n+1]
    inp, tgt = seq[:, :-1], seq[:, 1:]
    mask = np.zeros_like(inp, dtype=np.float32)
    mask[:, n:] = 1.0  # positions n..2n-1 predict the copied tokens
    return inp, tgt, mask


# ----------------------------------------------------------------------------- model


def init_model(key, args, moe_cfg):
    D, V, S = args.d_model, args.vocab, 2 * args.copy_len
    keys = jax.random.split(key, 3 + args.layers)
    params = {
        "embed": jax.random.normal(keys[0], (V, D), F32) * 0.02,
        "pos": jax.random.normal(keys[1], (S, D), F32) * 0.02,
        "unembed": jax.random.normal(keys[2], (D, V), F32) / math.sqrt(D),
        "final_norm": jnp.ones((D,), F32),
        "layers": [],
    }
    for i in range(args.layers):
        ka, km = jax.random.split(keys[3 + i])
        kq, kk, kv, ko = jax.random.split(ka, 4)
        params["layers"].append({
            "attn_norm": jnp.ones((D,), F32),
            "wq": jax.random.normal(kq, (D, D), F32) / math.sqrt(D),
            "wk": jax.random.normal(kk, (D, D), F32) / math.sqrt(D),
            "wv": jax.random.normal(kv, (D, D), F32) / math.sqrt(D),
            "wo": jax.random.normal(ko, (D, D), F32) / math.sqrt(D) / math.sqrt(2 * args.layers),
            "moe_norm": jnp.ones((D,), F32),
            "moe": ml.init_moe_params(km, moe_cfg),
        })
    return params


def rms_norm(x, g):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g


def attention(p, x, heads):
    B, S, D = x.shape
    hd = D // heads
    q = (x @ p["wq"]).reshape(B, S, heads, hd)
    k = (x @ p["wk"]).reshape(B, S, heads, hd)
    v = (x @ p["wv"]).reshape(B, S, heads, hd)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = jnp.tril(jnp.ones((S, S), bool))
    logits = jnp.where(causal[None, None], logits, -1e30)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return o.reshape(B, S, D) @ p["wo"]


def forward(params, biases, tokens, args, moe_cfg, mesh, backend):
    """-> (logits [B, S, V], per-layer aux list)."""
    S = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][None, :S]
    auxes = []
    for p, bias in zip(params["layers"], biases):
        x = x + attention(p, rms_norm(x, p["attn_norm"]), args.heads)
        h, aux = ml.moe_block(p["moe"], bias, rms_norm(x, p["moe_norm"]), moe_cfg, mesh,
                              backend=backend, expert_impl=args.experts_impl,
                              gmm_config=gmm_config(args))
        x = x + h.astype(x.dtype)
        auxes.append(aux)
    return rms_norm(x, params["final_norm"]) @ params["unembed"], auxes


def loss_fn(params, biases, batch, args, moe_cfg, mesh, backend):
    inp, tgt, mask = batch
    logits, auxes = forward(params, biases, inp, args, moe_cfg, mesh, backend)
    logp = jax.nn.log_softmax(logits.astype(F32), axis=-1)
    nll = -jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * mask) / jnp.sum(mask), auxes


def _tree_norm(tree):
    norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm
    return norm(tree)


# ----------------------------------------------------------------------------- progress


class _SimpleBar:
    """Fallback progress bar when tqdm is not installed."""

    def __init__(self, total):
        self.total, self.n, self.post = total, 0, ""
        self.tty = sys.stdout.isatty()
        self.t0 = time.perf_counter()

    def update(self, k=1):
        self.n += k
        if self.tty:
            self._draw("\r")

    def set_postfix_str(self, s):
        self.post = s

    def write(self, s):
        if self.tty:
            sys.stdout.write("\r\033[K")
        print(s, flush=True)
        if self.tty:
            self._draw("")

    def _draw(self, lead):
        w = 30
        fill = int(w * self.n / max(self.total, 1))
        el = time.perf_counter() - self.t0
        sys.stdout.write(f"{lead}[{'#' * fill}{'.' * (w - fill)}] {self.n}/{self.total} "
                         f"{el:.0f}s {self.post}")
        sys.stdout.flush()

    def close(self):
        if self.tty:
            sys.stdout.write("\n")
            sys.stdout.flush()


def progress(total, enabled):
    if not enabled:
        class _Null:
            def update(self, k=1): pass
            def set_postfix_str(self, s): pass
            def write(self, s): pass
            def close(self): pass
        return _Null()
    try:
        from tqdm import tqdm
        return tqdm(total=total, dynamic_ncols=True, file=sys.stdout)
    except ImportError:
        return _SimpleBar(total)


# ----------------------------------------------------------------------------- timing


def time_dispatch_combine(mesh, ep_cfg, tokens_total, moe_cfg, dtype, reps=20, seed=0):
    """Median seconds of one jitted fwd+bwd of dispatch -> combine alone (identity
    experts) on the layer's shapes: ``x [N, H]`` over all devices, random top-k."""
    tok = P(tuple(mesh.axis_names))
    E, K, H = moe_cfg.num_experts, moe_cfg.topk, moe_cfg.d_model
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.random((tokens_total, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((tokens_total, K)).astype(np.float32)
    x = rng.standard_normal((tokens_total, H)).astype(np.float32)

    def per_rank(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, ep_cfg)
        # fp8 dispatch (--fp8): the rows come back through a bf16 combine
        y = d.x if d.x_scales is None else d.x.astype(jnp.bfloat16)
        return jax_ep.combine(y, d, ep_cfg)

    comm = jax.shard_map(per_rank, mesh=mesh, in_specs=(tok, tok, tok), out_specs=tok,
                         check_vma=True)

    @jax.jit
    def fwd_bwd(x, w, idx):
        loss, grads = jax.value_and_grad(
            lambda x, w: jnp.sum(comm(x, idx, w).astype(F32) ** 2), argnums=(0, 1))(x, w)
        return loss, grads

    sh = NamedSharding(mesh, tok)
    put = lambda a: global_array(a, sh)
    xs, ws, ids = put(x.astype(dtype)), put(w), put(idx)
    jax.block_until_ready(fwd_bwd(xs, ws, ids))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fwd_bwd(xs, ws, ids))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def global_array(a: np.ndarray, sharding):
    """A global jax.Array from host data every process holds in full (multi-process safe)."""
    return jax.make_array_from_callback(a.shape, sharding, lambda i: a[i])


# ----------------------------------------------------------------------------- main


def train(args, verbose=True):
    """Run the training loop; returns a dict of results (losses, timings)."""
    backend = args.backend
    info = None
    want_native = backend == "native" or (backend == "auto" and _want_gpu(args))
    if "JAX_EP_NUM_PROCESSES" in os.environ or want_native:
        from jax_ep.launch import init_distributed
        info = init_distributed()   # jax.distributed; the native runtime once the config is known
    is_main = jax.process_index() == 0
    say = print if (verbose and is_main) else (lambda *a, **k: None)

    n_dev = jax.device_count()
    data = args.data
    ep = args.ep
    if ep is None:
        ep = min(4, n_dev) if data is None else n_dev // data
        if jax.default_backend() != "cpu" and data is None:
            ep = n_dev
    if data is None:
        data = n_dev // ep
    if data * ep != n_dev:
        raise SystemExit(f"--data {data} x --ep {ep} != {n_dev} devices")
    mesh = ml.make_mesh((data, ep), ("data", "ep"))
    dtype = jnp.dtype(args.dtype)
    moe_cfg = ml.MoEConfig(d_model=args.d_model, d_ff=args.d_ff, num_experts=args.experts,
                           topk=args.topk, n_groups=args.n_groups, topk_groups=args.topk_groups,
                           score_func="sigmoid", route_scale=1.0, n_shared=1, dtype=dtype)
    S = 2 * args.copy_len
    tokens_total = args.batch * S
    if tokens_total % n_dev:
        raise SystemExit(f"batch*seq = {tokens_total} tokens must divide over {n_dev} devices")
    if want_native:
        # The buffer (and, where the EP group spans hosts, the internode region)
        # sized for this layer's config. "auto" on GPUs: the native runtime when
        # it starts, else the reference backend.
        kw = ({} if args.symmetric_memory == "auto"
              else {"symmetric_memory": args.symmetric_memory})
        info = init_distributed(native=True, config=ml.make_ep_config(
            moe_cfg, tokens_total // n_dev, "ep", backend, args.experts_impl), **kw)
        if backend == "native" and not info.native:
            from jax_ep import runtime
            raise SystemExit(f"--backend native: the jax_ep native runtime did not start "
                             f"({runtime.unavailable_reason()}); run one process per GPU "
                             "with `python -m jax_ep.launch -n <gpus> ...`, or one process "
                             "with --symmetric-memory peer_memory, or use --backend reference")
    say(f"devices: {n_dev} x {jax.devices()[0].platform} "
        f"({jax.process_count()} process(es)); mesh data={data} x ep={ep}; "
        f"jax_ep backend={backend}, experts {args.experts_impl}; "
        f"E={args.experts} experts ({args.experts // ep} per EP rank), "
        f"top-{args.topk}, {args.layers} layers, d_model={args.d_model}; "
        f"{tokens_total} tokens/step ({tokens_total // n_dev} per device)")

    # ---- params / optimizer, placed on the mesh
    params0 = init_model(jax.random.key(args.seed), args, moe_cfg)
    pspecs = {k: (P() if k != "layers" else None) for k in params0}
    pspecs["layers"] = [{k: (ml.param_specs(v) if k == "moe" else P()) for k, v in lp.items()}
                        for lp in params0["layers"]]
    pshard = jax.tree.map(lambda s: NamedSharding(mesh, s), pspecs,
                          is_leaf=lambda s: isinstance(s, P))
    params = jax.jit(lambda: init_model(jax.random.key(args.seed), args, moe_cfg),
                     out_shardings=pshard)()
    biases = [ml.init_routing_bias(moe_cfg) for _ in range(args.layers)]
    biases = jax.device_put(biases, NamedSharding(mesh, P()))
    opt = optax.adam(args.lr)
    opt_state = jax.jit(opt.init)(params)

    batch_sh = NamedSharding(mesh, P(("data", "ep")))

    def step(params, opt_state, biases, batch):
        (loss, auxes), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, biases, batch, args, moe_cfg, mesh, backend)
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        biases = [ml.update_routing_bias(b, a["load"], args.bias_rate)
                  for b, a in zip(biases, auxes)]
        gnorm = _tree_norm(grads)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        dropped = sum(a["num_dropped"] for a in auxes)
        load = jnp.stack([a["load"] for a in auxes])
        metrics = {"loss": loss, "gnorm": gnorm, "finite": finite, "dropped": dropped,
                   "load": load}
        # replicated, so every process can read them (multi-process runs)
        metrics = jax.lax.with_sharding_constraint(metrics, NamedSharding(mesh, P()))
        return params, opt_state, biases, metrics

    step = jax.jit(step, donate_argnums=(0, 1, 2))
    rng = np.random.default_rng(args.seed + 1)

    def next_batch():
        inp, tgt, mask = copy_batch(rng, args.batch, args.copy_len, args.vocab)
        return tuple(global_array(a, batch_sh) for a in (inp, tgt, mask))

    t_start = time.perf_counter()
    batch = next_batch()
    t0 = time.perf_counter()
    params, opt_state, biases, m = step(params, opt_state, biases, batch)
    first_loss = float(m["loss"])
    compile_s = time.perf_counter() - t0
    say(f"step 0: loss {first_loss:.4f}; compile + first step {compile_s:.1f}s")

    losses = [first_loss]
    all_finite = bool(m["finite"])
    step_times = []
    bar = progress(args.steps - 1, verbose and is_main)
    win_tokens, win_t0 = 0, time.perf_counter()
    for i in range(1, args.steps):
        batch = next_batch()
        ts = time.perf_counter()
        params, opt_state, biases, m = step(params, opt_state, biases, batch)
        loss = float(m["loss"])  # syncs
        step_times.append(time.perf_counter() - ts)
        losses.append(loss)
        all_finite &= bool(m["finite"])
        win_tokens += tokens_total
        bar.update(1)
        if i % args.log_every == 0 or i == args.steps - 1:
            el = time.perf_counter() - win_t0
            tps = win_tokens / max(el, 1e-9)
            bar.set_postfix_str(f"loss {loss:.4f} {tps:,.0f} tok/s")
            load = np.asarray(m["load"])
            imb = float(load.max() / max(load.mean(), 1e-9))
            bar.write(f"step {i:5d}  loss {loss:.4f}  gnorm {float(m['gnorm']):.3f}  "
                      f"{tps:10,.0f} tokens/s  max/mean expert load {imb:.2f}  "
                      f"dropped {int(m['dropped'])}")
            win_tokens, win_t0 = 0, time.perf_counter()
    bar.close()
    wall = time.perf_counter() - t_start
    step_med = float(np.median(step_times)) if step_times else float("nan")
    res = {"first_loss": first_loss, "last_loss": losses[-1], "losses": losses,
           "finite": all_finite, "wall_s": wall, "step_s": step_med,
           "tokens_per_s": tokens_total / step_med if step_times else float("nan"),
           "params": params, "biases": biases}

    if not args.no_comm_timing:
        ep_cfg = ml.make_ep_config(moe_cfg, tokens_total // n_dev, "ep", backend,
                                   args.experts_impl)
        t_comm = time_dispatch_combine(mesh, ep_cfg, tokens_total, moe_cfg, dtype,
                                       seed=args.seed)
        share = args.layers * t_comm / step_med
        res.update(comm_s=t_comm, comm_share=share)
        # fwd+bwd of dispatch -> combine alone (identity experts, random routing), same
        # shapes and mesh, median of 20 runs, times the layers, over the median step
        say(f"dispatch+combine: {args.layers} layers x {t_comm * 1e3:.2f} ms = "
            f"{100 * share:.1f}% of the median step ({step_med * 1e3:.2f} ms)")
    tail = losses[-10:]
    say(f"loss: start {first_loss:.4f} -> end {losses[-1]:.4f} (mean of last {len(tail)}: "
        f"{np.mean(tail):.4f}; guessing among the {args.vocab - 2} copyable tokens: "
        f"ln({args.vocab - 2}) = {math.log(args.vocab - 2):.2f}); {args.steps} steps in {wall:.1f}s, median step "
        f"{step_med * 1e3:.2f} ms, {res['tokens_per_s']:,.0f} tokens/s; grads finite: "
        f"{all_finite}")
    if info is not None and info.native:
        jax_ep.finalize()
    return res


def main(argv=None):
    args = _ARGS if (argv is None and "_ARGS" in globals()) else parse_args(argv)
    res = train(args)
    return 0 if res["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
