"""Dashboards, Prometheus, collector, Tempo and compose configs: consistent, and every panel's
query returns data from a real Prometheus scraping a real server."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from service.config import ServerConfig
from tests.helpers.load import stream_chat, wait_until
from tests.helpers.server import ROOT, LumenServer, free_port

DASH = ROOT / "dashboards"
BOARDS = DASH / "grafana" / "dashboards"
BUILTINS = {"__rate_interval", "__interval", "__range", "__all"}
# The ClickHouse source's macros (grafana/clickhouse-datasource pkg/macros): the fleet dashboard's
# queries run on chdb with them expanded (tests/tracing/test_fleet_otlp.py).
BUILTINS |= {"__timeFilter", "__timeFilter_ms", "__timeInterval", "__fromTime", "__toTime",
             "__interval_s"}  # fmt: skip


def _generator():
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASH / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _boards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(BOARDS.glob("*.json"))}


def _targets(board: dict) -> list[tuple[dict, dict]]:
    return [(panel, t) for panel in board["panels"] for t in panel.get("targets", [])]


def _yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_committed_dashboards_are_what_the_generator_writes() -> None:
    gen = _generator()
    built = gen.build()
    assert sorted(built) == sorted(_boards())
    for name, board in built.items():
        assert (BOARDS / name).read_text() == gen.render(board), "run dashboards/generate.py"


def test_dashboards_are_consistent() -> None:
    provisioned = _yaml(DASH / "grafana/provisioning/datasources/datasources.yml")
    uids = {d["uid"] for d in provisioned["datasources"]}
    boards = _boards()
    assert len({b["uid"] for b in boards.values()}) == len(boards)
    for name, board in boards.items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), name
        defined = {v["name"] for v in board["templating"]["list"]} | BUILTINS
        for panel in board["panels"]:
            if "datasource" in panel:
                assert panel["datasource"]["uid"] in uids, (name, panel["title"])
        for panel, target in _targets(board):
            assert target["datasource"]["uid"] in uids, (name, panel["title"])
            text = target.get("expr") or target.get("query") or target.get("rawSql") or ""
            used = set(re.findall(r"\$\{?(\w+)", text))
            assert used <= defined, (name, panel["title"], used - defined)
    overview = {p["title"] for p in boards["lumen-overview.json"]["panels"]}
    for needed in (
        "Time to first token",
        "Time per output token",
        "Inter-token latency",
        "KV cache usage",
        "Prefix cache hit rate",
        "Admission rejections and aborts",
    ):
        assert needed in overview  # fmt: skip


def test_promtool_accepts_the_prometheus_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; .ci/run installs it)")
    result = subprocess.run(
        [promtool, "check", "config", str(DASH / "prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_parses_and_its_parts_agree() -> None:
    compose_file = ROOT / "docker-compose.yml"
    if (docker_compose := shutil.which("docker-compose")) is not None:
        result = subprocess.run(
            [docker_compose, "-f", str(compose_file), "config", "--quiet"],
            capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
    compose = _yaml(compose_file)
    services = compose["services"]
    assert set(services) == {
        "lumen", "otel-collector", "tempo", "prometheus", "grafana", "clickhouse",
    }  # fmt: skip
    assert (ROOT / services["lumen"]["build"] / "Dockerfile").is_file()
    mounts = {}
    for name, svc in services.items():
        for volume in svc.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)
                mounts[(name, target)] = ROOT / source

    def published(service: str) -> set[int]:
        return {int(p.split(":")[-1]) for p in services[service].get("ports", [])}

    # Prometheus scrapes every replica of the lumen service (DNS) on the port lumen listens on.
    [sd] = _yaml(DASH / "prometheus/prometheus.yml")["scrape_configs"][0]["dns_sd_configs"]
    host, port = sd["names"][0], str(sd["port"])
    assert host == "lumen" and sd["type"] == "A" and int(port) in published("lumen")
    assert f'"--port", "{port}"' in (ROOT / "Dockerfile").read_text()
    # Lumen -> collector (OTLP/HTTP) -> Tempo (OTLP/gRPC) -> Grafana.
    lumen_cmd = services["lumen"]["command"]
    otlp = lumen_cmd[lumen_cmd.index("--otlp-traces-endpoint") + 1]
    collector = _yaml(mounts[("otel-collector", "/etc/otelcol/config.yaml")])
    http_port = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].split(":")[1]
    assert otlp == f"http://otel-collector:{http_port}"
    tempo_endpoint = collector["exporters"]["otlp/tempo"]["endpoint"]
    tempo = _yaml(mounts[("tempo", "/etc/tempo/tempo.yaml")])
    tempo_grpc = tempo["distributor"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert tempo_endpoint == f"tempo:{tempo_grpc.split(':')[1]}"
    sources = {
        d["uid"]: d.get("url")
        for d in _yaml(DASH / "grafana/provisioning/datasources/datasources.yml")["datasources"]
    }
    assert sources["tempo"] == f"http://tempo:{tempo['server']['http_listen_port']}"
    assert sources["prometheus"] == "http://prometheus:9090" and 9090 in published("prometheus")
    # The lumen service is probed on its readiness path, and docker stop waits out the drain.
    lumen = services["lumen"]
    assert f"127.0.0.1:{port}/health" in " ".join(lumen["healthcheck"]["test"])
    grace = int(lumen["stop_grace_period"].removesuffix("s"))
    assert grace > ServerConfig.shutdown_timeout
    assert services["prometheus"]["depends_on"]["lumen"]["condition"] == "service_healthy"
    # Lumen exports what a store is rebuilt from; the collector keeps every engine trace and
    # every request Lumen marks, writes ClickHouse where Grafana's ClickHouse source reads.
    assert lumen_cmd[lumen_cmd.index("--otlp-detail") + 1] == "store"
    assert collector["service"]["pipelines"]["traces"]["processors"][0] == "tail_sampling"
    policies = {p["type"]: p for p in collector["processors"]["tail_sampling"]["policies"]}
    assert set(policies) == {"status_code", "string_attribute", "probabilistic"}
    ch = collector["exporters"]["clickhouse"]
    env = services["clickhouse"]["environment"]
    assert ch["endpoint"].startswith("tcp://clickhouse:9000") and 9000 in published("clickhouse")
    assert (ch["username"], ch["password"], ch["database"]) == (
        env["CLICKHOUSE_USER"],
        env["CLICKHOUSE_PASSWORD"],
        env["CLICKHOUSE_DB"],
    )
    [source] = [d for d in _yaml(DASH / "grafana/provisioning/datasources/datasources.yml")[
        "datasources"] if d["uid"] == "clickhouse"]  # fmt: skip
    assert (source["jsonData"]["host"], source["jsonData"]["port"]) == ("clickhouse", 9000)
    assert source["jsonData"]["defaultDatabase"] == ch["database"]
    assert source["secureJsonData"]["password"] == ch["password"]
    plugins = services["grafana"]["environment"]["GF_INSTALL_PLUGINS"]
    assert "grafana-clickhouse-datasource" in plugins
    fleet = json.loads((BOARDS / "lumen-fleet.json").read_text())
    [percent] = [v["query"] for v in fleet["templating"]["list"] if v["name"] == "sample_percent"]
    assert float(percent) == policies["probabilistic"]["probabilistic"]["sampling_percentage"]
    # Grafana finds its provisioning and the dashboards where the provider looks.
    assert ("grafana", "/etc/grafana/provisioning") in mounts
    provider = _yaml(DASH / "grafana/provisioning/dashboards/dashboards.yml")["providers"][0]
    assert mounts[("grafana", provider["options"]["path"])] == BOARDS


@pytest.fixture(scope="module")
def prometheus_and_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus; .ci/run installs it)")
    tmp = tmp_path_factory.mktemp("prom")
    with LumenServer(tiny_model_path, "--num-kv-blocks", "512", log_path=tmp / "serve.log") as s:
        # The shipped config, pointed at this server and scraping every second.
        config = _yaml(DASH / "prometheus/prometheus.yml")
        config["global"]["scrape_interval"] = "1s"
        job = config["scrape_configs"][0]
        del job["dns_sd_configs"]
        job["static_configs"] = [{"targets": [f"127.0.0.1:{s.port}"]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        prom = subprocess.Popen(
            [binary, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: _ready(url), 30)
            yield url, s
        finally:
            prom.terminate()
            prom.wait(10)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/-/ready", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def _load(server: LumenServer) -> None:
    shared = "You are a helpful assistant who answers in one short sentence. " * 4
    bodies = [
        {"messages": [{"role": "system", "content": shared}, {"role": "user", "content": q}],
         "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        for q in ("Rivers?", "Mountains?", "Seas?", "Deserts?", "Forests?", "Lakes?")
    ]  # fmt: skip
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda b: stream_chat(server, b), bodies))
    stream_chat(server, {**bodies[0], "max_tokens": 500}, stop_after=3)  # a disconnect


def test_every_panel_query_returns_data(prometheus_and_server) -> None:
    url, server = prometheus_and_server
    _load(server)
    wait_until(
        lambda: _query(url, "sum(lumen:generation_tokens_total)") and float(
            _query(url, "sum(lumen:generation_tokens_total)")[0]["value"][1]) > 0,
        30,
    )  # fmt: skip
    labels = httpx.get(f"{url}/api/v1/label/model_name/values").json()["data"]
    assert labels == [server.client().models.list().data[0].id]  # the $model variable
    # rate() needs a few more scrapes after the load: ask again (each second) until every
    # panel has data or the time is up.
    deadline = time.monotonic() + 20
    while (checked := _empty_panels(url))[0] and time.monotonic() < deadline:
        time.sleep(1)
    empty, count = checked
    print(f"\n{count} panel queries checked against Prometheus")
    assert empty == []


def _empty_panels(url: str) -> tuple[list[str], int]:
    """The Prometheus panel queries that return no series ("board / panel: expr"), and how
    many there are."""
    empty, count = [], 0
    for name, board in _boards().items():
        for panel, target in _targets(board):
            if target["datasource"]["uid"] != "prometheus":
                continue
            expr = target["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            count += 1
            if not _query(url, expr):
                empty.append(f"{name} / {panel['title']}: {expr}")
    return empty, count


def _query(url: str, expr: str) -> list:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return r["data"]["result"]
