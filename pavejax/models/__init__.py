"""Flax NNX models: a BERT encoder that loads all-MiniLM-L6-v2 from safetensors (no torch),
its fixed-shape tokenizer, cached frozen sentence features, classification heads, and small
MLP/CNN backbones for vision tasks."""

from pavejax.models.bert import (
    BertConfig,
    BertEncoder,
    gelu,
    l2_normalize,
    mean_pool,
    sentence_embedding,
)
from pavejax.models.embed import embed_texts
from pavejax.models.heads import (
    ClassifierHead,
    TextClassifier,
    apply_head,
    example_loss,
    head0,
    label_space_head,
    public_random_head,
    public_random_projection,
)
from pavejax.models.loading import (
    BERT_IGNORED_TENSORS,
    TorchTarget,
    bert_torch_names,
    load_bert,
    load_minilm,
    load_state_from_torch_names,
    parameter_count,
)
from pavejax.models.small import (
    MLP,
    PretrainConfig,
    Pretrained,
    SmallCNN,
    build_model,
    classification_loss,
    fit_classifier,
    pretrain_backbone,
    with_new_head,
)
from pavejax.models.tokenize import TokenBatch, Tokenizer

__all__ = [
    "BERT_IGNORED_TENSORS",
    "MLP",
    "BertConfig",
    "BertEncoder",
    "ClassifierHead",
    "Pretrained",
    "PretrainConfig",
    "SmallCNN",
    "TextClassifier",
    "TokenBatch",
    "Tokenizer",
    "TorchTarget",
    "apply_head",
    "bert_torch_names",
    "build_model",
    "classification_loss",
    "embed_texts",
    "example_loss",
    "fit_classifier",
    "gelu",
    "head0",
    "l2_normalize",
    "label_space_head",
    "load_bert",
    "load_minilm",
    "load_state_from_torch_names",
    "mean_pool",
    "parameter_count",
    "pretrain_backbone",
    "public_random_head",
    "public_random_projection",
    "sentence_embedding",
    "with_new_head",
]
