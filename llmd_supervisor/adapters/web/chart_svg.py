"""Charts as inline SVG, drawn by matplotlib (an optional dependency: the ``report``
extra). The chart models are `core.results.report_html`'s; this draws one."""

from __future__ import annotations

import html
import importlib.util
import io

from llmd_supervisor.core.results.report_html import Chart

__all__ = ["chart_svg", "have_matplotlib"]


def have_matplotlib() -> bool:
    """Whether matplotlib is installed (charts are drawn only then); found, not imported:
    its import takes a second, which `chart_svg` spends in its caller's thread."""
    return importlib.util.find_spec("matplotlib") is not None


def chart_svg(chart: Chart) -> str:
    """`chart` as an inline `<svg>` element; each point a group with its data attributes."""
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no GUI backend is ever chosen

    attrs: dict[str, str] = {}
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": chart.chart_id}):
        fig = Figure(figsize=(8.0, 4.5), layout="constrained")
        ax = fig.add_subplot()
        for n, s in enumerate(chart.series):
            xs = [p[0] for p in s.points]
            ys = [p[1] for p in s.points]
            ax.plot(xs, ys, "-", color=s.color, linewidth=1.5, label=s.label)
            for i, (x, y, conc) in enumerate(s.points):
                gid = f"{chart.chart_id}-s{n}-p{i}"
                ax.plot([x], [y], "o", markersize=6, color=s.color, gid=gid)
                ax.annotate(
                    f"c{conc}", (x, y), textcoords="offset points", xytext=(4, 5), fontsize=7
                )
                attrs[gid] = (
                    f'class="point" data-chart="{chart.chart_id}" '
                    f'data-run="{html.escape(s.run, quote=True)}" data-concurrency="{conc}" '
                    f'data-x="{x:.6g}" data-y="{y:.6g}"'
                )
        if chart.log_x:
            ax.set_xscale("log", base=2)
            ticks = sorted({p[0] for s in chart.series for p in s.points})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        if chart.zero_y:
            ax.set_ylim(bottom=0)
        ax.set_title(chart.title)
        ax.set_xlabel(chart.xlabel)
        ax.set_ylabel(chart.ylabel)
        ax.grid(True, alpha=0.3)
        if chart.series:
            ax.legend(fontsize=8)
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]
    for gid, extra in attrs.items():
        tag = f'<g id="{gid}">'
        if svg.count(tag) != 1:
            raise RuntimeError(f"matplotlib's SVG has {svg.count(tag)} groups {gid!r}, not one")
        svg = svg.replace(tag, f'<g id="{gid}" {extra}>')
    return svg
