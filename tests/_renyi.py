"""An independent reference for the tests of the sketch guarantees: the Rényi divergence of two
zero-mean Gaussians from determinants only (no eigenvalues, unlike the library's code)."""

import numpy as np


def logdet_renyi(s_p, s_q, alpha):
    """D_α(N(0, Σ_p) ‖ N(0, Σ_q)) from determinants of the matrices (no eigenvalues)."""
    mix = alpha * s_q + (1 - alpha) * s_p
    sign, ld_mix = np.linalg.slogdet(mix)
    assert sign > 0
    ld_p, ld_q = np.linalg.slogdet(s_p)[1], np.linalg.slogdet(s_q)[1]
    return -(ld_mix - (1 - alpha) * ld_p - alpha * ld_q) / (2 * (alpha - 1))
