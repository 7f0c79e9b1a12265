"""The HTTP dock's read-only pages: well-formed, escaped, and faithful to the entries."""

import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser

from pavejax.service.page import render_error, render_index, render_learnware

EVIL = "<script>alert(1)</script> & co"
SVG = "{http://www.w3.org/2000/svg}"

INFO = {"format": "pavejax-dock", "title": "Test <dock>", "learnwares": 3, "version": 7,
        "signature": {"backbone_id": "toy", "backbone_hash": "b" * 64, "rank": 2,
                      "layers": ["l0/kernel", "l1/kernel"], "a_hash": "a" * 64,
                      "a_init": "gaussian"},
        "a_key": "0f" * 32, "certified_dp_only": True, "library_version": "0.1.0"}


def entry(i, name, eps, **kw):
    g = {"kind": "dp", "delta": 1e-5, "relation": "replace_one", "accountant": "pld"}
    if eps is not None:
        g["epsilon"] = eps
    e = {"id": i, "name": name, "submitter": None, "created": 1_700_000_000.0 + 3600 * i,
         "version": i, "classes": ["cat", "dog"], "backbone_id": "toy",
         "backbone_hash": "b" * 64, "rank": 2, "layers": ["l0/kernel", "l1/kernel"],
         "a_hash": "a" * 64, "mechanism": "gaussian", "guarantee": g,
         "ledger_summary": {"mechanism": "gaussian", **g}, "risk": {}, "has_model": False,
         "model_guarantee": None,
         "files": {"spec": {"sha256": "c" * 64, "size": 1536, "content_hash": "d" * 64}},
         "metadata": {}}
    e.update(kw)
    return e


ENTRIES = [entry(1, "alpha", 3.99, submitter="alice"), entry(2, EVIL, 0.5),
           entry(3, "gamma", 8.0, classes=None)]


