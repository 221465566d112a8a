"""The plan as HTML: every reservation stacked against the device's capacity, from a plan document.

One function draws the plan part, :func:`plan_section`, from the ``edge.plan``
document (a dict: what ``--json`` and ``/edge/plan`` answer), so ``edge plan
--html`` and ``edge serve``'s ``/edge/`` show the same picture. The page is
self-contained: its style and script are inlined from the files beside this
module, nothing is fetched from anywhere else.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from importlib import resources
from typing import Any

from ..devices import EVIDENCE_LEGEND

MIB = 1 << 20
GIB = 1 << 30

#: Where ``edge serve`` answers the page.
PAGE_PATH = "/edge/"

#: How many fill patterns the style sheet defines (``.p0`` .. ``.p9``): hatches and dots, so a term is told
#: apart in greyscale by its pattern and its number, not by its colour.
PATTERNS = 10
#: A segment narrower than this share of its bar carries no number (the table still lists it).
LABEL_MIN_PCT = 2.5


def mib(value: int | float | None) -> str:
    """``1,583.2 MiB``: the one way the page writes a size (the live script writes it the same way)."""
    return "–" if value is None else f"{value / MIB:,.1f} MiB"


def gib(value: int | float | None) -> str:
    return "–" if value is None else f"{value / GIB:,.2f} GiB"


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


@cache
def asset(name: str) -> str:
    """The text of a file shipped beside this module (``page.css``, ``live.js``)."""
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


# -- the plan part -------------------------------------------------------------------------------


def plan_section(plan: Mapping[str, Any]) -> str:
    """The plan part of the page: what, where, how it is split, and every term against capacity."""
    admitted = bool(plan.get("admitted"))
    parts = [f'<section id="plan" class="{"admitted" if admitted else "refused"}">',
             f'<h2>Plan <span class="verdict">{"ADMITTED" if admitted else "REFUSED"}</span></h2>',
             facts(plan)]
    parallel = plan.get("parallel") or None
    if parallel:
        parts.append(layout_table(parallel))
    if admitted:
        budgets = device_budgets(plan)
        for budget in budgets:
            parts.append(budget_figure(budget, several=len(budgets) > 1))
    else:
        parts.append(refusal_list(plan.get("refusals") or ()))
    parts.append("</section>")
    return "\n".join(parts)


def facts(plan: Mapping[str, Any]) -> str:
    manifest = plan.get("manifest") or {}
    session = plan.get("session") or {}
    parallel = plan.get("parallel") or {}
    model = manifest.get("path") or plan.get("model_path") or "?"
    what = " · ".join(str(x) for x in (manifest.get("architecture") or manifest.get("model_type"),
                                        manifest.get("weight_format"), manifest.get("dtype")) if x)
    rows = [
        ("model", f"{esc(model)}<br><small>{esc(what)}; weights {mib(manifest.get('weight_bytes'))}</small>"),
        ("device", esc(", ".join(device_ids(plan)) or plan.get("selected_device") or "none")
         + (f" <small>({esc(plan['backend'])})</small>" if plan.get("backend") else "")),
        ("layout", esc(parallel.get("label") or "one device")),
    ]
    if session:
        auto = " <small>(auto: the longest one sequence holds in the pool)</small>" if session.get(
            "max_model_len_auto") else ""
        rows.append(("session", f"up to {session.get('max_num_seqs')} sequence{'' if session.get('max_num_seqs') == 1 else 's'} at once × {session.get('max_model_len'):,} tokens{auto}"
                                f", KV {esc(session.get('kv_dtype'))}, "
                                f"{'eager' if session.get('enforce_eager') else 'compiled'}"))
    pool = (plan.get("kv") or {}).get("pool") or None
    if pool:
        rows.append(("KV pool", f"{mib(pool.get('bytes'))} <small>({esc(pool.get('guarantee'))})</small>"))
    if plan.get("admitted"):
        peak = plan.get("peak") or {}
        rows.append(("held peak", f"{mib(peak.get('held_peak_bytes'))} <small>(what must be held)</small>"))
        rows.append(("predicted peak", f"{mib(plan.get('predicted_peak_bytes'))} <small>(what the tree PSS may "
                                       "read, reclaimable file pages included)</small>"))
        rows.append(("admission", f"{mib(plan.get('admission_bytes'))} <small>(held peak + headroom)</small>"))
        rows.append(("capacity", f"{gib(plan.get('capacity_bytes'))} <small>({mib(plan.get('capacity_bytes'))})"
                                 "</small>"))
    if plan.get("decision_time_s") is not None:
        rows.append(("decided in", f"{plan['decision_time_s'] * 1000:,.0f} ms"))
    body = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    return f'<dl class="facts">{body}</dl>'


def device_ids(plan: Mapping[str, Any]) -> list[str]:
    parallel = plan.get("parallel") or {}
    ids = [d.get("device_id") for d in parallel.get("devices") or () if d.get("device_id")]
    if ids:
        return list(dict.fromkeys(ids))
    return [plan["selected_device"]] if plan.get("selected_device") else []


def layout_table(parallel: Mapping[str, Any]) -> str:
    """Ranks per node (host) and device: which rank holds which layers and how many bytes of weights and KV."""
    rows = []
    for rank in parallel.get("ranks") or ():
        layers = list(rank.get("layers") or ())
        span = f"{layers[0]}–{layers[1] - 1}" if len(layers) == 2 else "all"
        rows.append(f"<tr><td>{esc(rank.get('host', 'local'))}</td><td>{esc(rank.get('device_id'))}</td>"
                    f"<td>{esc(rank.get('rank'))}</td><td>TP {esc(rank.get('tp_rank'))} · PP "
                    f"{esc(rank.get('pp_rank'))}</td><td>{span}</td><td class=n>{mib(rank.get('weight_bytes'))}</td>"
                    f"<td class=n>{mib(rank.get('kv_cache_bytes'))}</td></tr>")
    hosts: dict[str, int] = {}
    for rank in parallel.get("ranks") or ():
        hosts[str(rank.get("host", "local"))] = hosts.get(str(rank.get("host", "local")), 0) + 1
    per_node = ", ".join(f"{esc(h)}: {n} rank{'s' if n != 1 else ''}" for h, n in hosts.items())
    return (f'<h3>Layout: {esc(parallel.get("label"))} <small>({per_node}; executor '
            f'{esc(parallel.get("executor"))})</small></h3>'
            '<div class="scroll"><table class="ranks"><thead><tr><th>node</th><th>device</th><th>rank</th>'
            '<th>group</th><th>layers</th><th class=n>weights</th><th class=n>KV pool</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def device_budgets(plan: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One budget per device the plan uses: its terms, its peak and its capacity."""
    parallel = plan.get("parallel") or {}
    per_device = [d for d in parallel.get("devices") or () if d.get("reservations") and d.get("peak")]
    if per_device:
        return [{"device_id": d.get("device_id"), "host": d.get("host"), "reservations": d["reservations"],
                 "peak": d["peak"], "capacity_bytes": d.get("capacity_bytes")} for d in per_device]
    return [{"device_id": plan.get("selected_device"), "host": None, "reservations": plan.get("reservations") or (),
             "peak": plan.get("peak") or {}, "capacity_bytes": plan.get("capacity_bytes")}]


