"""`llmd-supervisor report`: the HTML file, its charts' points, and the page as headless
Chromium renders it (no network: the file must need none).

Chromium and matplotlib are required here, never skipped: deploy/install-dev.sh installs
both (Debian's `chromium`, the package's `report` extra).
"""

from __future__ import annotations

import contextlib
import html.parser
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from llmd_supervisor.cli.main import main
from llmd_supervisor.cli.report import INSTALL_HINT, PALETTE, build_charts, render_report
from llmd_supervisor.cli.results import read_run_results
from tests.unit.test_results_cli import CONCURRENCIES, samples

CHARTS = (
    "tput-vs-interactivity",
    "total-tput-vs-interactivity",
    "ttft-vs-concurrency",
    "tpot-vs-concurrency",
)
PLOTTED_RUNS = ("3f2a9c01aa", "7c1d0e02bb")  # the third sample failed without results
CHROMIUM_TIMEOUT_S = 120
CHROMIUM_FLAGS = (
    "--headless",
    "--disable-gpu",
    "--no-sandbox",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--mute-audio",
    # Nothing may be fetched: any request goes to a proxy that is not there.
    "--proxy-server=http://127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
)


class _Points(html.parser.HTMLParser):
    """The plotted points (`class="point"` groups) and every src/href of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.points: list[dict[str, str]] = []
        self.links: list[str] = []
        self.tags: Counter[str] = Counter()
        self._open: list[int | None] = []  # per open <g>: the point it is (inside), if any

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags[tag] += 1
        self.links += [v for k, v in a.items() if k in ("src", "href", "xlink:href")]
        inside = self._open[-1] if self._open else None
        if tag == "g":
            if a.get("class") == "point":
                inside = len(self.points)
                self.points.append(a | {"markers": "0"})
            self._open.append(inside)
        elif tag == "use" and inside is not None:  # a drawn marker, placed at x, y
            assert float(a["x"]) >= 0 and float(a["y"]) >= 0
            self.points[inside]["markers"] = str(int(self.points[inside]["markers"]) + 1)

    def handle_endtag(self, tag: str) -> None:
        if tag == "g" and self._open:
            self._open.pop()


def _parse(text: str) -> _Points:
    parser = _Points()
    parser.feed(text)
    return parser


def _plotted(points: list[dict[str, str]]) -> Counter[tuple[str, str, int]]:
    return Counter((p["data-chart"], p["data-run"], int(p["data-concurrency"])) for p in points)


# The per-GPU chart holds the run whose GPU count is known, the others every run.
EXPECTED = Counter(
    (c, r, n)
    for c in CHARTS
    for r in (PLOTTED_RUNS[:1] if c == CHARTS[0] else PLOTTED_RUNS)
    for n in CONCURRENCIES
)


@pytest.fixture(scope="module")
def report_html() -> str:
    return render_report(samples(), generated_at="2026-01-01 00:00:00 UTC")


def test_charts_plot_every_run_and_concurrency_once(report_html: str) -> None:
    page = _parse(report_html)
    assert _plotted(page.points) == EXPECTED
    # Each point group holds its drawn marker (matplotlib: one <use> of the marker path).
    assert all(p["markers"] == "1" for p in page.points)
    c64 = next(
        p
        for p in page.points
        if p["data-chart"] == CHARTS[0] and p["data-run"] == PLOTTED_RUNS[0]
        if p["data-concurrency"] == "64"
    )
    assert float(c64["data-x"]) == pytest.approx(1000 / 16.0)  # interactivity
    assert float(c64["data-y"]) == pytest.approx(48000.0 / 8)  # total tok/s per GPU
    total = next(
        p
        for p in page.points
        if p["data-chart"] == CHARTS[1] and p["data-run"] == PLOTTED_RUNS[1]
        if p["data-concurrency"] == "64"
    )
    assert float(total["data-y"]) == pytest.approx(44000.0)  # total tok/s, all GPUs
    ttft = [p for p in page.points if p["data-chart"] == CHARTS[2]]
    assert {float(p["data-y"]) for p in ttft} >= {40.0, 90.0, 310.0}


def test_the_report_is_self_contained(report_html: str) -> None:
    page = _parse(report_html)
    assert page.tags["script"] == 0 and page.tags["img"] == 0 and page.tags["link"] == 0
    assert all(link.startswith(("#", "data:")) for link in page.links), page.links
    assert "url(http" not in report_html and "@import" not in report_html
    assert page.tags["svg"] == 4


def test_verdicts_and_evidence_are_shown(report_html: str) -> None:
    assert "marker rc=7 from rank 2" in report_html
    assert "No results: its archive holds no results table (the run failed" in report_html
    assert "vllm client, 8 GPUs, 3 points" in report_html
    assert "inferencex client, GPU count unknown, 3 points" in report_html
    assert "Not plotted: run 9e4b7a03cc" in report_html
    # The evidence table: 3 points a run with results, one row each.
    assert len(re.findall(r'<tr class="valid">', report_html)) == 6
    assert "6,000" in report_html  # 48000 tok/s on 8 GPUs


def test_no_axis_mixes_totals_with_per_gpu_values() -> None:
    """A run without a GPU count is left out of the per-GPU chart, with the reason, and
    plotted in the total-throughput chart; no label hedges between the two."""
    runs = samples()
    per_gpu, total = build_charts(runs)[:2]
    assert per_gpu.ylabel == "total tok/s per GPU" and total.ylabel == "total tok/s (all GPUs)"
    assert [s.run for s in per_gpu.series] == ["3f2a9c01aa"]
    assert [s.run for s in total.series] == ["3f2a9c01aa", "7c1d0e02bb"]
    assert any(
        why.startswith("run 7c1d0e02bb: its GPU count is unknown") for why in per_gpu.left_out
    )
    for chart in build_charts(runs[:1]) + build_charts(runs[1:]):
        assert "†" not in chart.ylabel and "unknown" not in chart.ylabel
        assert all(s.label == s.run for s in chart.series)
    # One run, one colour, in every chart it is in.
    assert total.series[0].color == per_gpu.series[0].color == PALETTE[0]
    text = render_report(runs, generated_at="now")
    assert "Not plotted: run 7c1d0e02bb: its GPU count is unknown" in text


def test_nothing_to_plot_is_said_not_drawn() -> None:
    text = render_report(samples()[2:], generated_at="now")
    assert _parse(text).tags["svg"] == 0
    assert "Throughput per GPU against interactivity: nothing to plot." in text


def test_an_invalid_point_is_not_plotted() -> None:
    from tests.unit.test_results_cli import run_8gpu

    r = run_8gpu()
    r["results"]["points"][1] |= {"valid": False, "problem": "no such file"}  # type: ignore[index]
    page = _parse(render_report([read_run_results(r)], generated_at="now"))
    assert sorted({int(p["data-concurrency"]) for p in page.points}) == [1, 64]


def test_without_matplotlib_one_line_and_exit_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    out = tmp_path / "report.html"
    assert main(["report", "r1", "-o", str(out), "--socket", str(tmp_path / "s")]) == 2
    assert capsys.readouterr().err == INSTALL_HINT + "\n"
    assert not out.exists()


def test_no_daemon_is_one_line_and_exit_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.html"
    assert main(["report", "r1", "-o", str(out), "--socket", str(tmp_path / "s")]) == 3
    err = capsys.readouterr().err
    assert err.startswith("llmd-supervisor report: ") and err.count("\n") == 1
    assert not out.exists()


# --- in a browser -------------------------------------------------------------------------


def _distance(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _chromium(tmp_path: Path, *args: str) -> str:
    """Run headless Chromium on its own profile; its stdout. Killed by its process group
    (its id is Chromium's pid) when it is late and afterwards, for any helper left."""
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail(
            "chromium is not installed, and the report test renders the page with it: run "
            "deploy/install-dev.sh (or apt-get install -y chromium)."
        )
    argv = [exe, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}", *args]
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    try:
        out, err = proc.communicate(timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s: {argv}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out.decode(errors="replace")


def test_chromium_renders_the_report_with_its_points(tmp_path: Path, report_html: str) -> None:
    import matplotlib.image

    page = tmp_path / "report.html"
    page.write_text(report_html, encoding="utf-8")
    url = page.as_uri()

    # The DOM Chromium built from the file holds every plotted point.
    dom = _chromium(tmp_path, "--dump-dom", url)
    assert _plotted(_parse(dom).points) == EXPECTED

    shot = tmp_path / "out.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,2000", url)
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2000, 1200)
    rgb = (pixels[..., :3] * 255).round().astype(int)
    colours = Counter(map(tuple, rgb.reshape(-1, 3).tolist()))
    assert len(colours) > 50, "the screenshot is (nearly) blank"
    white = colours.get((255, 255, 255), 0)
    assert white < 0.97 * rgb.shape[0] * rgb.shape[1], "the screenshot is (nearly) all white"
    # Each plotted run's colour was painted (its lines and markers).
    for colour in PALETTE[: len(PLOTTED_RUNS)]:
        want = tuple(int(colour[i : i + 2], 16) for i in (1, 3, 5))
        near = sum(
            n
            for c, n in colours.items()
            if max(abs(a - b) for a, b in zip(c, want, strict=True)) <= 8
        )
        assert near > 200, f"hardly any pixel of the colour {colour} in the screenshot"


