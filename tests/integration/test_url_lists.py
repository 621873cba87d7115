"""`vitforge shard LIST --url-col url`: URL lists downloaded from a misbehaving server on 127.0.0.1
(testing/local_images.py), with exact accounting, determinism, resume after kill -9, opt-outs,
and the request-forgery guard (proved without a packet to any refused address)."""

from __future__ import annotations

import io
import ipaddress
import json
import signal
import socket
import subprocess
import sys
import tarfile
import time
import urllib.parse

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from aiohttp.abc import AbstractResolver
from PIL import Image

from common import socket_guard
from common.checks import dataset_samples, tree_bytes, without_plan
from common.cli import REPO, vitforge
from vitforge.cluster import slurm as slurm_commands
from vitforge.shards import Downloader, DownloadOptions
from vitforge.testing.local_images import start_image_server

PLANTED = "PLANTED-secret-9f2c"  # a password in a URL list: never downloaded with, never written or printed
GOOD = 24  # plain images served at /img/ and /slow/
# route -> (what vitforge records for it, how many requests it may take)
ROUTES = {
    "missing/p0.jpg": ("http_404", 1),  # a 4xx is never retried
    "flaky/p1.jpg": ("packed", 2),  # 500, then the image
    "throttled/p2.jpg": ("packed", 2),  # 429 Retry-After: 1, then the image
    "stalled/p3.jpg": ("timeout", None),  # headers after 5 s; --first-byte-timeout 1
    "trickle/p4.jpg": ("timeout", None),  # a body over 5 s; --deadline 3
    "cut/p5.jpg": ("truncated", 3),  # Content-Length twice what is sent: retried, then given up
    "redirect/3/p6.jpg": ("packed", 4),
    "redirect/9/p7.jpg": ("too_many_redirects", 6),  # --max-redirects 5
    "loop/a": ("redirect_loop", 2),
    "as-html/p8.jpg": ("packed", 1),  # the type is a hint only: the bytes are a JPEG
    "html-as-jpeg/x.jpg": ("not_an_image", 1),
    "bomb/p9.png": ("decompression_bomb", 1),  # 4000 x 4000 px; --max-pixels 1000000
    "big/p10.jpg": ("too_large", 1),  # refused by its Content-Length, unread
    "big-chunked/p11.jpg": ("too_large", 1),  # no Content-Length: refused once past --max-body
    "noai/p12.jpg": ("opt_out_x_robots_tag", 1),
    "otherbot/p13.jpg": ("packed", 1),  # X-Robots-Tag: otherbot: noai is not addressed to vitforge
    "private/p14.jpg": ("opt_out_robots_txt", 0),  # robots.txt disallows /private/ for vitforge: never requested
    "to/" + urllib.parse.quote("http://169.254.169.254/latest/meta-data/", safe=""): ("forbidden_address", 1),
}
OPTIONS = ["--url-col", "url", "--label-col", "label", "--caption-col", "caption", "--meta-col", "source_id",
           "--allow-network", "127.0.0.0/8", "--first-byte-timeout", "1", "--deadline", "3", "--retries", "2",
           "--max-body", "300KB", "--max-pixels", "1000000", "--shard-samples", "6", "--workers", "1"]


def _jpeg(i: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (40 + i, 32 + i % 5), (i * 9 % 256, 90, 200 - i)).save(out, "JPEG", quality=90)
    return out.getvalue()


def _bomb() -> bytes:
    out = io.BytesIO()
    Image.new("L", (4000, 4000)).save(out, "PNG")  # 16 Mpx of zeros: a few KB on the wire
    return out.getvalue()


@pytest.fixture(scope="module")
def server():
    images = {f"g{i}.jpg": _jpeg(i) for i in range(GOOD)}
    images.update({f"p{i}.jpg": _jpeg(100 + i) for i in range(15)})
    images["p9.png"] = _bomb()
    served = start_image_server(images, stall_s=5, trickle_s=5, slow_s=0.15)
    yield served
    served.stop()


