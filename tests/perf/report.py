"""The benchmark report: JSON (everything) and Markdown (the table and the context)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    code = report["code"]
    lines = [
        f"# llmd-supervisor benchmarks ({report['mode']} mode, {report['started_at']})",
        "",
        f"- machine: {m['cores']} cores ({m['cpu_model']}), {m['memory_gb']} GB, "
        f"load {m['loadavg']} at start, {report.get('machine_after', {}).get('loadavg')} at end",
        f"- code: HEAD {code['head'][:10]} ({code['head_subject']}); poller.py sha256 "
        f"{code['poller_sha256']}; uncommitted in llmd_supervisor/: "
        + (", ".join(code["uncommitted"]) or "none"),
        f"- took {report.get('seconds')} s; the dev cluster is shared with other sessions "
        "(root); the harness's Slurm traffic runs as `nobody`, and the RPC rows are sdiag's "
        "per-user counts for `nobody`",
        "",
        "| metric | project | baseline | unit | baseline/project | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, result in report["measurements"].items():
        for row in result.get("rows", []):
            lines.append(
                f"| {row['metric']} | {_fmt(row['project'])} | {_fmt(row['baseline'])} | "
                f"{row['unit']} | {_fmt(row['ratio'])} | {row['target']} | {_fmt(row['met'])} |"
            )
        del name
    details = [
        f"- **{row['metric']}**: {row['detail']}"
        for result in report["measurements"].values()
        for row in result.get("rows", [])
        if row.get("detail")
    ]
    if details:
        lines += ["", "## Details", "", *details]
    end = report["measurements"].get("end")
    if end:
        lines += ["", "End detection phases of the project (s after the last action):", ""]
        for k, v in end["project_phases"].items():
            lines.append(f"- {k}: median {_fmt(v['median'])}, p95 {_fmt(v['p95'])}, n {v['n']}")
    if report.get("notes"):
        lines += ["", "## Notes", "", *[f"- {n}" for n in report["notes"]]]
    if report.get("errors"):
        errors = [f"- {k}: {v}" for k, v in report["errors"].items()]
        lines += ["", "## Harness errors", "", *errors]
    lines += ["", "Raw samples and per-window RPC breakdowns are in the JSON report.", ""]
    return "\n".join(lines)


def write_reports(report: dict[str, Any], out: Path) -> str:
    """Write <out>.json and <out>.md; return the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    md = markdown(report)
    out.with_suffix(".md").write_text(md)
    return md
