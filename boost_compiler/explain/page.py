"""``report.html`` for :func:`boost_compiler.explain`: one self-contained file.

No network and no external file: CSS and the small table-sorting script are
inline, the SVG drawings are inlined (their ``id`` attributes prefixed per
drawing so they stay unique). Tables: ``#bottlenecks``, ``#plan``,
``#collectives``, ``#cost`` (click a header to sort; type in the box above a
table to filter its rows).
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import draw

if TYPE_CHECKING:
    from .result import Report, Stage

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:0;color:#111827;background:#f9fafb}
header{background:#1e1b4b;color:#fff;padding:16px 28px}header h1{margin:0 0 4px;font-size:22px}
header p{margin:0;color:#c7d2fe}nav{padding:8px 28px;background:#eef2ff;position:sticky;top:0;z-index:2}
nav a{margin-right:16px;color:#3730a3;text-decoration:none;font-weight:600}
main{padding:8px 28px 40px}section{margin:22px 0}h2{font-size:18px;border-bottom:2px solid #e0e7ff;padding-bottom:4px}
.cards{display:flex;flex-wrap:wrap;gap:12px}.card{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:10px 14px;min-width:150px}
.card b{display:block;font-size:20px;color:#3730a3}.card span{color:#6b7280;font-size:12px}
table{border-collapse:collapse;background:#fff;font-size:12.5px;margin:6px 0}
th,td{border:1px solid #e5e7eb;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef2ff;cursor:pointer;user-select:none;position:relative;white-space:nowrap}
th[data-order=asc]::after{content:" \\25B2"}th[data-order=desc]::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}tr:nth-child(even) td{background:#fafafa}
.wrap{max-height:520px;overflow:auto;border:1px solid #e5e7eb;display:inline-block;max-width:100%}
input.filter{display:block;margin:4px 0;padding:3px 6px;width:260px;border:1px solid #c7d2fe;border-radius:4px}
.pair{display:flex;gap:12px;align-items:flex-start;overflow-x:auto}
figure{margin:0;background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:8px;flex:1 1 0;min-width:320px;overflow:auto;max-height:900px}
figcaption{font-weight:600;margin-bottom:4px}figure svg{max-width:100%;height:auto}
.note{background:#fffbeb;border:1px solid #fcd34d;padding:8px 12px;border-radius:6px}
.error{background:#fef2f2;border:1px solid #fca5a5;padding:8px 12px;border-radius:6px;color:#991b1b}
.legend span{display:inline-block;padding:1px 8px;margin-right:6px;border:1px solid #d1d5db;border-radius:4px;font-size:12px}
ul.tree{margin:4px 0;padding-left:18px}code{font-size:12px}.muted{color:#6b7280}
"""

_JS = """
(function(){
  function key(cell){
    var s = cell.getAttribute('data-sort'); if (s === null) s = cell.textContent.trim();
    var n = Number(s); return (s !== '' && !isNaN(n)) ? n : s.toLowerCase();
  }
  document.querySelectorAll('table.sortable').forEach(function(table){
    table.querySelectorAll('thead th').forEach(function(th, i){
      th.addEventListener('click', function(){
        var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
        var asc = th.getAttribute('data-order') !== 'asc';
        table.querySelectorAll('thead th').forEach(function(h){ h.removeAttribute('data-order'); });
        th.setAttribute('data-order', asc ? 'asc' : 'desc');
        rows.sort(function(a, b){
          var x = key(a.cells[i]), y = key(b.cells[i]);
          var c = (typeof x === 'number' && typeof y === 'number') ? x - y
                : String(x).localeCompare(String(y), undefined, {numeric: true});
          return asc ? c : -c;
        });
        rows.forEach(function(r){ body.appendChild(r); });
      });
    });
  });
  document.querySelectorAll('input.filter').forEach(function(box){
    var table = document.getElementById(box.getAttribute('data-table'));
    box.addEventListener('input', function(){
      var q = box.value.toLowerCase();
      Array.prototype.forEach.call(table.tBodies[0].rows, function(r){
        r.style.display = r.textContent.toLowerCase().indexOf(q) >= 0 ? '' : 'none';
      });
    });
  });
  document.body.setAttribute('data-ready', '1');
})();
"""

