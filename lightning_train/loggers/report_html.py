"""The report's HTML page: one self-contained file, the plots embedded (see ``report.py``)."""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

LEVEL_COLORS = {"INFO": "tab:blue", "WARN": "tab:orange", "ERROR": "tab:red"}


def render_html(result: dict[str, Any], facts: dict[str, str], alerts: list[dict[str, Any]],
                out: Path) -> str:
    """The page: ``result`` (what report.json holds), the summary ``facts``, the run's ``alerts``; the
    PNGs in ``out`` are embedded."""
    esc = html.escape
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in facts.items())
    launch_rows = "".join(_launch_row(facts) for facts in result["launches"])
    figures = ""
    for plot in result["plots"].values():
        image = base64.b64encode((out / plot["file"]).read_bytes()).decode()
        caption = plot.get("note") or ", ".join(f"{name} ({n} points)" for name, n in plot["series"].items())
        figures += (f'<figure><img alt="{esc(plot["title"])}" src="data:image/png;base64,{image}">'
                    f'<figcaption>{esc(plot["title"])}: {esc(caption)}</figcaption></figure>\n')
    notes = "".join(f"<li>{esc(note)}</li>" for note in result["notes"])
    alert_rows = "".join(
        f'<tr><td>{a["step"]}</td><td style="color:{_css_color(a["level"])}">'
        f'{esc(a["level"])}</td><td>{esc(a["title"])}</td><td>{esc(a["text"])}</td></tr>'
        for a in alerts
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Run report: {esc(result["run_dir"])}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222; }}
table {{ border-collapse: collapse; margin: 1em 0; }}
th, td {{ padding: 4px 10px; border-bottom: 1px solid #ddd; text-align: left; }}
figure {{ margin: 2em 0; }} img {{ max-width: 100%; }} figcaption {{ color: #555; }}
.notes {{ background: #fff8e1; padding: 0.6em 2em; }} .other {{ color: #777; }}
</style></head><body>
<h1>Run report</h1><p><code>{esc(result["run_dir"])}</code></p>
<section id="summary"><h2>Summary</h2><table>{rows}</table></section>
<section id="launches"><h2>Launches in this folder</h2>
<p>This report shows one run: {esc(" → ".join(result["run"]))}. Other launches are listed, not plotted.</p>
<table><tr><th>launch</th><th>kind</th><th>steps</th><th>resumed from</th><th>role</th></tr>
{launch_rows}</table></section>
<section id="plots"><h2>Plots</h2>
{figures}</section>
{f'<section id="not-shown" class="notes"><h2>Not shown</h2><ul>{notes}</ul></section>' if notes else ""}
<section id="alerts"><h2>Alerts</h2>
{f"<table><tr><th>step</th><th>level</th><th>title</th><th>text</th></tr>{alert_rows}</table>"
 if alerts else "<p>No alerts.</p>"}
</section>
</body></html>
"""


def _launch_row(facts: dict[str, Any]) -> str:
    esc = html.escape
    steps = "–".join(str(step) for step in dict.fromkeys(facts.get("steps", []))) or "none"
    role = facts["role"]
    if role == "another run":
        role += f" (report it with --launch {facts['name']})"
    if "metrics" in facts:
        role += ": " + ", ".join(f"{name} {value:.4f}" for name, value in facts["metrics"].items())
    style = "" if facts["role"] == "this run" else ' class="other"'
    origin = facts.get("resumed_from")  # a launch of this folder; else the checkpoint as typed
    origin = facts.get("ckpt_path") if origin in (None, "elsewhere") else origin
    return (f"<tr{style}><td>{esc(facts['name'])}</td><td>{esc(facts['kind'])}</td><td>{esc(steps)}</td>"
            f"<td>{esc(str(origin or ''))}</td><td>{esc(role)}</td></tr>\n")


def _css_color(level: str) -> str:
    return LEVEL_COLORS.get(level, "gray").removeprefix("tab:")