def _url_list(server, path, good_route="img") -> list[dict]:
    rows = [{"url": f"{server.url}/{good_route}/g{i}.jpg", "label": f"c{i % 3}", "caption": f"good {i}",
             "source_id": i, "ignored": "x"} for i in range(GOOD)]
    rows += [{"url": f"{server.url}/{route}", "label": "c0", "caption": route, "source_id": 100 + n, "ignored": "x"}
             for n, route in enumerate(ROUTES)]
    rows.append({"url": "ftp://example.invalid/a.jpg", "label": "c1", "caption": "ftp", "source_id": 999,
                 "ignored": "x"})
    rows.append({"url": f"http://alice:{PLANTED}@{server.url.removeprefix('http://')}/img/g0.jpg", "label": "c1",
                 "caption": "userinfo", "source_id": 998, "ignored": "x"})
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def test_a_misbehaving_server_is_accounted_for_exactly_and_any_concurrency_gives_the_same_bytes(server, tmp_path):
    listing = tmp_path / "urls.jsonl"
    rows = _url_list(server, listing)
    started = len(server.log)
    result = vitforge("shard", listing, tmp_path / "a", *OPTIONS, "--concurrency", "8")
    log = server.log[started:]
    manifest = json.loads((tmp_path / "a" / "dataset.json").read_text())
    packed_routes = [r for r, (outcome, _) in ROUTES.items() if outcome == "packed"]
    assert manifest["totals"]["inputs"] == len(rows)
    assert manifest["totals"]["samples"] == GOOD + len(packed_routes), result.stdout
    assert manifest["totals"]["samples"] + manifest["totals"]["rejected"] == len(rows)
    rejects = {r["source"].removeprefix(server.url + "/"): r
               for r in map(json.loads, (tmp_path / "a" / "rejects.jsonl").read_text().splitlines())}
    expected = {route: outcome for route, (outcome, _) in ROUTES.items() if outcome != "packed"}
    assert {route: rejects[route]["reason"] for route in expected} == expected
    assert rejects["ftp://example.invalid/a.jpg"]["reason"] == "bad_url"
    assert rejects[f"http://***@{server.url.removeprefix('http://')}/img/g0.jpg"]["reason"] == "bad_url"
    assert not any(PLANTED.encode() in data for data in tree_bytes(tmp_path / "a").values())
    assert PLANTED not in result.stdout + result.stderr
    assert {route for route, r in rejects.items() if r.get("retryable")} == {"stalled/p3.jpg", "trickle/p4.jpg",
                                                                              "cut/p5.jpg"}
    assert "169.254.169.254 is link-local" in rejects[list(ROUTES)[-1]]["detail"]
    assert "failures by host" in result.stdout and "127.0.0.1" in result.stdout

    # What the server saw: robots.txt once; no 4xx retried; retries only where allowed; 429's Retry-After waited.
    paths = [entry["path"] for entry in log]
    assert paths.count("/robots.txt") == 1
    for route, (_, requests) in ROUTES.items():
        if requests is not None and not route.startswith(("redirect", "loop", "to/")):
            assert paths.count("/" + urllib.parse.unquote(route)) == requests, route
    assert sum(p.startswith("/redirect/") for p in paths) == 3 + 6
    throttled = [entry["t"] for entry in log if entry["path"] == "/throttled/p2.jpg"]
    assert throttled[1] - throttled[0] >= 0.95, throttled

    # Samples: the caption as .txt, the JSON with the URL, final URL, status and the kept column.
    samples = {s["info"]["url"]: s for s in dataset_samples(tmp_path / "a")}
    redirected = samples[f"{server.url}/redirect/3/p6.jpg"]["info"]
    assert redirected["final_url"] == f"{server.url}/img/p6.jpg" and redirected["status"] == 200
    assert redirected["meta"] == {"caption": "redirect/3/p6.jpg", "source_id": 100 + list(ROUTES).index(
        "redirect/3/p6.jpg")}
    assert samples[f"{server.url}/img/g5.jpg"]["txt"] == b"good 5"
    assert samples[f"{server.url}/img/g5.jpg"]["image_bytes"] == server.images["g5.jpg"]  # a clean JPEG is kept as is

    # Another concurrency and a second pass over the (now well-behaved) flaky routes: the same bytes.
    vitforge("shard", listing, tmp_path / "b", *OPTIONS, "--concurrency", "1")
    assert tree_bytes(tmp_path / "a") == tree_bytes(tmp_path / "b")


