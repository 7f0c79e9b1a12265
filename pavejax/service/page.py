"""Read-only HTML pages of the HTTP dock: the index, one learnware, and errors.

Pure standard library: every string from the dock is escaped with :func:`html.escape`, the pages
carry their CSS inline and draw the ε plot as inline SVG (well-formed XML), with no script and no
external resource, so they work offline. Links are relative, so the pages work behind a path
prefix: the index lives at ``./`` and a learnware at ``./learnwares/ID``.
"""

from __future__ import annotations

import datetime
import html
import http
import json
import math
import re
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["render_index", "render_learnware", "render_error"]

DASH = "—"
LABEL_CHARS = 16
INDEX_CLASSES = 8

_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d232b;
background:#fafafa;margin:0 auto;max-width:72rem;padding:1rem 1.5rem 3rem}
h1{font-size:1.6rem;margin:.6rem 0}h2{font-size:1.15rem;margin:1.8rem 0 .6rem}
a{color:#1f5fa0}code,pre{font:13px/1.4 ui-monospace,Menlo,Consolas,monospace}
code{word-break:break-all}
pre{background:#f0f2f5;border:1px solid #d9dde3;padding:.7rem;overflow:auto;white-space:pre-wrap}
.note{background:#eef5ec;border-left:4px solid #4a8a3f;padding:.6rem .9rem}
.warn{background:#fbf1e6;border-left-color:#c27a1c}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{border-bottom:1px solid #e1e4e8;padding:.35rem .6rem;text-align:left;vertical-align:top}
th{background:#eef0f3}tbody tr:nth-child(even){background:#f7f8fa}
td.num,td.eps,td.delta{text-align:right;font-variant-numeric:tabular-nums}
td.num,td.eps,td.delta,td.model,td.created,th{white-space:nowrap}
td.empty{text-align:center;color:#667}
dl{display:grid;grid-template-columns:max-content 1fr;gap:.25rem 1rem;margin:.4rem 0}
dt{font-weight:600}dd{margin:0}
.muted{color:#667}.meta{color:#445}
#eps-plot{max-width:100%;height:auto;background:#fff;border:1px solid #e1e4e8}
#eps-plot .bar{fill:#3b6ea5}#eps-plot .axis{stroke:#556;stroke-width:1}
#eps-plot .grid{stroke:#e3e6ea;stroke-width:1}
#eps-plot text{font:11px system-ui,sans-serif;fill:#333}#eps-plot .empty{font-size:14px;fill:#667}
footer{margin-top:2.5rem;color:#778;font-size:.85rem}
""".strip()


# ----------------------------------------------------------------------------- formatting


def _e(value: Any) -> str:
    """``value`` as escaped text (quotes too), without characters XML forbids."""
    return html.escape(_XML_INVALID.sub("\ufffd", str(value)), quote=True)


def _finite(value: Any) -> float | None:
    """``value`` as a float if it is a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        x = float(value)
    except (OverflowError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _fmt(value: Any, spec: str) -> str:
    x = _finite(value)
    return DASH if x is None else format(x, spec)


def _epsilon(entry: Mapping[str, Any]) -> float | None:
    g = entry.get("guarantee")
    return _finite(g.get("epsilon")) if isinstance(g, Mapping) else None


def _delta(entry: Mapping[str, Any]) -> float | None:
    g = entry.get("guarantee")
    return _finite(g.get("delta")) if isinstance(g, Mapping) else None


def _when(ts: Any) -> str:
    """Unix seconds as a UTC ``YYYY-MM-DD HH:MM``; the dash when not a valid time."""
    x = _finite(ts)
    if x is None:
        return DASH
    try:
        return datetime.datetime.fromtimestamp(x, datetime.UTC).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):
        return DASH


def _size(n: Any) -> str:
    """A byte count, human-readable (B, KiB, MiB, GiB, TiB)."""
    x = _finite(n)
    if x is None or x < 0:
        return DASH
    if x < 1024:
        return f"{int(x)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        x /= 1024
        if x < 1024 or unit == "TiB":
            return f"{x:.1f} {unit}"
    raise AssertionError  # unreachable


def _json(value: Any) -> str:
    """Pretty-printed JSON, escaped."""
    try:
        text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return _e(text)


def _value(value: Any) -> str:
    """One value of a definition list as HTML: numbers formatted, containers as JSON."""
    if value is None:
        return DASH
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return _e(value)
    if isinstance(value, float):
        return _fmt(value, ".6g")
    if isinstance(value, Mapping | list | tuple):
        return f"<code>{_json(value)}</code>" if value else DASH
    return _e(value)


def _dl(mapping: Mapping[str, Any], cls: str = "") -> str:
    attr = f' class="{cls}"' if cls else ""
    rows = "".join(f"<dt>{_e(k)}</dt><dd>{_value(v)}</dd>" for k, v in mapping.items())
    return f"<dl{attr}>{rows}</dl>"


def _classes(classes: Any, limit: int | None = None) -> str:
    if not isinstance(classes, list | tuple) or not classes:
        return DASH
    shown = [str(c) for c in (classes if limit is None else classes[:limit])]
    text = ", ".join(shown)
    if limit is not None and len(classes) > limit:
        text += f", … (+{len(classes) - limit} more)"
    return _e(text)


def _link_id(entry_id: Any) -> str:
    return urllib.parse.quote(str(entry_id), safe="")


def _page(title: str, body: str, info: Mapping[str, Any] | None = None) -> str:
    footer = ""
    if info is not None:
        lib = info.get("library_version")
        footer = (f"<footer>pavejax-dock format, dock version {_e(info.get('version', DASH))}"
                  + (f" · pavejax {_e(lib)}" if lib else "") + "</footer>")
    return ("<!doctype html>\n"
            '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{_e(title)}</title>\n<style>\n{_CSS}\n</style>\n</head>\n"
            f"<body>\n{body}\n{footer}\n</body>\n</html>\n")


# ----------------------------------------------------------------------------- ε plot


def _nice_top(ymax: float) -> tuple[float, float]:
    """(top, step) of a y axis from 0 covering ``ymax`` in about four round steps."""
    raw = ymax / 4
    if not (raw > 0 and math.isfinite(raw)):
        return (1.0, 0.25) if ymax <= 0 else (ymax, ymax / 4)
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-12))
    top = step * math.ceil(ymax / step - 1e-9)
    if not (math.isfinite(top) and top >= ymax):
        return ymax, ymax / 4
    return top, step


def _short(name: str) -> str:
    return name if len(name) <= LABEL_CHARS else name[:LABEL_CHARS - 1] + "…"


def _svg_empty(message: str) -> str:
    return ('<svg id="eps-plot" xmlns="http://www.w3.org/2000/svg" width="480" height="120" '
            'viewBox="0 0 480 120" role="img"><title>ε per learnware</title>'
            f'<text class="empty" x="240" y="64" text-anchor="middle">{_e(message)}</text></svg>')


def _svg_plot(entries: Sequence[Mapping[str, Any]]) -> str:
    """Bars of ε per learnware (entries without a finite ε are left out)."""
    if not entries:
        return _svg_empty("No learnwares yet")
    bars = [(e, eps) for e in entries if (eps := _epsilon(e)) is not None]
    if not bars:
        return _svg_empty("No learnware states a numeric ε")
    n = len(bars)
    shorts = [_short(str(e.get("name", ""))) for e, _ in bars]
    right, top_m, plot_h = 16.0, 20.0, 200.0
    slot = max(30.0 if n > 6 else 56.0, (360.0 - 64.0 - right) / n)
    rotate = n > 6 or max(map(len, shorts)) * 6.5 > slot  # ~6.5 px a character
    left = 88.0 if rotate else 64.0
    bottom = 110.0 if rotate else 36.0
    width = left + n * slot + right
    height = top_m + plot_h + bottom
    base = top_m + plot_h
    ymax = max(max(eps for _, eps in bars), 0.0)
    ytop, step = _nice_top(ymax)

    out = [f'<svg id="eps-plot" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
           f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" role="img">'
           "<title>ε per learnware</title>"]
    k = 0
    while True:  # grid lines and y ticks
        t = k * step
        if t > ytop * (1 + 1e-9) or k > 20:
            break
        y = base - plot_h * t / ytop
        out.append(f'<line class="grid" x1="{left:.2f}" y1="{y:.2f}" '
                   f'x2="{width - right:.2f}" y2="{y:.2f}"/>'
                   f'<text class="tick" x="{left - 6:.2f}" y="{y + 4:.2f}" '
                   f'text-anchor="end">{_e(format(t, ".4g"))}</text>')
        k += 1
    out.append(f'<line class="axis" x1="{left:.2f}" y1="{top_m:.2f}" x2="{left:.2f}" '
               f'y2="{base:.2f}"/><line class="axis" x1="{left:.2f}" y1="{base:.2f}" '
               f'x2="{width - right:.2f}" y2="{base:.2f}"/>')
    ymid = top_m + plot_h / 2
    out.append(f'<text class="ylabel" x="16" y="{ymid:.2f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {ymid:.2f})">ε (privacy loss)</text>')
    bar_w = slot * 0.7
    for i, (e, eps) in enumerate(bars):
        cx = left + (i + 0.5) * slot
        h = plot_h * max(eps, 0.0) / ytop
        name, short = str(e.get("name", "")), shorts[i]
        out.append(f'<rect class="bar" data-id="{_e(e.get("id"))}" x="{cx - bar_w / 2:.2f}" '
                   f'y="{base - h:.4f}" width="{bar_w:.2f}" height="{h:.4f}">'
                   f"<title>{_e(name)}: ε = {eps:.3g}</title></rect>")
        if n <= 12:
            out.append(f'<text class="value" x="{cx:.2f}" y="{base - h - 4:.2f}" '
                       f'text-anchor="middle">{eps:.3g}</text>')
        ly = base + 14
        if rotate:
            out.append(f'<text class="xlabel" x="{cx:.2f}" y="{ly:.2f}" text-anchor="end" '
                       f'transform="rotate(-45 {cx:.2f} {ly:.2f})">'
                       f"<title>{_e(name)}</title>{_e(short)}</text>")
        else:
            out.append(f'<text class="xlabel" x="{cx:.2f}" y="{ly + 2:.2f}" '
                       f'text-anchor="middle"><title>{_e(name)}</title>{_e(short)}</text>')
    out.append("</svg>")
    return "".join(out)


# ----------------------------------------------------------------------------- pages


def _privacy_note(info: Mapping[str, Any]) -> str:
    if info.get("certified_dp_only", True):
        held = ("This dock holds only specifications that carry a certified "
                "differential-privacy guarantee (ε, δ in the table below).")
        cls = "note"
    else:
        held = ("This dock also accepts specifications without a certified "
                "differential-privacy guarantee; check each learnware's guarantee below.")
        cls = "note warn"
    return (f'<p class="{cls}">{held} Its A key is public, so a specification\'s privacy '
            "rests on its DP guarantee alone. To search, a "
            'user downloads the <a href="api/v1/snapshot">spec snapshot</a> and matches it '
            "locally against their own specification, which never leaves their machine.</p>")


def _signature(info: Mapping[str, Any]) -> str:
    sig = info.get("signature")
    rows: dict[str, Any] = {}
    if isinstance(sig, Mapping):
        layers = sig.get("layers")
        rows = {"backbone": sig.get("backbone_id"),
                "backbone hash": sig.get("backbone_hash"),
                "rank": sig.get("rank"),
                "layers": len(layers) if isinstance(layers, list | tuple) else layers,
                "A hash": sig.get("a_hash")}
    if info.get("a_key"):
        rows["A key (public)"] = info.get("a_key")
    if not rows:
        return '<p class="muted">No signature yet: the first submission fixes it.</p>'
    code = ("backbone hash", "A hash", "A key (public)")
    return ('<dl class="meta">' + "".join(
        f"<dt>{_e(k)}</dt><dd>"
        + (f"<code>{_e(v)}</code>" if k in code and isinstance(v, str) else _value(v))
        + "</dd>" for k, v in rows.items()) + "</dl>")


def _index_row(e: Mapping[str, Any]) -> str:
    eid = e.get("id")
    g = e.get("guarantee")
    kind = g.get("kind", DASH) if isinstance(g, Mapping) else "none"
    eps, delta = _epsilon(e), _delta(e)
    submitter = e.get("submitter") or "local"
    return (f'<tr data-id="{_e(eid)}">'
            f'<td class="num">{_e(eid)}</td>'
            f'<td class="name"><a href="learnwares/{_link_id(eid)}">{_e(e.get("name", ""))}</a>'
            f"</td>"
            f'<td class="submitter">{_e(submitter)}</td>'
            f'<td class="classes">{_classes(e.get("classes"), INDEX_CLASSES)}</td>'
            f'<td class="kind">{_e(kind if kind is not None else DASH)}</td>'
            f'<td class="eps">{DASH if eps is None else f"{eps:.3g}"}</td>'
            f'<td class="delta">{DASH if delta is None else f"{delta:.1e}"}</td>'
            f'<td class="model">{"yes" if e.get("has_model") else "no"}</td>'
            f'<td class="created">{_when(e.get("created"))}</td></tr>')


def render_index(info: Mapping[str, Any], entries: Sequence[Mapping[str, Any]]) -> str:
    """The dock's home page: privacy note, table of learnwares and a bar plot of their ε."""
    title = str(info.get("title") or "pavejax dock")
    head = ("<tr><th>id</th><th>name</th><th>submitter</th><th>classes</th><th>guarantee</th>"
            "<th>ε</th><th>δ</th><th>model</th><th>submitted (UTC)</th></tr>")
    if entries:
        rows = "\n".join(_index_row(e) for e in entries)
    else:
        rows = '<tr class="empty"><td class="empty" colspan="9">No learnwares yet</td></tr>'
    unplotted = sum(_epsilon(e) is None for e in entries)
    plot_note = (f'<p class="muted">{unplotted} learnware{"s" if unplotted != 1 else ""} '
                 "without a numeric ε not plotted.</p>" if entries and unplotted else "")
    count = len(entries)
    body = (f"<header><h1>{_e(title)}</h1>"
            f'<p class="meta">{count} learnware{"s" if count != 1 else ""} · '
            f"dock version {_e(info.get('version', DASH))}</p></header>\n"
            f"{_privacy_note(info)}\n"
            f"<h2>Signature</h2>\n{_signature(info)}\n"
            f'<h2>Learnwares</h2>\n<table id="learnwares">\n<thead>{head}</thead>\n'
            f"<tbody>\n{rows}\n</tbody>\n</table>\n"
            f"<h2>Privacy loss ε per learnware</h2>\n<figure>{_svg_plot(entries)}</figure>\n"
            f"{plot_note}\n"
            '<h2>JSON API</h2>\n<ul><li><a href="api/v1/learnwares">api/v1/learnwares</a>: '
            "the index as JSON</li>"
            '<li><a href="api/v1/snapshot">api/v1/snapshot</a>: every specification, '
            "for a local search</li></ul>")
    return _page(title, body, info)


def _downloads(e: Mapping[str, Any]) -> str:
    files = e.get("files")
    files = files if isinstance(files, Mapping) else {}
    items = []
    for kind in ("spec", "model"):
        f = files.get(kind)
        if not isinstance(f, Mapping):
            continue
        href = f"../api/v1/learnwares/{_link_id(e.get('id'))}/{kind}"
        items.append(f'<li class="download" data-kind="{kind}"><a href="{href}">{kind}</a> · '
                     f'<span class="size">{_size(f.get("size"))}</span> · sha256 '
                     f"<code>{_e(f.get('sha256', DASH))}</code></li>")
    return f"<ul>{''.join(items)}</ul>" if items else '<p class="muted">No files.</p>'


def render_learnware(info: Mapping[str, Any], entry: Mapping[str, Any]) -> str:
    """One learnware's page: identity, signature, guarantee, ledger summary, risk, downloads."""
    name = str(entry.get("name", ""))
    layers = entry.get("layers")
    layers_html = (f"<code>{_e(', '.join(map(str, layers)))}</code>"
                   if isinstance(layers, list | tuple) and layers else DASH)
    ident = ("<dl>"
             f"<dt>id</dt><dd>{_e(entry.get('id'))}</dd>"
             f"<dt>submitter</dt><dd>{_e(entry.get('submitter') or 'local')}</dd>"
             f"<dt>submitted</dt><dd>{_when(entry.get('created'))} UTC</dd>"
             f"<dt>version</dt><dd>{_value(entry.get('version'))}</dd>"
             f"<dt>classes</dt><dd>{_classes(entry.get('classes'))}</dd>"
             f"<dt>backbone</dt><dd>{_e(entry.get('backbone_id', DASH))}</dd>"
             f"<dt>backbone hash</dt><dd><code>{_e(entry.get('backbone_hash', DASH))}</code></dd>"
             f"<dt>rank</dt><dd>{_value(entry.get('rank'))}</dd>"
             f"<dt>layers</dt><dd>{layers_html}</dd>"
             f"<dt>A hash</dt><dd><code>{_e(entry.get('a_hash', DASH))}</code></dd>"
             f"<dt>mechanism</dt><dd>{_value(entry.get('mechanism'))}</dd>"
             "</dl>")
    g = entry.get("guarantee")
    guarantee = (_dl(g, "guarantee") if isinstance(g, Mapping) and g
                 else '<p class="muted">No guarantee stated.</p>')
    risk = entry.get("risk")
    risk_html = (_dl(risk, "risk") if isinstance(risk, Mapping) and risk
                 else '<p class="muted">none stated</p>')
    mg = entry.get("model_guarantee")
    if not entry.get("has_model"):
        model = '<p class="muted">No model is shared for this learnware.</p>'
    elif isinstance(mg, Mapping) and mg:
        model = _dl(mg, "model-guarantee")
    else:
        model = '<p class="muted">The model release states no guarantee.</p>'
    meta = entry.get("metadata")
    meta_html = (f"<h2>Metadata</h2>\n{_dl(meta, 'metadata')}\n"
                 if isinstance(meta, Mapping) and meta else "")
    body = (f'<nav><a href="../">← {_e(info.get("title") or "dock")}</a></nav>\n'
            f"<header><h1>{_e(name)}</h1></header>\n{ident}\n"
            f"<h2>Guarantee</h2>\n{guarantee}\n"
            f'<h2>Ledger summary</h2>\n<pre class="ledger">{_json(entry.get("ledger_summary"))}'
            "</pre>\n"
            f"<h2>Risk bounds</h2>\n{risk_html}\n"
            f"<h2>Model release</h2>\n{model}\n"
            f"{meta_html}"
            f"<h2>Downloads</h2>\n{_downloads(entry)}\n"
            '<p><a href="../">Back to the dock</a></p>')
    return _page(f"{name} · {info.get('title') or 'pavejax dock'}", body, info)


def render_error(status: int, message: str) -> str:
    """A small error page for HTTP ``status`` with ``message`` (escaped)."""
    try:
        phrase = http.HTTPStatus(int(status)).phrase
    except (TypeError, ValueError):
        phrase = "Error"
    title = f"{status} {phrase}"
    body = (f"<header><h1>{_e(title)}</h1></header>\n"
            f'<p class="error">{_e(message)}</p>')
    return _page(title, body)
