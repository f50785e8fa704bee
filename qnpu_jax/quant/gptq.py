"""GPTQ rounding (Frantar et al. 2023) of per-channel static weights onto a fixed grid.

The scales and zero points stay what stage 1 learned or stage 2 calibrated; GPTQ only chooses
each weight's integer code, column by column, pushing every column's rounding error onto the
columns not yet rounded through the inverse Hessian of the layer input, H = Σ xᵀx over the
calibration tokens. The result is still a plain per-channel integer weight: the artifact,
the emulator and the integer forward do not change, only which codes they hold.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from qnpu_jax.errors import QnpuError


def _inverse_cholesky(h: jax.Array, damp: float) -> tuple[jax.Array, jax.Array]:
    """(upper Cholesky factor U of H⁻¹, dead-column mask) after dampening H by `damp` × its mean
    diagonal. Columns whose input is always zero get H_ii = 1, so H stays positive definite."""
    d = jnp.diag(h)
    dead = d <= 0
    h = h + jnp.diag(jnp.where(dead, 1.0, 0.0))
    h = h + damp * jnp.mean(jnp.diag(h)) * jnp.eye(h.shape[0], dtype=h.dtype)
    chol = jnp.linalg.cholesky(h)
    eye = jnp.eye(h.shape[0], dtype=h.dtype)
    h_inv = jax.scipy.linalg.cho_solve((chol, True), eye)
    return jnp.linalg.cholesky(h_inv).T, dead


@partial(jax.jit, static_argnames=("damp", "block", "act_order"))
def gptq_codes(
    w: jax.Array,
    h: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array,
    qmin: jax.Array,
    qmax: jax.Array,
    *,
    damp: float = 0.01,
    block: int = 128,
    act_order: bool = False,
) -> jax.Array:
    """Integer codes [out, in] (float32 holding integers) of w [out, in] on the grid
    (scale [out, 1], zero_point [out, 1], qmin, qmax), chosen by GPTQ with input Hessian h.

    Columns are rounded one at a time within blocks of `block` columns; a block's errors reach
    the later blocks in one matmul (GPTQ's lazy batch update: the same result, less memory
    traffic). With h ∝ I every column's error has nowhere to go: round-to-nearest's codes.
    `act_order` rounds the columns by decreasing H_ii (GPTQ's act-order: the inputs with the
    most energy first, while the most columns are left to take their error); the grid is per
    row, so the order changes only which codes are chosen, not the artifact.
    """
    if act_order:
        order = jnp.argsort(-jnp.diag(h), stable=True)
        codes = gptq_codes(
            w[:, order], h[order][:, order], scale, zero_point, qmin, qmax, damp=damp, block=block
        )
        return codes[:, jnp.argsort(order)]
    u, dead = _inverse_cholesky(h.astype(jnp.float32), damp)
    w = jnp.where(dead[None, :], 0.0, w.astype(jnp.float32))
    scale = jnp.broadcast_to(scale, (w.shape[0], 1))[:, 0]
    zero_point = jnp.broadcast_to(zero_point, (w.shape[0], 1))[:, 0]
    n = w.shape[1]
    codes = []
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        u_blk = u[b0:b1, b0:b1]

        def column(
            i: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array], u_blk: jax.Array = u_blk
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            wb, qb, eb = carry
            col = jax.lax.dynamic_index_in_dim(wb, i, axis=1, keepdims=False)
            q = jnp.clip(jnp.round(col / scale) + zero_point, qmin, qmax)
            err = (col - (q - zero_point) * scale) / u_blk[i, i]
            # u is upper triangular: columns < i stay, column i becomes its grid value
            wb = wb - err[:, None] * u_blk[i][None, :]
            qb = jax.lax.dynamic_update_index_in_dim(qb, q, i, axis=1)
            return wb, qb, jax.lax.dynamic_update_index_in_dim(eb, err, i, axis=1)

        wb = w[:, b0:b1]
        init = (wb, jnp.zeros_like(wb), jnp.zeros_like(wb))
        _, qb, eb = jax.lax.fori_loop(0, b1 - b0, column, init)
        codes.append(qb)
        if b1 < n:
            w = w.at[:, b1:].add(-eb @ u[b0:b1, b1:])
    return jnp.concatenate(codes, axis=1)


def gptq_layers(
    w: jax.Array,
    h: jax.Array,
    scale: jax.Array,
    zero_point: jax.Array,
    qmin: jax.Array,
    qmax: jax.Array,
    *,
    damp: float = 0.01,
    block: int = 128,
    act_order: bool = False,
) -> jax.Array:
    """`gptq_codes` of stacked layer weights w [L, out, in] with Hessians h [L, in, in] and
    per-layer encodings (scale [L, out, 1], qmin/qmax [L]), one layer at a time."""
    if w.ndim != 3 or h.shape != (w.shape[0], w.shape[2], w.shape[2]):
        raise QnpuError(f"gptq: weights {w.shape} and Hessians {h.shape} do not match")
    if not 0 < damp < 1:
        raise QnpuError(f"gptq damp must be in (0, 1), got {damp}")
    return jnp.stack(
        [
            gptq_codes(
                w[i],
                h[i],
                scale[i],
                zero_point[i],
                qmin[i],
                qmax[i],
                damp=damp,
                block=block,
                act_order=act_order,
            )
            for i in range(w.shape[0])
        ]
    )


def layer_error(w: jax.Array, w_hat: jax.Array, h: jax.Array) -> jax.Array:
    """The GPTQ objective tr((w − ŵ) H (w − ŵ)ᵀ) = Σ over tokens ‖x wᵀ − x ŵᵀ‖²."""
    d = (w - w_hat).astype(jnp.float32)
    return jnp.sum((d @ h) * d)
