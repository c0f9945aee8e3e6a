"""The report as one self-contained HTML page (``npu-fusion report --html FILE``).

``npu-fusion report --html FILE``: the report as one self-contained page a person reads at a glance.

The page has no script, no stylesheet or font to fetch and no image file: inline CSS and inline
SVG only, so it opens offline and renders the same anywhere. Per target (one for the ordinary
report, one per ``--target`` of ``--hf-config``):

- every site, per layer, as a green (fused: the chip runs it) or red (left unfused) box, with its
  module, op, mode and reason on hover (the SVG ``<title>``) and in the table under it;
- the backward graph's op counts before and after the pass (all nodes, then the ops that changed;
  an inference report's inference graph);
- the modelled traffic of the replaced subgraphs per op as bars against the fused op's minimum,
  and the bytes the forward saves for the backward before and after (not for an inference report);
- the float64 check, named for what it checked: a training step's gradients, an inference step's outputs.

The layer of a site is the first number in its module path (``model.layers.3.self_attn``: 3);
sites outside numbered layers (the final norm) form their own row.
"""
from __future__ import annotations

import html
import re
from typing import Any, Dict, List, Tuple

from ..lowering import FUSED_OPS

FUSED, MISSED = "#2e7d32", "#c62828"
BEFORE, AFTER, MINIMUM = "#9e9e9e", "#1565c0", "#2e7d32"
#: a site's op as its box in the map says it, from each fused op's declaration (else its name)
SHORT = {op.name: op.short_label for op in FUSED_OPS if op.short_label}
CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 24px; color: #212121; }
h1 { font-size: 22px; margin: 0 0 4px 0; } h2 { font-size: 18px; margin: 28px 0 6px 0;
border-bottom: 2px solid #e0e0e0; } h3 { font-size: 15px; margin: 18px 0 6px 0; }
.sub { color: #616161; font-size: 13px; } .ok { color: #2e7d32; } .bad { color: #c62828; }
table { border-collapse: collapse; font-size: 12px; margin-top: 6px; }
td, th { border: 1px solid #e0e0e0; padding: 3px 8px; text-align: left; }
th { background: #f5f5f5; } td.n { white-space: nowrap; } tr.missed td { background: #ffebee; }
svg text { font-family: inherit; } svg { display: block; margin-bottom: 8px; }
.charts { display: flex; flex-wrap: wrap; gap: 24px; } .charts > div { flex: 1 1 430px; min-width: 0; }
"""


def writer(path: str):
    """A report sink (``npu_fusion.report.command.run``) that writes the page to ``path``."""
    def write(report: Dict[str, Any]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(render(report))
    return write


def render(report: Dict[str, Any]) -> str:
    """The page of an ordinary report or of an ``--hf-config`` report (several targets)."""
    views = list(report["targets"].items()) if "targets" in report else [(None, report)]
    body = [f"<h1>npu-fusion report: {_e(report['model'])}</h1>", f"<div class='sub'>{_e(_subtitle(report))}</div>"]
    for _, view in views:
        body.append(_target_section(view))
    return ("<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>npu-fusion report: {_e(report['model'])}</title><style>{CSS}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def _subtitle(report: Dict[str, Any]) -> str:
    if "config" in report:
        sizes = ", ".join(f"{k} {v}" for k, v in report["config"].items())
        return f"{sizes}; traced on the meta device in {report['seconds']:.1f} s, no weights"
    s = report["settings"]
    inputs = f"inputs {', '.join(s['inputs'])}" if "inputs" in s else f"batch {s['batch']} x seq {s['seq']}"
    return f"{inputs}, {s['dtype']}, partitioner {s['partitioner']}"


def _target_section(r: Dict[str, Any]) -> str:
    s = r["settings"]
    sites = _all_sites(r)
    fused = sum(1 for x in sites if x["fused"])
    verdict = "ok" if fused == len(sites) else "bad"
    head = (f"<h2>Target {_e(s['resolved_target'])}: <span class='{verdict}'>{fused} of {len(sites)} "
            f"sites fused</span></h2><div class='sub'>{s['layers'] or '-'} layer(s), {_e(s['dtype'])}, "
            f"batch {s['batch'] or '-'} x seq {s['seq'] or '-'}</div>")
    per_op = ", ".join(f"{SHORT.get(op, op)} {o['fused']} of {o['found']}" for op, o in r["ops"].items() if o["found"])
    head += f"<div class='sub'>fused per op: {_e(per_op or 'no site found')}</div>"
    train = s.get("train", True)
    head += _check_line(r["gradients"], train)
    errors = "".join(f"<p class='bad'>PASS ERROR (graph left unchanged): {_e(e)}</p>" for e in r["pass_errors"])
    graph, traffic = (("Backward graph", "Modelled traffic of the replaced subgraphs, and bytes saved for the backward")
                      if train else ("Inference graph", "Modelled traffic of the replaced subgraphs"))
    return "".join([head, errors, "<h3>Sites by layer (hover for the reason)</h3>", _layer_map(sites),
                    _site_table(sites), f"<div class='charts'><div><h3>{graph} ops, before and after</h3>",
                    _op_bars(r["op_counts"]), f"</div><div><h3>{traffic}</h3>", _traffic_bars(r, train),
                    "</div></div>"])


def _check_line(g: Dict[str, Any], train: bool = True) -> str:
    """The float64 check's verdict, named for what it checked: a training step's gradients, an inference step's outputs."""
    checked = "gradient" if train else "output"
    if not g.get("per_dtype"):
        nothing = "no parameter gradient" if train else "no floating output"
        return f"<div class='sub'>no {checked} check: {_e(g.get('why', nothing))}</div>"
    worst = max(row["max_abs_diff_vs_eager"] for row in g["per_dtype"].values())
    verdict = "<span class='ok'>PASSED</span>" if g["passed"] else "<span class='bad'>FAILED</span>"
    return (f"<div class='sub'>{checked} check against eager and float64: {verdict} (max |compiled - eager| "
            f"{worst:.3g})</div>")


def _all_sites(r: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Fused sites and recorded misses, in model order, each with its layer."""
    rows = [dict(s, fused=True, reason="") for s in r["sites"]]
    rows += [dict(m, fused=False, mode=None, bytes_before=0, bytes_after=0, bytes_minimum=0) for m in r["misses"]]
    for row in rows:
        row["layer"] = _layer(row.get("module") or "")
    return sorted(rows, key=lambda x: (_layer_key(x["layer"]), x.get("module") or "", x["op"]))


def _layer(path: str) -> str:
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return f"layer {match.group(1)}" if match else (path or "?")


def _layer_key(layer: str) -> Tuple[int, int, str]:
    return (0, int(layer.split()[1]), "") if layer.startswith("layer ") else (1, 0, layer)


def _layer_map(sites: List[Dict[str, Any]]) -> str:
    """One row of boxes per layer: green fused, red missed, the reason in each box's tooltip."""
    layers: Dict[str, List[Dict[str, Any]]] = {}
    for site in sites:
        layers.setdefault(site["layer"], []).append(site)
    box_w, box_h, gap, label_w = 132, 34, 6, 110
    width = label_w + max((len(v) for v in layers.values()), default=1) * (box_w + gap) + 10
    height = len(layers) * (box_h + gap) + 30
    parts = [f"<svg width='{width}' height='{height}' role='img'>"]
    for row, (layer, members) in enumerate(layers.items()):
        y = row * (box_h + gap)
        parts.append(f"<text x='0' y='{y + 22}' font-size='13' font-weight='bold'>{_e(layer)}</text>")
        for col, site in enumerate(members):
            parts.append(_site_box(site, label_w + col * (box_w + gap), y, box_w, box_h))
    y = len(layers) * (box_h + gap) + 16
    parts.append(f"<rect x='0' y='{y - 10}' width='12' height='12' fill='{FUSED}'/><text x='18' y='{y}' "
                 f"font-size='12'>fused: the chip runs the fused op</text><rect x='250' y='{y - 10}' width='12' "
                 f"height='12' fill='{MISSED}'/><text x='268' y='{y}' font-size='12'>left unfused (reason on "
                 "hover and in the table)</text></svg>")
    return "".join(parts)


def _site_box(site: Dict[str, Any], x: int, y: int, w: int, h: int) -> str:
    module = site.get("module") or "?"
    where = module.split(".")[-1] if module != "?" else "?"
    status = f"fused ({site['mode']})" if site["fused"] and site["mode"] else "fused" if site["fused"] else "NOT fused"
    tip = f"{module}\n{site['op']}: {status}" + (f"\nreason: {site['reason']}" if site["reason"] else "")
    if site["fused"]:
        tip += f"\ntraffic {_bytes(site['bytes_before'])} -> {_bytes(site['bytes_after'])}"
    return (f"<g><title>{_e(tip)}</title><rect x='{x}' y='{y}' width='{w}' height='{h}' rx='4' "
            f"fill='{FUSED if site['fused'] else MISSED}'/><text x='{x + 6}' y='{y + 14}' font-size='11' "
            f"fill='white' font-weight='bold'>{_e(SHORT.get(site['op'], site['op']))}"
            f"{' ' + _e(site['mode']) if site['mode'] else ''}</text><text x='{x + 6}' y='{y + 28}' "
            f"font-size='11' fill='white'>{_e(_clip(where, 19))}</text></g>")


def _site_table(sites: List[Dict[str, Any]]) -> str:
    rows = []
    for s in sites:
        status = (f"fused ({s['mode']})" if s["mode"] else "fused") if s["fused"] else "left unfused"
        traffic = f"{_bytes(s['bytes_before'])} &rarr; {_bytes(s['bytes_after'])}" if s["fused"] else ""
        rows.append(f"<tr class='{'fused' if s['fused'] else 'missed'}'><td>{_e(s['layer'])}</td>"
                    f"<td>{_e(s.get('module') or '?')}</td><td title='{_e(s['op'])}'>{_e(SHORT.get(s['op'], s['op']))}"
                    f"</td><td>{_e(status)}</td><td>{_e(s['reason'])}</td><td class='n'>{traffic}</td></tr>")
    return ("<table><tr><th>layer</th><th>module</th><th>op</th><th>result</th><th>reason</th>"
            f"<th>modelled traffic</th></tr>{''.join(rows)}</table>")


def _op_bars(counts: Dict[str, Any]) -> str:
    """All nodes, then the ops whose count changed most, as before/after bar pairs."""
    names = set(counts["before"]) | set(counts["after"])
    changed = sorted((n for n in names if counts["before"].get(n, 0) != counts["after"].get(n, 0)),
                     key=lambda n: (-abs(counts["before"].get(n, 0) - counts["after"].get(n, 0)), n))[:8]
    rows = [("all nodes", counts["nodes_before"], counts["nodes_after"])]
    rows += [(n.replace(".default", "").replace("aten.", ""), counts["before"].get(n, 0), counts["after"].get(n, 0))
             for n in changed]
    return _bar_chart(rows, ("before", "after"), (BEFORE, AFTER), str)


def _traffic_bars(r: Dict[str, Any], train: bool = True) -> str:
    rows = [(op, t["bytes_before"], t["bytes_after"], t["bytes_minimum"]) for op, t in r["memory_traffic"].items()]
    traffic = (_bar_chart(rows, ("unfused subgraph", "after the pass", "fused-op minimum"),
                          (BEFORE, AFTER, MINIMUM), _bytes) if rows else "<p>no site was fused</p>")
    saved = r.get("saved_activations") or {}
    if not train:  # an inference step saves nothing for a backward
        return traffic
    if not saved.get("graphs"):
        return traffic + "<p>saved for the backward: unchanged (no site fused)</p>"
    return traffic + _bar_chart([("saved for the backward", saved["bytes_before"], saved["bytes_after"])],
                                ("before the pass", "after"), (BEFORE, AFTER), _bytes)


def _bar_chart(rows: List[tuple], series: Tuple[str, ...], colours: Tuple[str, ...], fmt) -> str:
    """Horizontal bars, one group per row, each row's values scaled to the chart's largest."""
    label_w, bar_max, bar_h = 130, 220, 12
    top = max((v for row in rows for v in row[1:]), default=0) or 1
    group_h = bar_h * len(series) + 6
    height = len(rows) * group_h + 24
    parts = [f"<svg width='{label_w + bar_max + 80}' height='{height}'>"]
    for i, row in enumerate(rows):
        y = i * group_h
        parts.append(f"<text x='0' y='{y + bar_h}' font-size='12'>{_e(_clip(row[0], 22))}</text>")
        for j, value in enumerate(row[1:]):
            w = max(1, round(bar_max * value / top))
            parts.append(f"<rect x='{label_w}' y='{y + j * bar_h}' width='{w}' height='{bar_h - 2}' "
                         f"fill='{colours[j]}'><title>{_e(series[j])}: {_e(fmt(value))}</title></rect>"
                         f"<text x='{label_w + w + 4}' y='{y + j * bar_h + 10}' font-size='10'>{_e(fmt(value))}</text>")
    x, y = 0, len(rows) * group_h + 14
    for name, colour in zip(series, colours):
        parts.append(f"<rect x='{x}' y='{y - 10}' width='12' height='12' fill='{colour}'/>"
                     f"<text x='{x + 16}' y='{y}' font-size='12'>{_e(name)}</text>")
        x += 24 + 7 * len(name)
    return "".join(parts) + "</svg>"


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _clip(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "\u2026"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)