def test_each_run_is_titled_with_model_topology_and_lengths_in_the_browser(
    tmp_path: Path,
) -> None:
    """The page Chromium renders names each run by its model, its xPyD topology with the
    GPUs of each role, ISL/OSL and its end; throughput axes start at zero; every chart has
    the table of its points below it."""
    from llmd_supervisor.core.spec.recipe import deployment_of
    from llmd_supervisor.core.spec.runspec import load_spec
    from tests.daemon_helpers import demo_spec

    runs = samples()
    table = runs[0]["results"]
    assert table is not None
    deployment = deployment_of(load_spec(demo_spec(tmp_path / "logs")))
    runs[0] = runs[0] | {
        "results": table | {"deployment": deployment},
        "finished_at": "2026-12-03T08:13:58+00:00",
    }
    want = (
        f"{deployment['model']} · {deployment['prefill_num_workers']}P"
        f"{deployment['decode_num_workers']}D, {deployment['num_prefill_gpu']}+"
        f"{deployment['num_decode_gpu']} GPUs · ISL {deployment['isl']} / OSL"
        f" {deployment['osl']} · ended 2026-12-03 08:13 UTC"
    )
    page = tmp_path / "report.html"
    page.write_text(render_report(runs, generated_at="now"), encoding="utf-8")
    dom = _chromium(tmp_path, "--dump-dom", page.as_uri())
    assert f'<p class="title">{html.escape(want)}</p>' in dom
    assert dom.count('<table class="points">') == len([c for c in build_charts(runs) if c.series])
    charts = {c.chart_id: c for c in build_charts(runs)}
    assert charts["tput-vs-interactivity"].zero_y and charts["total-tput-vs-interactivity"].zero_y
    assert not charts["ttft-vs-concurrency"].zero_y
