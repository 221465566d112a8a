"""The page (edge_core/page): the plan drawn from its document, without an engine or a browser.

Plans come from the real planner against captured device lists
(tests/data/devices-*.json, no backend loaded), so every figure checked here
is the plan document's own: a segment's width is its term's bytes over the
capacity, the rows' totals are the budget's load path, steady state and
headroom (edge_core/budget.py's rule, recomputed here from the terms).
"""

from __future__ import annotations

import html
import json
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from factories import KNOWN_CONFIGS, llama_like_tensors, write_checkpoint

from edge_core.artifact import DEMO_MODEL
from edge_core.cli import main
from edge_core.page import live_page, plan_page, plan_section

DATA = Path(__file__).parent / "data"
MIB = 1 << 20


@pytest.fixture(autouse=True)
def _no_backends(monkeypatch):
    monkeypatch.setenv("EDGE_PLUGINS", "none-installed")


def plan_document(capsys, *args: str) -> tuple[int, dict]:
    code = main(["plan", "--json", *args])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def demo_plan(capsys) -> dict:
    code, doc = plan_document(capsys, "--model", str(DEMO_MODEL), "--devices", str(DATA / "devices-h100.json"))
    assert code == 0, doc["refusals"]
    return doc


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory) -> Path:
    config = dict(KNOWN_CONFIGS["meta-llama/Llama-3.1-8B"])
    return write_checkpoint(tmp_path_factory.mktemp("page") / "l8", config, llama_like_tensors(config), shards=2)


class Segments(HTMLParser):
    """Each bar row's segments: (row label, figure caption, css classes, width %)."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[list[tuple[str, float]]] = []
        self.marks: list[tuple[str, float]] = []
        self._in_label = False
        self.labels: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        attr = dict(attrs)
        classes = (attr.get("class") or "").split()
        if "track" in classes:
            self.rows.append([])
        elif "seg" in classes:
            self.rows[-1].append((" ".join(classes), width_of(attr["style"])))
        elif "mark" in classes:
            self.marks.append((classes[1], float(re.search(r"left:([\d.]+)%", attr["style"]).group(1))))
        elif "rl" in classes:
            self._in_label = True

    def handle_data(self, data: str) -> None:
        if self._in_label:
            self.labels.append(data)
            self._in_label = False


def width_of(style: str) -> float:
    return float(re.search(r"width:([\d.]+)%", style).group(1))


def budget_rows(terms: list[dict]) -> dict[str, int]:
    """The budget's three totals from its terms (the rule in edge_core/budget.py, written out again)."""
    load = steady = headroom = 0
    for t in terms:
        if t["headroom"]:
            headroom += t["bytes"]
        elif t["lifetime"] == "load":
            load += t["bytes"]
        else:
            steady += t["bytes"]
            if t["lifetime"] == "session_weights" or t["held_during_load"]:
                load += t["bytes"]
    return {"steady": steady, "load": load, "headroom": headroom}


def test_every_term_is_a_segment_as_wide_as_its_share_of_capacity(demo_plan):
    parsed = Segments()
    parsed.feed(plan_section(demo_plan))
    capacity = demo_plan["capacity_bytes"]
    terms = demo_plan["reservations"]
    # Two figures (against capacity, enlarged) of three rows each.
    assert len(parsed.rows) == 6 and parsed.labels[:3] == ["steady state", "load path", "admission"]
    steady, load, admission = parsed.rows[:3]
    expected_steady = [t for t in terms if not t["headroom"] and t["lifetime"] != "load" and t["bytes"]]
    assert len(steady) == len(expected_steady)
    for (_, width), term in zip(steady, expected_steady):
        assert width == pytest.approx(100 * term["bytes"] / capacity, abs=1e-3)
    totals = budget_rows(terms)
    assert sum(w for _, w in steady) == pytest.approx(100 * totals["steady"] / capacity, abs=0.01)
    assert sum(w for _, w in load) == pytest.approx(100 * totals["load"] / capacity, abs=0.01)
    # The admission row: the held peak as one block, then each headroom term.
    held = demo_plan["peak"]["held_peak_bytes"]
    assert "predicted" in admission[0][0]
    assert admission[0][1] == pytest.approx(100 * held / capacity, abs=1e-3)
    assert sum(w for _, w in admission) == pytest.approx(100 * demo_plan["admission_bytes"] / capacity, abs=0.01)
    assert totals["headroom"] == demo_plan["peak"]["headroom_bytes"]
    # The demo's file pages (a 2 MiB mapping) sit under its steady state: the predicted PSS is the held peak,
    # and no third mark is drawn for it.
    assert demo_plan["predicted_peak_bytes"] == held
    marks = dict(parsed.marks[:2])
    assert marks["m-held"] == pytest.approx(100 * held / capacity, abs=1e-3)
    assert marks["m-admit"] == pytest.approx(100 * demo_plan["admission_bytes"] / capacity, abs=1e-3)
    # The enlarged figure's scale is 1.04 x the admission total.
    assert dict(parsed.marks[2:4])["m-admit"] == pytest.approx(100 / 1.04, abs=0.01)


