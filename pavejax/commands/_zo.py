"""Pieces shared by the two branches of ``pavejax adapt`` (classifier head and ``--lm``): flag
checks, the guarantee record of a zeroth-order run and the summary lines."""

from __future__ import annotations

import argparse

from pavejax.commands import _shared as sh


def check_flags(ns: argparse.Namespace) -> None:
    """Refuses flag combinations that do not fit the chosen mechanism."""
    if ns.mechanism == "mi" and ns.mi_budget is None:
        raise ValueError("--mechanism mi needs --mi-budget (nats), e.g. 0.33")
    if ns.mechanism == "dpzo" and ns.epsilon is None:
        raise ValueError("--mechanism dpzo needs --epsilon (e.g. 4)")
    if ns.mechanism != "mi" and ns.mi_budget is not None:
        raise ValueError("--mi-budget applies to --mechanism mi only")
    if ns.mechanism != "dpzo" and ns.epsilon is not None:
        raise ValueError("--epsilon applies to --mechanism dpzo only (zpl releases 0 nats; mi "
                         "takes --mi-budget)")
    if ns.subsets % 2:
        raise ValueError(f"--subsets must be even (each pool example is in half of the "
                         f"subsets), got {ns.subsets}")


def guarantee(ns, zcfg, ledger, n: int, task: str) -> tuple[dict, dict]:
    """The guarantee and risk records of a zeroth-order run (what its release states)."""
    from pavejax.accounting import pac

    pool = f"each example of the private pool ({n} training examples of task {task!r})"
    membership = (f"each pool example's membership in the secret candidate subset (pool: {n} "
                  f"training examples of task {task!r}); the pool's content is not protected")
    kept = ["secret subset index and mechanism key drawn from the OS, never released",
            "the dev split used for selection lies outside the pool"]
    if ns.mechanism == "mezo":
        return ({"kind": "none", "note": "MeZO releases exact pool-mean directional "
                                         "derivatives: not private"},
                {"note": "non-private: no risk bound"})
    if ns.mechanism == "dpzo":
        g = sh.dp_guarantee(ledger, ns.delta, protects=pool, conditions=kept[:1] + [
            f"per-example differences clipped to {zcfg.l2_clip}, Poisson sampling"])
        return g, sh.risk_record(g["epsilon"], ns.delta)
    mi = ledger.mutual_information()
    post = pac.mia_posterior_bound(mi, 0.5)
    g = {"kind": "pac_mi", "mutual_information_nats": mi, "membership_prior": 0.5,
         "mia_posterior_bound": post, "num_subsets": zcfg.num_subsets, "protects": membership,
         "against": "anyone who sees this release and every update of the run, assumed to "
                    "know the whole pool and the candidate subsets",
         "conditions": kept + ["each pool example is in exactly half of the candidate subsets"]}
    return g, {"mutual_information_nats": mi, "mia_posterior_bound": post,
               "epsilon_at_same_mia_level": pac.mi_to_epsilon(mi, ns.delta),
               "delta_for_epsilon_match": ns.delta}


def summary_lines(guarantee: dict, delta: float, before: float, after: float) -> list[str]:
    """The test-accuracy and guarantee lines of the text summary."""
    if guarantee["kind"] == "pac_mi":
        what = (f"PAC: {guarantee['mutual_information_nats']:.4g} nats of mutual information "
                f"with the secret candidate subset; an example's membership posterior <= "
                f"{guarantee['mia_posterior_bound']:.4f} (prior 0.5); the pool's content is "
                f"not protected")
    elif guarantee["kind"] == "dp":
        what = (f"dp epsilon={guarantee['epsilon']:.4g} at delta={delta:g} (replace one "
                f"pool example; the pool size is public)")
    else:
        what = "none (not private)"
    return [f"test accuracy: {before:.4f} -> {after:.4f}", f"guarantee: {what}"]
