"""The Grafana dashboard (``deploy/grafana/sglang-kvbm.json``) queries only series the metrics endpoint exports.

Every PromQL expression of the dashboard (panel targets and the template variables' queries) is parsed: the
series it selects, the labels its matchers filter on and the labels its aggregations group by. The series are
then produced for real: SGLang's default tree with the kvbm linker (``conftest.build_stack``), host and disk
tiers and the metrics endpoint on, offloads to host and disk, loads back from both, and a disk block damaged on
file so that a read fails its verification. ``GET /metrics`` is scraped from the worker's own endpoint (a thread
of this process) and read with Prometheus' text parser. Each series the dashboard selects must be a sample name
of that exposition (``kvbm_transfer_seconds_bucket``, not ``kvbm_transfer_seconds``; no ``_total`` the Python
client would add), each label it filters or groups by must be one of that series' labels (or a label Prometheus
adds to every target: ``instance``, ``job``), and a literal label value it selects must be one the worker
exported. Grafana itself is not installed here: the JSON is checked structurally, not rendered.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.disk import data_offset, flip_bit, load_exact, on_disk_only, segment_path
from sglang_kvbm.observe.endpoint import stats_of
from sglang_kvbm.observe.metrics import PER_TIER
from sglang_kvbm.ops.demo.server import free_port

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sglang-kvbm.json"
TARGET_LABELS = {"instance", "job"}  # Prometheus adds these to every series it scrapes
GRAFANA_VARIABLES = {"__interval", "__rate_interval", "__range", "__interval_ms", "__range_s", "__range_ms"}
# Families declared with no sample unless a remote tier (Mooncake, object storage) is on: a remote tier needs a
# server process (mooncake_master, an S3 emulator), which this in-process test does not start. Their label names
# come from the library's declaration instead; any other family without samples fails the test.
REMOTE_ONLY = {"kvbm_tier_lookup_miss_blocks": PER_TIER["lookup_misses"][2], "kvbm_tier_up": ["tier"]}

pytestmark = pytest.mark.usefixtures("loads_wait_for_their_reads")


# -- a small PromQL reader: the selectors of an expression and the labels its aggregations group by ----------

AGGREGATIONS = {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
                "quantile", "limitk", "limit_ratio"}
GROUPING = {"by", "without"}
MATCHING = {"on", "ignoring", "group_left", "group_right"}
BINARY_WORDS = {"and", "or", "unless", "bool", "atan2"}
TOKEN = re.compile(r"""
    (?P<ws>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?(?![a-zA-Z_]))
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<range>\[[^\]]*\])
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=(){},@])
""", re.VERBOSE)


def tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        assert m, f"cannot read PromQL at {expr[pos:]!r} in {expr!r}"
        pos = m.end()
        if m.lastgroup != "ws":
            out.append((m.lastgroup, m.group()))
    return out


class Selector:
    def __init__(self, name: str, matchers: list[tuple[str, str, str]]) -> None:
        self.name, self.matchers = name, matchers


class PromQL:
    """A flat recursive-descent reading, enough to find what an expression selects and groups by (operator
    precedence does not matter for that)."""

    def __init__(self, expr: str) -> None:
        self.expr, self.toks, self.i = expr, tokens(expr), 0
        self.selectors: list[Selector] = []
        self.groupings: list[tuple[list[str], list[Selector]]] = []  # labels, the selectors they group
        self._expression()
        assert self.i == len(self.toks), f"unread PromQL after {self.toks[self.i:]} in {self.expr!r}"

    def _peek(self, k: int = 0):
        return self.toks[self.i + k] if self.i + k < len(self.toks) else (None, None)

    def _take(self, value=None):
        tok = self._peek()
        assert tok[0] is not None and (value is None or tok[1] == value), f"expected {value!r} at {tok} in {self.expr!r}"
        self.i += 1
        return tok

    def _labels(self) -> list[str]:
        self._take("(")
        names = []
        while self._peek()[1] != ")":
            kind, name = self._take()
            assert kind == "ident", f"label name expected, got {name!r} in {self.expr!r}"
            names.append(name)
            if self._peek()[1] == ",":
                self._take(",")
        self._take(")")
        return names

    def _binary_operator(self) -> bool:
        kind, value = self._peek()
        return (kind == "op" and value not in "(){},") or value in BINARY_WORDS

    def _expression(self) -> None:
        start = len(self.selectors)
        matched_on = []  # on(...) / ignoring(...): labels both sides of the operator must have
        self._unary()
        while self._binary_operator():
            self._take()
            while self._peek()[1] in MATCHING or self._peek()[1] == "bool":
                word = self._take()[1]
                if self._peek()[1] == "(":
                    labels = self._labels()
                    if word in ("on", "ignoring"):
                        matched_on.append(labels)
            self._unary()
        self.groupings.extend((labels, self.selectors[start:]) for labels in matched_on)

    def _unary(self) -> None:
        while self._peek()[1] in ("-", "+"):
            self._take()
        self._primary()
        if self._peek()[0] == "range":
            self._take()
        if self._peek()[1] == "offset":
            self._take()
            self._take()

    def _grouping(self):
        if self._peek()[1] not in GROUPING:
            return None
        self._take()
        return self._labels()

    def _primary(self) -> None:
        kind, value = self._peek()
        if kind in ("number", "string"):
            self._take()
        elif value == "(":
            self._take("(")
            self._expression()
            self._take(")")
        elif kind == "ident" and value in AGGREGATIONS:
            self._take()
            labels = self._grouping()
            start = len(self.selectors)
            self._arguments()
            if labels is None:
                labels = self._grouping()
            if labels is not None:
                self.groupings.append((labels, self.selectors[start:]))
        elif kind == "ident" and self._peek(1)[1] == "(":
            self._take()
            self._arguments()
        elif kind == "ident":
            name = self._take()[1]
            self.selectors.append(Selector(name, self._matchers() if self._peek()[1] == "{" else []))
        else:  # a selector without a metric name ({__name__=...}) is not expected either
            raise AssertionError(f"unexpected {value!r} in {self.expr!r}")

    def _arguments(self) -> None:
        self._take("(")
        while self._peek()[1] != ")":
            self._expression()
            if self._peek()[1] == ",":
                self._take(",")
        self._take(")")

    def _matchers(self) -> list[tuple[str, str, str]]:
        self._take("{")
        out = []
        while self._peek()[1] != "}":
            kind, label = self._take()
            assert kind == "ident", f"label name expected, got {label!r} in {self.expr!r}"
            op = self._take()[1]
            assert op in ("=", "!=", "=~", "!~"), f"bad matcher operator {op!r} in {self.expr!r}"
            kind, value = self._take()
            assert kind == "string", f"matcher value must be a string in {self.expr!r}"
            out.append((label, op, value[1:-1]))
            if self._peek()[1] == ",":
                self._take(",")
        self._take("}")
        return out


def test_the_promql_reader_finds_selectors_and_groupings():
    q = PromQL('histogram_quantile(0.99, sum by (le, path) (rate(a_bucket{x=~"$v", path="d2h"}[5m])))'
               ' / on(path) group_left sum(rate(b[1m])) by (path) + -1e3')
    assert [(s.name, s.matchers) for s in q.selectors] == [("a_bucket", [("x", "=~", "$v"), ("path", "=", "d2h")]),
                                                          ("b", [])]
    assert [(labels, [s.name for s in scope]) for labels, scope in q.groupings] == [
        (["le", "path"], ["a_bucket"]), (["path"], ["b"]), (["path"], ["a_bucket", "b"])]


# -- the dashboard -------------------------------------------------------------------------------------------


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row keeps its panels inside it
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """``(where, PromQL)`` for every panel target and every query variable (``label_values(metric, label)``
    reads as the selector ``metric`` grouped by ``label``)."""
    out = []
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            out.append((f"panel {panel['id']} {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.+),\s*([a-zA-Z_]\w*)\)", query.strip())
        assert m, f"variable {var['name']}: only label_values(selector, label) is expected, got {query!r}"
        out.append((f"variable {var['name']}", f"sum by ({m.group(2)}) ({m.group(1)})"))
    return out


def test_dashboard_structure():
    dashboard = load_dashboard()
    assert dashboard["uid"] == "sglang-kvbm" and dashboard["title"] and dashboard["tags"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["id"] is None  # importable anywhere
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert (datasource["type"], datasource["query"]) == ("datasource", "prometheus")
    assert variables["instance"]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}

    panels = all_panels(dashboard)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    boxes = []
    for panel in panels:
        grid = panel["gridPos"]
        assert set(grid) >= {"h", "w", "x", "y"} and all(isinstance(grid[k], int) for k in "hwxy"), panel["title"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        boxes.append((grid["x"], grid["y"], grid["x"] + grid["w"], grid["y"] + grid["h"], panel["title"]))
        if panel["type"] == "row":
            assert not panel.get("targets")
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target.get("datasource", panel["datasource"]) == panel["datasource"], panel["title"]
            assert target["expr"].strip() and "legendFormat" in target, panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{panel['title']}: no unit"
    for k, a in enumerate(boxes):  # no two panels overlap
        for b in boxes[k + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], f"{a[4]!r} overlaps {b[4]!r}"
    # every $variable a query uses is defined (or is one of Grafana's own)
    for where, expr in queries(dashboard):
        for name in re.findall(r"\$\{?(\w+)", expr):
            assert name in variables or name in GRAFANA_VARIABLES, f"{where}: undefined variable ${name}"


# -- what the worker exports, for real -----------------------------------------------------------------------


@pytest.fixture
def exposition(stack_factory, tmp_path) -> str:
    """``/metrics`` of a worker whose host and disk tiers took, served and lost blocks."""
    port = free_port()
    stack = stack_factory(host_blocks=4, disk_blocks=64, disk_dir=tmp_path,
                          config={"metrics": True, "metrics_port": port})
    # served from disk: offloaded device -> host -> disk, pushed out of the host tier, loaded back
    on_disk = list(range(200, 216))
    load_exact(stack, on_disk, on_disk_only(stack, on_disk, seed=7), rid="disk")
    stack.settle()  # the read is kept in host (its copy takes host rows until it is collected)
    # served from host
    on_host = list(range(400, 416))
    written = stack.insert(on_host, seed=8)
    stack.settle()
    stack.evict_all()
    load_exact(stack, on_host, written, rid="host")
    # a disk block whose bytes fail verification: the load is a miss, the block is dropped ("checksum mismatch")
    damaged = list(range(600, 616))
    on_disk_only(stack, damaged, seed=9)
    disk = stack.manager.tiers["disk"].store
    victim = stack.block_ids(damaged)[1]
    flip_bit(segment_path(disk, victim), data_offset(disk, victim) + 100)
    req, _, _, _, _ = stack.admit(damaged + [1], "damaged")
    stack.finish(req)
    stack.settle()
    assert dict(disk.stats.invalidated), "the damaged block was not caught"
    stack.linker.connector.publish(stats_of(stack.linker))  # what the scheduler does between steps
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        return reply.read().decode()


def series_labels(text: str) -> tuple[dict[str, set[str]], dict[str, dict[str, set[str]]], set[str]]:
    """Each sample name's label names and label values, and the families declared with no sample at all."""
    names: dict[str, set[str]] = {}
    values: dict[str, dict[str, set[str]]] = {}
    empty = set()
    for family in text_string_to_metric_families(text):
        if not family.samples:
            empty.add(family.name)
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
            for label, value in sample.labels.items():
                values.setdefault(sample.name, {}).setdefault(label, set()).add(value)
    return names, values, empty


