"""Fold RMSNorm weights into linears, then rotate the residual stream (R1) and heads (R2);
where post-norms join the stream (Gemma 3), R1 rotates online after the pre-norms instead.

Row-vector convention: activations are rows x, a linear is y = x Wᵀ with W stored [out, in].
With the residual stream rotated as x R1 (R1 orthogonal):
  - a linear reading the stream keeps its output if W ← W R1;
  - a linear writing the stream produces y R1 if W ← R1ᵀ W;
  - RMSNorm commutes with R1 once its weight is folded away (‖x R1‖ = ‖x‖).
R2 rotates each attention head's value vectors: v_h ← v_h R2 (rows of v_proj), and since
attention output is linear in V, o_proj's input slice of every head is rotated the same way,
undone by W_o[:, head] ← W_o[:, head] R2. One R2 per layer, shared by all heads (GQA too).
The tables come from the model's graph: Gemma 3's post-norms, whose weighted outputs join the
residual, keep their gains, and R1 cannot rotate its residual stream
(`ir.graph.residual_rotation_blocker`). There `add_rotation_linears` gives each pre-norm an
identity linear before its readers: R1 rotates that linear's output (it holds R1, an online
rotation on the NPU), its readers take R1ᵀ, and the pre-norms keep their gains
(`ir.graph.r1_targets`).

All functions are pure and differentiable, so stage 1 can learn R1/R2 through them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from qnpu_jax.errors import QnpuError
from qnpu_jax.ir.graph import (
    EMBED_TABLE,
    FINAL_NORM,
    LINEAR_BIAS,
    LM_HEAD,
    O_LINEAR,
    ROTATION_WEIGHTS,
    V_LINEAR,
    norm_readers,
    r1_targets,
    residual_rotation_blocker,
)
from qnpu_jax.models.config import ModelConfig
from qnpu_jax.models.llama import graph_of, lm_head_weight
from qnpu_jax.rotation import random_hadamard

Params = dict[str, Any]


def add_rotation_linears(params: Params, cfg: ModelConfig) -> Params:
    """`params` with an identity linear [L, D, D] after each pre-norm (Gemma 3's two;
    `ir.graph.with_rotation_linears`): the same function, now of the graph R1 can rotate
    online. Params that have them, or whose model needs none, come back unchanged."""
    new = [n for n in ROTATION_WEIGHTS.get(cfg.architecture, ()) if n not in params["layers"]]
    if not new:
        return params
    eye = jnp.eye(cfg.hidden_size, dtype=params[FINAL_NORM].dtype)
    identity = jnp.broadcast_to(eye, (cfg.num_layers, *eye.shape))
    return {**params, "layers": {**params["layers"], **dict.fromkeys(new, identity)}}


def fuse_norms(params: Params, cfg: ModelConfig) -> Params:
    """Fold the weight of every norm of the residual stream into the linears that read its
    output (`ir.graph.norm_readers`); those norms become ones. Gemma 3's post-norms keep
    their gains, and so do its pre-norms once `add_rotation_linears` put a rotation after
    them. The final norm folds into lm_head where R1 rotates the residual stream, so tied
    embeddings are untied (lm_head = E·diag(g)); elsewhere lm_head is only made explicit."""
    graph = graph_of(cfg, params)
    readers_of = norm_readers(graph)
    layers = dict(params["layers"])
    for gain, readers in readers_of.items():
        g = layers[gain][:, None, :]  # [L, 1, D]: scales the `in` axis
        for name in readers:
            layers[name] = layers[name] * g
    for gain in readers_of:
        layers[gain] = jnp.ones_like(layers[gain])
    head = lm_head_weight(params)
    out = dict(params)
    out["layers"] = layers
    if r1_targets(graph).tables:
        out[LM_HEAD] = head * params[FINAL_NORM][None, :]
        out[FINAL_NORM] = jnp.ones_like(params[FINAL_NORM])
    else:
        out[LM_HEAD] = head
    return out


def norms_are_fused(params: Params, cfg: ModelConfig) -> bool:
    """True when every norm weight `fuse_norms` folds is exactly one (eager check, not for
    use under jit)."""
    graph = graph_of(cfg, params)
    folded = norm_readers(graph)
    final = [params[FINAL_NORM]] if r1_targets(graph).tables else []
    leaves = [*final, *(params["layers"][gain] for gain in folded)]
    return all(bool(jnp.all(leaf == 1.0)) for leaf in leaves)


def _check_rotation(r: jax.Array, shape: tuple[int, ...], what: str) -> None:
    if tuple(r.shape) != shape:
        raise QnpuError(f"{what} must have shape {shape}, got {tuple(r.shape)}")


def apply_rotations(
    params: Params,
    cfg: ModelConfig,
    r1: jax.Array | None = None,
    r2: jax.Array | None = None,
    *,
    tables: bool = True,
) -> Params:
    """Rotate fused params: R1 [D, D] where `ir.graph.r1_targets` puts it (the residual
    stream, or online in Gemma 3's rotation linears), R2 [L, hd, hd] per layer.

    `params` must come from `fuse_norms` (checked when the params are concrete; under a trace,
    e.g. learning R1/R2 in stage 1, only shapes are). The result has an explicit lm_head.
    `tables=False` leaves embed_tokens and lm_head unrotated, for a forward that rotates the
    gathered rows and the final hidden state instead (`residual_rotation` of the forward);
    an online R1 never rotates them.
    """
    graph = graph_of(cfg, params)
    targets = r1_targets(graph)
    blocker = residual_rotation_blocker(graph)
    if r1 is not None and targets.tables and blocker is not None:
        raise QnpuError(
            f"R1 cannot rotate {cfg.architecture}'s residual stream: {blocker}, and a norm's "
            "weighted output does not commute with a rotation (R2 alone can: r1=None; or rotate "
            "online after the pre-norms: add_rotation_linears, then fuse_norms)"
        )
    if LM_HEAD not in params:
        raise QnpuError("apply_rotations needs fused params with an explicit lm_head: fuse_norms")
    if not isinstance(params[FINAL_NORM], jax.core.Tracer) and not norms_are_fused(params, cfg):
        raise QnpuError("apply_rotations needs fused params (norm weights of one): fuse_norms")
    layers = dict(params["layers"])
    out = dict(params)
    if r1 is not None:
        _check_rotation(r1, (cfg.hidden_size, cfg.hidden_size), "R1")
        for name in targets.readers:
            layers[name] = layers[name] @ r1
        for name in targets.writers:
            layers[name] = jnp.einsum("ji,ljk->lik", r1, layers[name])
        if tables and targets.tables:
            out[EMBED_TABLE] = params[EMBED_TABLE] @ r1
            out[LM_HEAD] = params[LM_HEAD] @ r1
    if r2 is not None:
        hd = cfg.head_dim
        _check_rotation(r2, (cfg.num_layers, hd, hd), "R2")
        n, d = cfg.num_layers, cfg.hidden_size
        v = layers[V_LINEAR].reshape(n, cfg.num_kv_heads, hd, d)
        layers[V_LINEAR] = jnp.einsum("lji,lhjd->lhid", r2, v).reshape(n, cfg.kv_size, d)
        v_bias = LINEAR_BIAS.get(V_LINEAR)
        if v_bias in layers:
            vb = layers[v_bias].reshape(n, cfg.num_kv_heads, hd)
            layers[v_bias] = jnp.einsum("lhj,lji->lhi", vb, r2).reshape(n, cfg.kv_size)
        o = layers[O_LINEAR].reshape(n, d, cfg.num_heads, hd)
        layers[O_LINEAR] = jnp.einsum("ldhj,lji->ldhi", o, r2).reshape(n, d, cfg.q_size)
    out["layers"] = layers
    return out


def randomized_hadamard_rotations(cfg: ModelConfig, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """QuaRot's fixed rotations: R1 [D, D] and R2 [L, hd, hd], randomized Hadamards from `key`."""
    r1_key, r2_key = jax.random.split(key)
    r2_keys = jax.random.split(r2_key, cfg.num_layers)
    r1 = random_hadamard(cfg.hidden_size, r1_key)
    return r1, jnp.stack([random_hadamard(cfg.head_dim, k) for k in r2_keys])
