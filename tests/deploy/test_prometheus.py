"""deploy/prometheus/rules.yml and deploy/grafana/*.json against a real Prometheus (Debian's
`prometheus`) scraping a real twinkle-server after a short tinker SDK workload: promtool
accepts the rules, Prometheus loads and evaluates them without error, and every dashboard
query, recording rule and alert signal parses and returns series, so a misspelt metric or
label cannot hide in them."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from e2e_support.server import ServerProcess
from e2e_support.training import KEYS, auth_overrides
from e2e_support.waiting import scaled, wait_until

import workload

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules.yml"
DASHBOARDS = sorted((REPO / "deploy" / "grafana").glob("*.json"))
JOB = "twinkle-server"
# Grafana's variables, as a query would run with "All" instances over a short range.
GRAFANA_VARS = {"$__rate_interval": "1m", "${instance}": ".*", "$instance": ".*"}
# An alert is `<signal> <comparison> <number>`; the signal must return series.
BY = re.compile(r"\bby\s*\(([^)]*)\)")
ALERT = re.compile(r"^(?P<signal>.*\S)\s*(?:>|<|>=|<=|==|!=)\s*-?[0-9.e+]+\s*$", re.S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text(encoding="utf-8"))
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"]
                for name, value in GRAFANA_VARS.items():
                    expr = expr.replace(name, value)
                out.append((f"{path.name}: {panel['title']} [{target['refId']}]", expr))
        for variable in dashboard["templating"]["list"]:
            if variable["type"] == "query":
                metric = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variable["definition"])
                assert metric, f"{path.name}: variable {variable['name']} is not label_values(metric, label)"
                out.append((f"{path.name}: variable {variable['name']}", metric.group(1)))
    return out


def rule_queries() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(recording rules and alert signals that must return series, full alert expressions
    that must parse)."""
    data = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    must_return, must_parse = [], []
    for group in data["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                must_return.append((f"record {rule['record']}", rule["record"]))
                must_return.append((f"record {rule['record']} (expr)", rule["expr"]))
                continue
            match = ALERT.match(rule["expr"])
            assert match, f"alert {rule['alert']}: expr is not '<signal> <comparison> <number>'"
            must_return.append((f"alert {rule['alert']} (signal)", match.group("signal")))
            must_parse.append((f"alert {rule['alert']}", rule["expr"]))
    return must_return, must_parse


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def query(self, expr: str) -> dict[str, Any]:
        r = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=scaled(30))
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{expr!r} does not evaluate: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def series(self, expr: str) -> int:
        """How many series `expr` returns; 0 also when a series lacks a label the expression
        groups by (`sum by (tenant)` over a misspelt label still returns one series)."""
        result = self.query(expr)["result"]
        grouped = {label.strip() for group in BY.findall(expr) for label in group.split(",")} - {"le", ""}
        if any(not grouped <= series["metric"].keys() for series in result):
            return 0
        return len(result)

    def exited(self) -> str | None:
        code = self.proc.poll()
        return None if code is None else f"prometheus exited ({code}):\n{self.log.read_text(errors='replace')[-3000:]}"


@pytest.fixture
def scraped_server(launch_server: Any) -> ServerProcess:
    server = launch_server(auth_overrides(server={"metrics_tenant_labels": True}))
    workload.forward_backward(f"http://{server.host}:{server.http_port}", KEYS["alice"])
    # A client error, so that the non-OK panel has a series.
    assert requests.get(server.http_url("/no/such/route"), timeout=scaled(30)).status_code == 404
    return server


@pytest.fixture
def prometheus(scraped_server: ServerProcess, tmp_path: Path) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    assert binary, "Debian's prometheus is not installed (scripts/debian-packages.txt)"
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": JOB,
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [f"{scraped_server.host}:{scraped_server.http_port}"]}],
        }],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config), encoding="utf-8")
    port = free_port()
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [binary, f"--config.file={config_path}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        def ready() -> bool:
            try:
                return requests.get(f"{prom.url}/-/ready", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        wait_until(ready, scaled(60), "Prometheus ready", interval_s=0.2, abort=prom.exited)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=scaled(20))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_promtool_accepts_the_rules() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus) is not installed"
    out = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert DASHBOARDS, "no dashboard under deploy/grafana"


def test_every_expression_returns_series(prometheus: Prometheus) -> None:
    # Enough scrapes for rate() (two samples in its window) and one rule evaluation after.
    wait_until(lambda: prometheus.series(f'count_over_time(up{{job="{JOB}"}}[1m]) >= 4') == 1,
               scaled(60), "four scrapes of the server", interval_s=0.5, abort=prometheus.exited)
    assert prometheus.query(f'up{{job="{JOB}"}}')["result"][0]["value"][1] == "1"
    must_return, must_parse = rule_queries()
    must_return += dashboard_queries()

    def empty() -> list[str] | None:
        missing = [f"{name}: {expr}" for name, expr in must_return if prometheus.series(expr) == 0]
        return missing or None

    # Recording rules fill in on their first evaluations; wait for them, then require all.
    try:
        wait_until(lambda: empty() is None, scaled(30), "every expression to return series",
                   interval_s=1, abort=prometheus.exited)
    except AssertionError:
        pytest.fail("expressions without series:\n" + "\n".join(empty() or []))
    for name, expr in must_parse:
        prometheus.query(expr)  # raises on a parse or evaluation error
    rules = requests.get(f"{prometheus.url}/api/v1/rules", timeout=scaled(30)).json()["data"]["groups"]
    loaded = [r for g in rules for r in g["rules"]]
    assert len(loaded) == len(must_parse) + sum(1 for n, _ in must_return if n.startswith("record ") and "(expr)" not in n)
    unhealthy = [(r["name"], r.get("lastError")) for r in loaded if r["health"] != "ok"]
    assert not unhealthy, unhealthy


def test_a_misspelt_metric_or_label_returns_nothing(prometheus: Prometheus) -> None:
    """What the check above relies on: a typo yields no series (not an error)."""
    wait_until(lambda: prometheus.series(f'up{{job="{JOB}"}}') == 1, scaled(60), "a scrape",
               interval_s=0.5, abort=prometheus.exited)
    wait_until(lambda: prometheus.series("twinkle_requests_total") > 0, scaled(30), "requests series",
               interval_s=0.5, abort=prometheus.exited)
    assert prometheus.series("twinkle_request_total") == 0
    assert prometheus.series('twinkle_requests_total{methd=~".+"}') == 0
    assert prometheus.series("sum by (method) (twinkle_requests_total)") > 0
    assert prometheus.series("sum by (methd) (twinkle_requests_total)") == 0