_e = html.escape


def _num(n: int | float) -> str:
    return f'<td class="num" data-sort="{n}">{n:,}</td>'


def table(
    table_id: str,
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    caption: str = "",
    filterable: bool = False,
) -> str:
    """A sortable table; int/float cells are right-aligned and sort numerically.

    A cell given as ``("text", sort_key)`` shows text and sorts by the key.
    """
    body = []
    for row in rows:
        cells = []
        for v in row:
            if isinstance(v, bool):
                cells.append(f"<td>{'✓' if v else ''}</td>")
            elif isinstance(v, (int, float)):
                cells.append(_num(v))
            elif isinstance(v, tuple) and len(v) == 2:
                cells.append(f'<td data-sort="{_e(str(v[1]))}">{_e(str(v[0]))}</td>')
            else:
                cells.append(f"<td>{_e(str(v))}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    box = (
        f'<input class="filter" data-table="{table_id}" placeholder="filter rows…" '
        f'aria-label="filter {table_id}">'
        if filterable
        else ""
    )
    cap = f"<caption class=muted>{_e(caption)}</caption>" if caption else ""
    return (
        f'{box}<div class="wrap"><table id="{table_id}" class="sortable">{cap}'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


def inline_svg(path: Path, prefix: str) -> str:
    """The SVG's markup without its XML prolog, every ``id`` prefixed with ``prefix``."""
    text = path.read_text()
    text = text[text.find("<svg") :]
    return re.sub(r'\bid="', f'id="{prefix}', text)


def _figure(stage: Stage | None, kind: str, caption: str, prefix: str) -> str:
    if stage is None:
        return f"<figure><figcaption>{_e(caption)}</figcaption><p class=muted>none</p></figure>"
    svg = stage.files.get(f"{kind}.svg")
    dot = stage.files.get(f"{kind}.dot")
    if svg is not None and svg.exists():
        caption_link = f' <a class=muted href="{_e(svg.name)}">(full size)</a>'
        inner = inline_svg(svg, prefix)
        return f"<figure><figcaption>{_e(caption)}{caption_link}</figcaption>{inner}</figure>"
    elif dot is not None:
        inner = (
            f'<p class="note">No drawing: graphviz\'s <code>dot</code> was not installed. '
            f'DOT text: <a href="{_e(dot.name)}">{_e(dot.name)}</a></p>'
        )
    else:
        inner = "<p class=muted>nothing to draw</p>"
    return f"<figure><figcaption>{_e(caption)}</figcaption>{inner}</figure>"


def _tree(report: Report) -> str:
    """The bottlenecks by module as nested lists."""
    root: dict[str, Any] = {}
    for b in report.bottlenecks:
        node = root
        for part in (b.module.split(".") if b.module else ["·"])[:-1]:
            node = node.setdefault(part, {})
        leaf = b.module.rsplit(".", 1)[-1] if b.module else "·"
        node.setdefault("__leaves__", []).append(
            f"{leaf}: {b.d_in} → {b.rank} → {b.d_out} ({' → '.join(b.ops) or 'identity'})"
        )

    def render(node: dict[str, Any]) -> str:
        items = [f"<li>{_e(x)}</li>" for x in node.get("__leaves__", [])]
        for k, v in node.items():
            if k != "__leaves__":
                items.append(f"<li><b>{_e(k)}</b>{render(v)}</li>")
        return f'<ul class="tree">{"".join(items)}</ul>'

    return render(root)


def _cards(report: Report) -> str:
    """The summary's headline numbers."""
    rows = report.param_rows()
    per_rank = sum(r[4] for r in rows)
    sharded = sum(r[2].is_shard for r in rows)
    this = _cost_named(report, "this plan")
    std = _cost_named(report, "standard")
    cards = [
        (len(report.bottlenecks), "bottlenecks found"),
        (f"{sharded} / {len(rows)}", "parameters sharded"),
        (f"{per_rank:,}", "parameter bytes per rank"),
    ]
    if this is not None:
        cards.append(
            (f"{this.forward_count} / {this.backward_count}", "collectives fwd / bwd per step")
        )
        cards.append((f"{this.total:,}", "bytes per step (payload)"))
    if this is not None and std is not None and this.total:
        cards.append(
            (f"{std.total / this.total:.2f}x", "standard low-rank TP (estimate) / this plan")
        )
    return "".join(
        f"<div class=card><b>{_e(str(v))}</b><span>{_e(t)}</span></div>" for v, t in cards
    )


def _cost_named(report: Report, prefix: str) -> Any:
    return next((c for c in report.cost if c.name.startswith(prefix)), None)


def _bottleneck_rows(report: Report) -> list[tuple[Any, ...]]:
    return [
        (i, b.module or "·", b.down, b.up, b.d_in, b.rank, b.d_out, " → ".join(b.ops) or "identity")
        for i, b in enumerate(report.bottlenecks)
    ]


def _plan_rows(report: Report) -> list[tuple[Any, ...]]:
    return [
        (name, str(list(shape)), (str(pl), str(pl)), str(list(local)), nb, gb)
        for name, shape, pl, local, nb, gb in report.param_rows()
    ]


def _collective_rows(report: Report) -> list[tuple[Any, ...]]:
    rows = []
    for stage in report.stages:
        for layer, c, n in report.collective_groups(stage):
            rows.append(
                ((stage.name, stage.index), layer, c.kind, draw.payload_text(c),
                 draw.collective_bytes(c), n, c.forward, c.backward, c.reason)
            )  # fmt: skip
    return rows


def _cost_rows(report: Report) -> list[tuple[Any, ...]]:
    this = _cost_named(report, "this plan")
    return [
        (c.name, c.forward_bytes, c.forward_count if c.forward_count is not None else "",
         c.backward_bytes, c.backward_count if c.backward_count is not None else "", c.total,
         f"{c.total / this.total:.2f}x" if this and this.total else "", c.note)
        for c in report.cost
    ]  # fmt: skip


def _notes(report: Report) -> str:
    """Missing graphviz, the errors of the run, the ops that fell back to a gather."""
    notes = []
    if not report.dot:
        notes.append(
            '<p class="note">Graphviz\'s <code>dot</code> is not installed: the drawings are '
            "written as <code>.dot</code> text beside this file (install the Debian package "
            "<code>graphviz</code> and re-run to get the SVGs here).</p>"
        )
    notes += [f'<p class="error">{_e(e)}</p>' for e in report.errors]
    if report.plan.fallbacks:
        notes.append(
            '<p class="note">Ops without a sharding rule (gathered, exact but slower):<br>'
            + "<br>".join(_e(f) for f in report.plan.fallbacks)
            + "</p>"
        )
    return "".join(notes)


def _legend() -> str:
    return "".join(
        f'<span style="background:{fill}">{_e(text)}</span>'
        for fill, text in draw.CATEGORIES.values()
    ) + (
        f'<span style="background:{draw.COLLECTIVE_FILL["fwd"]};color:#fff">collective '
        "(hexagon)</span>"
        f'<span style="border:2px dashed {draw.CHAIN_COLOUR}">bottleneck chain</span>'
        f'<span style="border:3px double {draw.RECOMPUTE_COLOUR}">recomputed</span>'
        f'<span style="border:3px solid {draw.SAVED_COLOUR}">saved for backward</span>'
    )


def _pass_sections(report: Report) -> str:
    """Per pass: the drawn layer before and after it, and what it added."""
    passes = []
    for k, stage in enumerate(report.stages[1:], start=1):
        before = report.stages[k - 1]
        delta = (
            f"{len(stage.added)} node(s) added, {len(stage.removed)} removed; collectives "
            f"{len(before.collectives)} → {len(stage.collectives)} (whole graph)"
        )
        shown = ", ".join(stage.added[:12]) + (" …" if len(stage.added) > 12 else "")
        passes.append(
            f'<section class="pass" id="pass-{_e(stage.name)}"><h3>pass <code>{_e(stage.name)}'
            f"</code></h3><p class=muted>{_e(delta)}{(': new ' + _e(shown)) if shown else ''}</p>"
            f'<div class="pair">{_figure(before, "layer", f"before: after {before.name}", f"b{k}_")}'
            f"{_figure(stage, 'layer', f'after {stage.name}', f'a{k}_')}</div></section>"
        )
    if not passes and report.stages:
        passes.append(_figure(report.stages[0], "layer", "input", "a0_"))
    return "".join(passes)


def _model_figures(report: Report) -> str:
    """The whole model after the last stage; the earlier stages folded away."""
    final = report.final()
    models = [_figure(final, "model", f"after {final.name}" if final else "", "m_")]
    others = "".join(
        _figure(s, "model", f"after {s.name}", f"m{i}_") for i, s in enumerate(report.stages[:-1])
    )
    if others:
        models.append(f"<details><summary>earlier stages</summary>{others}</details>")
    return "".join(models)


def _file_list(report: Report) -> str:
    stage_files = []
    for s in report.stages:
        links = " ".join(f'<a href="{_e(p.name)}">{_e(p.name)}</a>' for p in s.files.values())
        stage_files.append(f"<li>{_e(s.slug)}: {links or '—'}</li>")
    return "".join(stage_files)


def write_html(report: Report, path: Path) -> Path:
    """Write ``report.html`` and return its path."""
    b_rows, p_rows = _bottleneck_rows(report), _plan_rows(report)
    c_rows, cost_rows = _collective_rows(report), _cost_rows(report)
    title = f"boost explain: {report.model_name} at tp={report.tp}"
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(title)}</title><style>{_CSS}</style></head>
<body>
<header><h1>{_e(title)}</h1><p>simulated on one process (fake process group); stages:
{_e(" → ".join(s.name for s in report.stages))}; representative layer: {_e(report.layer or "—")};
{report.graphs} graph(s); {report.seconds:.1f} s</p></header>
<nav><a href="#sec-summary">summary</a><a href="#sec-bottlenecks">bottlenecks</a><a href="#sec-plan">plan</a>
<a href="#sec-collectives">collectives</a><a href="#sec-cost">cost</a><a href="#sec-passes">passes</a>
<a href="#sec-model">model</a><a href="#sec-files">files</a></nav>
<main>
<section id="sec-summary"><div class="cards">{_cards(report)}</div>{_notes(report)}</section>
<section id="sec-bottlenecks"><h2>Bottlenecks ({len(report.bottlenecks)})</h2>
{table("bottlenecks", ["#", "module", "down factor", "up factor", "d_in", "r", "d_out", "ops between"], b_rows, filterable=True)}
<details><summary>by module</summary>{_tree(report)}</details></section>
<section id="sec-plan"><h2>Plan: parameter placements ({len(p_rows)} parameters)</h2>
{table("plan", ["parameter", "global shape", "placement", "per-rank shape", "per-rank bytes", "global bytes"], p_rows, "S(d): split along dim d; R: replicated", True)}</section>
<section id="sec-collectives"><h2>Collectives per layer after each pass</h2>
{table("collectives", ["stage", "layer", "kind", "payload (global)", "bytes each", "count", "fwd", "bwd", "why"], c_rows, "payload: the reduced / gathered tensor, the cost model's convention", True)}</section>
<section id="sec-cost"><h2>Communication per step vs the standard plan</h2>
{table("cost", ["plan", "fwd bytes", "fwd #", "bwd bytes", "bwd #", "total bytes", "vs this plan", "note"], cost_rows)}</section>
<section id="sec-passes"><h2>What each pass did to {_e(report.layer or "the graph")}</h2>
<p class="legend">{_legend()}</p>{_pass_sections(report)}</section>
<section id="sec-model"><h2>The whole model, one box per layer</h2>{_model_figures(report)}</section>
<section id="sec-files"><h2>Files</h2><ul>{_file_list(report)}</ul>
<p class=muted>Each stage's readable graph code: <code>graphs/graph_&lt;n&gt;/</code>.</p></section>
</main>
<script>{_JS}</script>
</body></html>
"""
    path.write_text(doc)
    return path