def rows_of(terms: Sequence[Mapping[str, Any]]) -> dict[str, list[tuple[int, Mapping[str, Any]]]]:
    """The terms (numbered from 1, in plan order) of each row: steady state, load path, headroom.

    The rows follow the budget's rule (edge_core/budget.py): the load path holds the ``load`` terms, the
    weights and what is ``held_during_load``; the steady state every other term; the headroom is kept free.
    Reclaimable terms (file pages) are drawn in their row but marked: admission does not count them.
    """
    rows: dict[str, list[tuple[int, Mapping[str, Any]]]] = {"steady": [], "load": [], "headroom": []}
    for number, term in enumerate(terms, 1):
        if term.get("headroom"):
            rows["headroom"].append((number, term))
            continue
        if term.get("lifetime") == "load":
            rows["load"].append((number, term))
            continue
        rows["steady"].append((number, term))
        if term.get("lifetime") == "session_weights" or term.get("held_during_load"):
            rows["load"].append((number, term))
    return rows


def pct(part: float, whole: float) -> float:
    return 0.0 if whole <= 0 else max(0.0, min(100.0, 100.0 * part / whole))


def segment(number: int, term: Mapping[str, Any], scale: float) -> str:
    width = pct(int(term.get("bytes") or 0), scale)
    if width <= 0:
        return ""
    label = f"<span>{number}</span>" if width >= LABEL_MIN_PCT else ""
    reclaimable = bool(term.get("reclaimable"))
    title = (f"{number}. {term.get('purpose')}: {mib(term.get('bytes'))}"
             + (" (reclaimable file pages: not admitted against)" if reclaimable else ""))
    return (f'<i class="seg p{(number - 1) % PATTERNS}{" reclaim" if reclaimable else ""}" '
            f'style="width:{width:.3f}%" title="{esc(title)}">{label}</i>')