def test_the_table_lists_every_term_with_its_size_in_mib(demo_plan):
    section = plan_section(demo_plan)
    for number, term in enumerate(demo_plan["reservations"], 1):
        assert f">{number}</i></td><td>" in section
        assert f"{term['bytes'] / MIB:,.1f} MiB" in section
        assert term["purpose"] in section
    assert f"{demo_plan['predicted_peak_bytes'] / MIB:,.1f} MiB" in section
    assert f"{demo_plan['capacity_bytes'] / (1 << 30):,.2f} GiB" in section
    assert "ADMITTED" in section and demo_plan["selected_device"] in section


def test_a_parallel_plan_shows_each_rank_per_node_and_a_bar_per_device(capsys, llama8b):
    code, doc = plan_document(capsys, "--model", str(llama8b), "--devices", str(DATA / "devices-2x4090.json"))
    assert code == 0 and doc["parallel"]["tensor_parallel_size"] == 2
    section = plan_section(doc)
    ranks = doc["parallel"]["ranks"]
    assert section.count("<tr><td>local</td>") == len(ranks) == 2
    assert "local: 2 ranks" in section and "Layout: TP 2" in section
    for device in doc["parallel"]["devices"]:
        assert f"Memory on {device['device_id']}" in section
    parsed = Segments()
    parsed.feed(section)
    assert len(parsed.rows) == 6 * len(doc["parallel"]["devices"])
    for rank in ranks:
        assert f"{rank['kv_cache_bytes'] / MIB:,.1f} MiB" in section


def test_a_refused_plan_shows_each_refusal_with_its_remedy_and_no_bar(capsys, llama8b):
    code, doc = plan_document(capsys, "--model", str(llama8b), "--devices", str(DATA / "devices-h100.json"),
                              "--kv-cache-memory", "200GiB")
    assert code == 2 and doc["refusals"]
    section = plan_section(doc)
    assert "REFUSED" in section and 'class="track"' not in section
    for refusal in doc["refusals"]:
        assert f"[{refusal['code']}]" in section
        assert html.escape(refusal["remedy"], quote=True) in section


def test_the_pages_are_self_contained_and_small(demo_plan):
    for page in (plan_page(demo_plan), live_page(demo_plan)):
        assert len(page.encode()) < 40_000
        # Nothing is fetched: no link, no src, no url() in the style, no scheme anywhere in the markup.
        assert not re.search(r"<link|\bsrc=|url\(|@import|https?://(?!www\.w3\.org/2000/svg)", page)
        assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")


def test_the_live_page_draws_the_plan_with_the_same_section_as_the_static_one(demo_plan):
    assert plan_section(demo_plan) in live_page(demo_plan)
    assert plan_section(demo_plan) in plan_page(demo_plan)
    live = live_page(demo_plan)
    assert 'id="chart"' in live and "/edge/memory" in live and "vllm:num_requests_running" in live
    assert 'id="chart"' not in plan_page(demo_plan)
    data = json.loads(re.search(r"data-plan='([^']*)'", live).group(1).replace("&quot;", '"'))
    assert data == {"predicted": demo_plan["predicted_peak_bytes"], "admission": demo_plan["admission_bytes"],
                    "capacity": demo_plan["capacity_bytes"], "kv_pool": demo_plan["kv"]["pool"]["bytes"],
                    "kv_sequences": demo_plan["kv"]["pool"]["full_length_sequences"]}
    assert "vllm:kv_cache_usage_perc" in live and 'id="m-kv"' in live


def test_text_from_the_plan_is_escaped(demo_plan):
    doc = dict(demo_plan, model_path="/m/<script>alert(1)</script>",
               manifest=dict(demo_plan["manifest"], path="/m/<script>alert(1)</script>"))
    page = plan_page(doc)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page


def test_edge_plan_html_writes_the_plan_page_of_the_json_document(capsys, tmp_path):
    target = tmp_path / "plan.html"
    code = main(["plan", "--json", "--html", str(target), "--model", str(DEMO_MODEL),
                 "--devices", str(DATA / "devices-h100.json")])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    assert target.read_text(encoding="utf-8") == plan_page(doc)


def test_edge_plan_html_to_an_unwritable_place_is_a_usage_error(capsys, tmp_path):
    code = main(["plan", "--html", str(tmp_path / "missing" / "plan.html"), "--model", str(DEMO_MODEL),
                 "--devices", str(DATA / "devices-h100.json")])
    assert code == 64
    assert "cannot write the page" in capsys.readouterr().err
