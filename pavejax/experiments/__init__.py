"""Scenario builders that train models, for the benchmarks, the demo and the notebooks.

:mod:`~pavejax.experiments.market`: a simulated learnware market (N developer models trained on
real data, M few-shot user tasks, the measured oracle). Score identification methods on it with
:func:`pavejax.data.ranking_metrics`.
"""

from pavejax.experiments.market import (
    QUALITIES,
    DeveloperModel,
    Market,
    MarketConfig,
    UserTask,
    build_market,
    developer_classifier,
    evaluate_market,
    example_hashes,
)

__all__ = [
    "QUALITIES",
    "DeveloperModel",
    "Market",
    "MarketConfig",
    "UserTask",
    "build_market",
    "developer_classifier",
    "evaluate_market",
    "example_hashes",
]
