"""Plain float32 references for the routed-expert FFN and for per-group expert capacity.

Written for obviousness, not speed: a static Python loop over experts, each expert applied to every token
and masked by the tokens actually routed to it (masks instead of dynamic shapes, so jax.grad works).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

HIGHEST = jax.lax.Precision.HIGHEST


def _silu(a):
    return a / (1.0 + jnp.exp(-a))


def swiglu(x_TD, wi_0_DF, wi_1_DF, wo_FD):
    """(silu(x @ wi_0) * (x @ wi_1)) @ wo, in float32."""
    gate = jnp.matmul(x_TD, wi_0_DF, precision=HIGHEST)
    up = jnp.matmul(x_TD, wi_1_DF, precision=HIGHEST)
    return jnp.matmul(_silu(gate) * up, wo_FD, precision=HIGHEST)


def moe_reference(x_TD, weights_TK, experts_TK, wi_0_EDF, wi_1_EDF, wo_EFD, kept_TK=None):
    """y[t] = sum over slots j (kept) of weights[t, j] * SwiGLU_{experts[t, j]}(x[t]), all in float32.

    kept_TK (bool/0-1, optional) zeroes the slots that are not kept (dropped by capacity).
    """
    f32 = jnp.float32
    x_TD = jnp.asarray(x_TD).astype(f32)
    weights_TK = jnp.asarray(weights_TK).astype(f32)
    experts_TK = jnp.asarray(experts_TK)
    wi_0_EDF = jnp.asarray(wi_0_EDF).astype(f32)
    wi_1_EDF = jnp.asarray(wi_1_EDF).astype(f32)
    wo_EFD = jnp.asarray(wo_EFD).astype(f32)
    if kept_TK is not None:
        weights_TK = weights_TK * jnp.asarray(kept_TK).astype(f32)
    num_experts = wi_0_EDF.shape[0]
    y_TD = jnp.zeros(x_TD.shape, f32)
    for e in range(num_experts):
        # Combine weight of expert e for every token: weights of the slots that chose e (0 if none).
        routed_TK = (experts_TK == e).astype(f32)
        coef_T = jnp.sum(weights_TK * routed_TK, axis=-1)
        out_TD = swiglu(x_TD, wi_0_EDF[e], wi_1_EDF[e], wo_EFD[e])
        y_TD = y_TD + coef_T[:, None] * out_TD   # scatter-add onto the routed tokens (others get 0)
    return y_TD


def capacity_kept_reference(experts_GLK, num_experts: int, cap: int) -> np.ndarray:
    """kept[g, s, j]: within each group, serve all first choices in token order, then all second choices,
    ...; a slot is kept while its expert holds fewer than `cap` kept slots."""
    experts_GLK = np.asarray(experts_GLK)
    g_count, s_count, k_count = experts_GLK.shape
    kept = np.zeros(experts_GLK.shape, dtype=bool)
    for g in range(g_count):
        load = [0] * num_experts
        for j in range(k_count):
            for s in range(s_count):
                e = int(experts_GLK[g, s, j])
                if load[e] < cap:
                    kept[g, s, j] = True
                    load[e] += 1
    return kept
