"""Deterministic task suites on real data: sentiment domains, BBC topics, digits, MNIST-5k.

Data comes from assets installed by ``pavejax assets`` (never downloaded at run time). Every
task has stratified train/dev/test splits fixed by a seed; see :func:`load_task` and
:func:`list_tasks`. :mod:`pavejax.data.metrics` scores predictions against them. Nothing here
trains or loads a model (scenarios that train, like the learnware market, are in
:mod:`pavejax.experiments`).
"""

from pavejax.data.batching import iterate_batches
from pavejax.data.files import load_dataset_file, read_table
from pavejax.data.metrics import (
    RankingMetrics,
    class_identity_accuracy,
    oracle_best,
    ranking_metrics,
)
from pavejax.data.registry import TaskInfo, list_tasks, load_task, task_info
from pavejax.data.tasks import (
    Split,
    Task,
    class_subset_task,
    few_shot,
    group_classes_task,
    limit_task,
    split_task,
    stratified_split,
    stratified_subsample,
    task_fingerprint,
)
from pavejax.data.text import (
    SENTIMENT_DOMAINS,
    binarize_ratings,
    load_bbc,
    load_sentiment,
    load_sentiment_raw,
)
from pavejax.data.vision import load_digits, load_mnist5k

__all__ = [
    "RankingMetrics",
    "SENTIMENT_DOMAINS",
    "Split",
    "Task",
    "TaskInfo",
    "binarize_ratings",
    "class_identity_accuracy",
    "class_subset_task",
    "few_shot",
    "group_classes_task",
    "iterate_batches",
    "limit_task",
    "list_tasks",
    "load_bbc",
    "load_dataset_file",
    "load_digits",
    "load_mnist5k",
    "load_sentiment",
    "load_sentiment_raw",
    "load_task",
    "oracle_best",
    "ranking_metrics",
    "read_table",
    "split_task",
    "stratified_split",
    "stratified_subsample",
    "task_fingerprint",
    "task_info",
]