def family_of(name: str, exported) -> str:
    """For a helpful message: the family a suffixed name belongs to."""
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        if name.endswith(suffix) and name[: -len(suffix)] in exported:
            return name[: -len(suffix)]
    return name


def test_every_series_the_dashboard_queries_is_exported(exposition):
    labels, values, empty = series_labels(exposition)
    assert empty == set(REMOTE_ONLY), f"families without samples in this run: {sorted(empty)}"
    for name, declared in REMOTE_ONLY.items():
        labels[name] = set(declared)
    # what the run must have produced for the label checks to mean anything
    assert {"host", "disk"} <= values["kvbm_tier_onboard_blocks"]["tier"]
    assert {"d2h", "onboard_h2d", "onboard_d2d"} <= values["kvbm_transfer_seconds_bucket"]["path"]
    assert values["kvbm_disk_invalidated_blocks"]["reason"]

    checked = set()
    for where, expr in queries(load_dashboard()):
        q = PromQL(expr)
        assert q.selectors, f"{where}: selects nothing: {expr!r}"
        for sel in q.selectors:
            assert sel.name in labels, (f"{where}: {sel.name!r} is not exported (family {family_of(sel.name, labels)!r}; "
                                        f"exported: {sorted(labels)})")
            checked.add(sel.name)
            for label, op, value in sel.matchers:
                if label in TARGET_LABELS:
                    continue
                assert label in labels[sel.name], f"{where}: {sel.name} has no label {label!r} ({labels[sel.name]})"
                if "$" in value or op in ("!=", "!~") or sel.name in REMOTE_ONLY:
                    continue
                seen = values.get(sel.name, {}).get(label, set())
                hit = [v for v in seen if (v == value if op == "=" else re.fullmatch(value, v))]
                assert hit, f"{where}: no {sel.name}{{{label}{op}{value!r}}} among {sorted(seen)}"
        for grouped, scope in q.groupings:
            for label in grouped:
                if label in TARGET_LABELS:
                    continue
                for sel in scope:
                    assert label in labels[sel.name], f"{where}: groups {sel.name} by {label!r}, a label it lacks"
    # the dashboard reads every family the worker exports (the _created timestamps aside)
    unread = {family_of(n, labels) for n in labels} - {family_of(n, labels) for n in checked}
    assert unread <= {"kvbm_transfer_seconds_created"}, f"exported but on no panel: {sorted(unread)}"