class Doc(HTMLParser):
    """Collects the rows of ``table#learnwares`` (data-id, cell class -> text) and links."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.rows, self.links, self.text = [], [], []
        self._in_table = self._cell = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table" and a.get("id") == "learnwares":
            self._in_table = True
        elif tag == "tr" and self._in_table:
            self.rows.append({"data-id": a.get("data-id"), "cells": {}, "texts": []})
        elif tag == "td" and self._in_table:
            self._cell = [a.get("class"), ""]
        elif tag == "a":
            self.links.append(a.get("href"))

    def handle_endtag(self, tag):
        if tag == "table":
            self._in_table = False
        elif tag == "td" and self._cell is not None:
            cls, text = self._cell
            self.rows[-1]["cells"][cls] = text
            self.rows[-1]["texts"].append(text)
            self._cell = None

    def handle_data(self, data):
        self.text.append(data)
        if self._cell is not None:
            self._cell[1] += data


def parse(doc):
    assert doc.startswith("<!doctype html>")
    assert '<meta charset="utf-8">' in doc and "<title>" in doc and "<script" not in doc
    p = Doc()
    p.feed(doc)
    p.close()
    return p


def svg_of(doc):
    m = re.search(r"<svg\b.*?</svg>", doc, re.S)
    assert m, "no svg"
    return ET.fromstring(m.group(0))


def bars(root):
    return {int(r.get("data-id")): float(r.get("height"))
            for r in root.iter(f"{SVG}rect") if r.get("class") == "bar"}


def test_index_escapes_and_lists_every_learnware():
    doc = render_index(INFO, ENTRIES)
    p = parse(doc)
    assert "<script>alert(1)</script>" not in doc
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; co" in doc
    assert "Test &lt;dock&gt;" in doc
    rows = {r["data-id"]: r for r in p.rows if r["data-id"]}
    assert set(rows) == {"1", "2", "3"}
    for e in ENTRIES:
        cells = rows[str(e["id"])]["cells"]
        assert cells["eps"] == f"{e['guarantee']['epsilon']:.3g}"
        assert cells["delta"] == "1.0e-05"
        assert cells["name"] == e["name"]
        assert cells["model"] == "no"
    assert rows["1"]["cells"]["submitter"] == "alice"
    assert rows["2"]["cells"]["submitter"] == "local"
    assert rows["2"]["cells"]["classes"] == "cat, dog"
    assert rows["3"]["cells"]["classes"] == "—"
    assert rows["1"]["cells"]["created"] == "2023-11-14 23:13"
    assert "learnwares/2" in p.links
    assert "api/v1/learnwares" in p.links and "api/v1/snapshot" in p.links
    assert not any(h.startswith("/") for h in p.links)


def test_index_plot_bars_follow_epsilon():
    root = svg_of(render_index(INFO, ENTRIES))
    assert root.get("id") == "eps-plot"
    h = bars(root)
    assert set(h) == {1, 2, 3}
    assert h[2] < h[1] < h[3]
    assert abs(h[1] / h[3] - 3.99 / 8.0) < 1e-6  # proportional
    texts = ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
    assert any("ε" in t for t in texts)  # y axis label
    assert any(t.startswith("0") for t in texts)  # a tick at zero
    full = [t.text for t in root.iter(f"{SVG}title")]
    assert EVIL in full  # truncated label keeps the full name


def test_no_epsilon_no_bar_and_dash():
    entries = ENTRIES + [entry(4, "no-eps", None), entry(5, "inf", float("inf"))]
    doc = render_index(INFO, entries)
    rows = {r["data-id"]: r["cells"] for r in parse(doc).rows if r["data-id"]}
    assert rows["4"]["eps"] == "—" and rows["5"]["eps"] == "—"
    assert set(bars(svg_of(doc))) == {1, 2, 3}
    nan = entry(6, "nan-delta", 1.0)
    nan["guarantee"]["delta"] = float("nan")
    rows = {r["data-id"]: r["cells"] for r in parse(render_index(INFO, [nan])).rows}
    assert rows["6"]["delta"] == "—"


def test_many_learnwares_rotate_labels():
    entries = [entry(i, f"learnware number {i} with a long name", 0.1 * i) for i in range(1, 21)]
    root = svg_of(render_index(INFO, entries))
    h = bars(root)
    assert [h[i] for i in range(1, 21)] == sorted(h.values())
    labels = [t for t in root.iter(f"{SVG}text") if t.get("class") == "xlabel"]
    assert len(labels) == 20 and all("rotate" in t.get("transform", "") for t in labels)
    assert all(len(t.text or "".join(t.itertext())) <= 64 for t in labels)


def test_empty_dock():
    doc = render_index({**INFO, "learnwares": 0, "signature": None, "a_key": None}, [])
    p = parse(doc)
    assert [r["texts"] for r in p.rows if r["texts"]] == [["No learnwares yet"]]
    root = svg_of(doc)
    assert not bars(root)
    assert "No learnwares yet" in "".join(root.itertext())


def test_learnware_page():
    e = entry(2, EVIL, 0.5, ledger_summary={"note": "<b>x</b> & y", "eps": [1.0, 2.0]},
              risk={"excess_risk": 0.12, "confidence": 0.95}, has_model=True,
              model_guarantee={"kind": "dp", "epsilon": 2.0, "delta": 1e-6},
              metadata={"task": "<i>t</i>"},
              files={"spec": {"sha256": "c" * 64, "size": 1536, "content_hash": "d" * 64},
                     "model": {"sha256": "e" * 64, "size": 5 * 1024 * 1024 + 1,
                               "content_hash": "f" * 64}})
    doc = render_learnware(INFO, e)
    p = parse(doc)
    assert "<script>alert(1)</script>" not in doc and "<b>x</b>" not in doc
    assert "<i>t</i>" not in doc
    assert "&lt;b&gt;x&lt;/b&gt; &amp; y" in doc
    text = "".join(p.text)
    assert '"note": "<b>x</b> & y"' in text  # pretty JSON, escaped in the source
    assert "excess_risk" in text and "0.12" in text and "replace_one" in text
    assert "1.5 KiB" in text and "5.0 MiB" in text
    assert "c" * 64 in text and "e" * 64 in text
    assert "../api/v1/learnwares/2/spec" in p.links and "../api/v1/learnwares/2/model" in p.links
    assert "../" in p.links
    assert not any(h.startswith("/") for h in p.links)

    bare = render_learnware(INFO, entry(3, "gamma", 8.0))
    p = parse(bare)
    assert "../api/v1/learnwares/3/spec" in p.links
    assert "../api/v1/learnwares/3/model" not in p.links
    assert "none stated" in "".join(p.text)


def test_error_page():
    doc = render_error(404, "no learnware <img src=x onerror=alert(1)>")
    p = parse(doc)
    assert "<img" not in doc and "&lt;img src=x onerror=alert(1)&gt;" in doc
    assert "404 Not Found" in "".join(p.text)