def bar_row(label: str, total: int, segments: Iterable[str]) -> str:
    return (f'<div class="row"><div class="rl">{label}<br><b>{mib(total)}</b></div>'
            f'<div class="track">{"".join(segments)}</div></div>')


def marker(cls: str, label: str, at: int, scale: float) -> str:
    where = pct(at, scale)
    flip = " flip" if where > 60 else ""  # the label on the line's left, so it stays inside the plot
    return f'<div class="mark {cls}{flip}" style="left:{where:.3f}%"><span>{label}</span></div>'


def bars(budget: Mapping[str, Any], scale: int, caption: str) -> str:
    """The three rows (steady state, load path, admission) on one scale, with the peak and admission marked."""
    terms = list(budget["reservations"])
    peak = budget["peak"]
    rows = rows_of(terms)
    predicted = int(peak.get("predicted_peak_bytes") or 0)
    held = int(peak.get("held_peak_bytes", predicted) or 0)
    admission = int(peak.get("admission_bytes") or 0)
    held_block = (f'<i class="seg predicted" style="width:{pct(held, scale):.3f}%" '
                  f'title="held peak: {mib(held)}"><span>held</span></i>')
    body = [
        bar_row("steady state", int(peak.get("steady_state_bytes") or 0),
                (segment(n, t, scale) for n, t in rows["steady"])),
        bar_row("load path", int(peak.get("load_path_bytes") or 0), (segment(n, t, scale) for n, t in rows["load"])),
        bar_row("admission", admission, [held_block, *(segment(n, t, scale) for n, t in rows["headroom"])]),
    ]
    marks = [marker("m-admit", f"admission {mib(admission)}", admission, scale)]
    if predicted != held:
        marks.insert(0, marker("m-peak", f"predicted PSS {mib(predicted)}", predicted, scale))
    marks.insert(0, marker("m-held", f"held peak {mib(held)}", held, scale))
    return (f'<figure class="bars"><figcaption>{caption}</figcaption>'
            f'<div class="plot">{"".join(body)}<div class="marks">{"".join(marks)}</div></div></figure>')


def budget_figure(budget: Mapping[str, Any], *, several: bool) -> str:
    """A device's terms against its capacity, the same terms enlarged to the admission total, and the table."""
    capacity = int(budget.get("capacity_bytes") or 0)
    peak = budget["peak"]
    admission = int(peak.get("admission_bytes") or 0)
    where = esc(budget.get("device_id"))
    if several and budget.get("host"):
        where += f" on {esc(budget['host'])}"
    free = capacity - admission
    head = (f'<h3>Memory on {where} <small>capacity {gib(capacity)}; admission uses {pct(admission, capacity):.1f}%'
            f", {mib(free)} free beyond it</small></h3>")
    whole = bars(budget, capacity, f"against the capacity, 0 – {gib(capacity)}")
    enlarged = bars(budget, max(int(admission * 1.04), 1), f"enlarged, 0 – {mib(admission)} (the admission total)")
    return f'<div class="budget">{head}{whole}{enlarged}{terms_table(budget["reservations"], capacity)}</div>'