def test_kill_9_mid_download_reruns_to_the_same_bytes_without_fetching_packed_images_again(server, tmp_path):
    listing = tmp_path / "urls.jsonl"
    _url_list(server, listing, good_route="slow")  # 0.15 s per image: the run lasts long enough to be killed
    vitforge("shard", listing, tmp_path / "reference", *OPTIONS, "--concurrency", "2")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vitforge", "shard", str(listing), str(out), *OPTIONS, "--concurrency", "2"]
    started = len(server.log)
    process = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(out.glob("_work/shards/*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = [json.loads(p.read_text())["name"] for p in out.glob("_work/shards/*.json")]
    assert finished and not (out / "dataset.json").exists()
    killed_at = len(server.log)
    vitforge(*cmd[3:])
    assert tree_bytes(out) == tree_bytes(tmp_path / "reference")
    # Nothing packed in a shard finished before the kill is downloaded again by the rerun.
    packed_before = set()
    for name in finished:
        with tarfile.open(out / name) as tar:
            packed_before |= {json.loads(tar.extractfile(m).read())["url"].removeprefix(server.url)
                              for m in tar if m.name.endswith(".json")}
    again = {entry["path"] for entry in server.log[killed_at:]}
    assert packed_before and not packed_before & again
    assert {entry["path"] for entry in server.log[started:killed_at]} >= packed_before


def test_waiting_for_a_turn_at_a_host_counts_against_no_timeout(server):
    """12 images that take 0.15 s each from one host, with a 1 s deadline: one connection to the
    host (a 1.8 s queue), or 8 request starts a second (the last starts 1.4 s in). Every one is
    downloaded, at any concurrency: how long a row waits for others decides nothing."""
    urls = [f"{server.url}/slow/g{i}.jpg" for i in range(12)]
    base = dict(deadline=1.0, first_byte_timeout=1.0, retries=0, allow_networks=(ipaddress.ip_network("127.0.0.0/8"),))
    for settings in (dict(per_host=1, concurrency=12), dict(per_host=8, concurrency=12, host_rate=8.0),
                     dict(per_host=1, concurrency=1)):
        with Downloader(DownloadOptions(**base, **settings)) as downloader:
            outcomes = list(downloader.fetch_ordered(urls))
        assert [o.reason for o in outcomes] == [""] * 12, (settings, outcomes)
        assert [o.data for o in outcomes] == [server.images[f"g{i}.jpg"] for i in range(12)]


def test_robots_txt_is_read_whole_however_slowly_it_arrives():
    """The rule for vitforge comes after 100 KiB of comments sent in pieces: a read that takes only
    what has arrived sees comments and allows everything."""
    served = start_image_server({"g0.jpg": _jpeg(0)}, robots_slowly=True)
    try:
        options = DownloadOptions(retries=0, allow_networks=(ipaddress.ip_network("127.0.0.0/8"),))
        with Downloader(options) as downloader:
            private, public = downloader.fetch_ordered([f"{served.url}/private/g0.jpg", f"{served.url}/img/g0.jpg"])
    finally:
        served.stop()
    assert private.reason == "opt_out_robots_txt" and public.data == served.images["g0.jpg"]
    assert served.paths("/private/") == [] and served.paths("/robots.txt") == ["/robots.txt"]


def test_workers_are_forked_before_the_download_thread_starts(server, tmp_path):
    """A fork copies every lock another thread holds (the downloader's event loop, aiohttp's DNS
    threads): the packing workers are forked first."""
    listing = tmp_path / "urls.jsonl"
    listing.write_text("".join(json.dumps({"url": f"{server.url}/img/g{i}.jpg"}) + "\n" for i in range(8)))
    script = (
        "import json, os, sys, threading\n"
        "forks = []\n"
        "os.register_at_fork(before=lambda: forks.append(sorted(t.name for t in threading.enumerate())))\n"
        "from vitforge.cli import main\n"
        f"code = main(['shard', {str(listing)!r}, {str(tmp_path / 'out')!r}, '--url-col', 'url', '--no-labels',\n"
        "             '--allow-network', '127.0.0.0/8', '--workers', '2'])\n"
        "print(json.dumps({'code': code, 'forks': forks}))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == 0 and len(report["forks"]) >= 2, report
    assert not any("downloads" in names for names in report["forks"]), report


class StubResolver(AbstractResolver):
    """DNS as the test says: a name maps to the addresses given, anything else does not resolve."""

    def __init__(self, names: dict[str, list[str]]):
        self.names = names

    async def resolve(self, host, port=0, family=socket.AF_INET):
        if host not in self.names:
            raise OSError(f"stub resolver: {host} unknown")
        return [{"hostname": host, "host": address, "port": port, "family": socket.AF_INET6 if ":" in address
                 else socket.AF_INET, "proto": 0, "flags": socket.AI_NUMERICHOST} for address in self.names[host]]

    async def close(self):
        pass


def test_no_url_and_no_redirect_reaches_a_refused_address_and_no_packet_is_sent_there(server):
    names = {"metadata.test": ["169.254.169.254"], "intranet.test": ["10.0.0.1"],
             "mixed.test": ["93.184.216.34", "10.0.0.1"], "images.test": ["127.0.0.1"],
             "nat64.test": ["64:ff9b::a9fe:a9fe"]}
    port = server.port
    refused = [
        "http://metadata.test/latest/meta-data/iam/security-credentials/",  # a name for the metadata endpoint
        "http://intranet.test/a.jpg",  # a private address
        "http://mixed.test/a.jpg",  # a name with one public and one private address
        "http://169.254.169.254/latest/meta-data/",  # the endpoint itself
        "http://[::ffff:10.0.0.1]/a.jpg",  # a private address, IPv4-mapped
        "http://[fd00:ec2::254]/latest/meta-data/",  # AWS's IPv6 metadata endpoint (unique local)
        "http://[64:ff9b::a9fe:a9fe]/latest/meta-data/",  # the metadata endpoint through NAT64
        "http://nat64.test/latest/meta-data/",  # a name for it
        "http://[2002:a00:1::1]/a.jpg",  # 10.0.0.1 in 6to4
        f"http://images.test:{port}/to/" + urllib.parse.quote(f"http://intranet.test:{port}/img/g0.jpg", safe=""),
        f"http://images.test:{port}/to/" + urllib.parse.quote("http://[::1]:1/x", safe=""),  # loopback, not allowed
    ]
    allowed = (ipaddress.ip_network("127.0.0.1/32"),)
    with socket_guard.loopback_only() as connects:
        with Downloader(DownloadOptions(retries=0, allow_networks=allowed), StubResolver(names)) as downloader:
            outcomes = list(downloader.fetch_ordered([*refused, f"http://images.test:{port}/img/g0.jpg"]))
        with Downloader(DownloadOptions(retries=0), StubResolver(names)) as strict:
            own, idna, broken = strict.fetch_ordered([f"http://images.test:{port}/img/g1.jpg",
                                                      f"http://①②⑦.0.0.1:{port}/img/g1.jpg", "http://[::1"])
        with Downloader(DownloadOptions(retries=0), StubResolver(names)) as unguarded:
            # Below the resolver's guard: were it bypassed, the address connected to is still checked.
            unguarded._session.connector._resolver = StubResolver(names)
            before = len(server.log)
            (sneaked,) = unguarded.fetch_ordered([f"http://images.test:{port}/img/g2.jpg"])
            reached = server.log[before:]
    assert [o.reason for o in outcomes[:-1]] == ["forbidden_address"] * len(refused), outcomes
    assert "169.254.169.254 is link-local" in outcomes[0].detail and "10.0.0.1 is private" in outcomes[2].detail
    assert outcomes[-1].data == server.images["g0.jpg"] and outcomes[-1].status == 200
    assert own.reason == "forbidden_address" and "127.0.0.1 is loopback" in own.detail
    assert idna.reason == "forbidden_address" and broken.reason == "bad_url"  # IDNA makes the first 127.0.0.1
    assert sneaked.reason == "forbidden_address" and "connecting to 127.0.0.1 is loopback" in sneaked.detail
    assert reached == []  # not even its robots.txt: the socket was refused before connecting
    assert connects and set(connects) == {"127.0.0.1"}  # the only address any socket connected to


def test_a_sharding_array_on_slurm_plans_and_downloads_a_parquet_url_list_to_what_one_run_makes(server, slurm, monkeypatch, tmp_path):
    for key, value in slurm.items():
        monkeypatch.setenv(key, value)
    # A Parquet list: the array plans it together (each task lists a share of its row groups).
    listing = tmp_path / "urls.parquet"
    pq.write_table(pa.Table.from_pylist(_url_list(server, tmp_path / "urls.jsonl")), listing, row_group_size=10)
    vitforge("shard", listing, tmp_path / "one", *OPTIONS)
    spec = tmp_path / "shard.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "url-array", "gpus_per_node": 0, "cpus_per_task": 1, "time": "00:10:00",
        "log_dir": str(tmp_path / "logs"), "venv": str(REPO / ".venv"),
        "shard": {"src": str(listing), "dest": str(tmp_path / "array"), "num_parts": 3, "args": OPTIONS}}))
    array, merge = (line.split(" ")[3].rstrip(":") for line in vitforge("submit", spec).stdout.splitlines())
    deadline = time.monotonic() + 300
    while slurm_commands.job_info(merge)["JobState"] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, slurm_commands.job_info(merge)
        time.sleep(0.5)
    logs = {p.name: p.read_text() for p in (tmp_path / "logs").glob("*.out")}
    tasks = {f"{array}_{i}": slurm_commands.job_info(f"{array}_{i}") for i in range(3)}
    assert slurm_commands.job_info(merge)["JobState"] == "COMPLETED", "\n".join(
        [f"{task}: {info['JobState']} exit {info.get('ExitCode')} {info.get('Reason')}" for task, info in tasks.items()]
        + [f"--- {name}\n{text}" for name, text in sorted(logs.items())])
    assert sum("part " in text and " of 3: built " in text for text in logs.values()) == 3, logs
    assert without_plan(tree_bytes(tmp_path / "array")) == without_plan(tree_bytes(tmp_path / "one"))