def terms_table(terms: Sequence[Mapping[str, Any]], capacity: int) -> str:
    rows = []
    for number, term in enumerate(terms, 1):
        kind = ("headroom" if term.get("headroom") else
                f"{term.get('lifetime')}, reclaimable (file pages)" if term.get("reclaimable") else term.get("lifetime"))
        note = term.get("note") or ""
        name = (f"<details><summary>{esc(term.get('purpose'))}</summary><small>{esc(note)}</small></details>"
                if note else esc(term.get("purpose")))
        rows.append(f'<tr><td><i class="sw p{(number - 1) % PATTERNS}">{number}</i></td><td>{name}</td>'
                    f"<td class=n>{mib(term.get('bytes'))}</td><td class=n>{pct(int(term.get('bytes') or 0), capacity):.2f}%"
                    f"</td><td>{esc(kind)}</td><td>{esc(term.get('evidence'))}</td></tr>")
    return ('<div class="scroll"><table class="terms"><thead><tr><th>#</th><th>term</th><th class=n>size</th>'
            '<th class=n>of capacity</th><th>held</th>'
            f'<th title="{esc(EVIDENCE_LEGEND)}">evidence</th></tr></thead>'
            f'<tbody>{"".join(rows)}</tbody></table></div>')


def refusal_list(refusals: Iterable[Mapping[str, Any]]) -> str:
    items = "".join(f"<li><b>[{esc(r.get('code'))}]</b> {esc(r.get('device_id') or '')}: {esc(r.get('message'))}"
                    f"<br><small>remedy: {esc(r.get('remedy'))}</small></li>" for r in refusals)
    return f'<ul class="refusals">{items}</ul>'


# -- the pages -----------------------------------------------------------------------------------


def page(title: str, body: str, script: str = "") -> str:
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{esc(title)}</title><style>{asset('page.css')}</style></head>\n<body>\n{body}\n"
            + (f"<script>{script}</script>\n" if script else "") + "</body></html>\n")


def title_of(plan: Mapping[str, Any]) -> str:
    manifest = plan.get("manifest") or {}
    name = str(manifest.get("path") or plan.get("model_path") or "model").rstrip("/").rsplit("/", 1)[-1]
    return f"edge · {name} on {', '.join(device_ids(plan)) or 'no device'}"


def plan_page(plan: Mapping[str, Any]) -> str:
    """The static page ``edge plan --html`` writes: the plan part alone."""
    header = f"<header><h1>{esc(title_of(plan))}</h1><p>the plan, before anything is loaded</p></header>"
    return page(title_of(plan), f"{header}\n{plan_section(plan)}")


def live_section(plan: Mapping[str, Any]) -> str:
    peak = plan.get("peak") or {}
    pool = (plan.get("kv") or {}).get("pool") or {}
    data = {"predicted": peak.get("predicted_peak_bytes"), "admission": peak.get("admission_bytes"),
            "capacity": plan.get("capacity_bytes"), "kv_pool": pool.get("bytes"),
            "kv_sequences": pool.get("full_length_sequences")}
    figures = [("m-current", "measured now"), ("m-peak", "measured peak"), ("m-predicted", "predicted peak"),
               ("m-ratio", "predicted ÷ measured"), ("m-exceeded", "samples over prediction"),
               ("m-running", "requests running"), ("m-waiting", "requests waiting"),
               ("m-kv", "KV pool in use"), ("m-tps", "generated tokens/s")]
    cells = "".join(f'<div><span class="k">{label}</span><span class="v" id="{key}">–</span></div>'
                    for key, label in figures)
    ranks = (' <span class="l-rank"></span> each rank\'s worker' if (plan.get("parallel") or {}).get("ranks")
             else "")
    return (f"<section id=\"live\" data-plan='{esc(json.dumps(data))}'>"
            '<h2>Live memory <small id="counter"></small></h2>'
            f'<div class="figures">{cells}</div>'
            '<svg id="chart" viewBox="0 0 640 260" role="img" aria-label="measured memory over time against the '
            'predicted peak"></svg>'
            '<p class="legend"><span class="l-now"></span> measured now <span class="l-peak"></span> measured peak '
            '<span class="l-pred"></span> predicted peak <span class="l-admit"></span> admission '
            f'<span class="l-over"></span> first over prediction{ranks}</p>'
            '<p id="m-ranks" class="ranks-now"></p>'
            '<p id="status" role="status">waiting for the first reading…</p></section>')


def live_page(plan: Mapping[str, Any]) -> str:
    """The page ``edge serve`` answers at ``/edge/``: the plan part, then the live part that polls the server."""
    header = (f"<header><h1>{esc(title_of(plan))}</h1><p>served by edge: the plan, and the memory measured "
              "while it runs</p></header>")
    return page(title_of(plan), f"{header}\n{live_section(plan)}\n{plan_section(plan)}", asset("live.js"))
