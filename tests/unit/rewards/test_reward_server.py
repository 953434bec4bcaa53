"""The reward server and its client, on loopback only, with a real server process: the round
trip gives the local reward's scores, concurrent requests are batched, a server that is down or
silent is a quick clear error, and a run whose reward server dies stops in one line with an
intact, resumable checkpoint. Under bounded load (200 concurrent clients, slow clients, huge
claimed bodies, a hanging reward, no token) every request gets an HTTP answer naming the limit."""

import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from trainer_utils import tiny_config

from chunk_grpo.cli.reward_server import main as server_main
from chunk_grpo.cli.runner import run_command
from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.rewards import RemoteReward, RewardUnavailableError, build_reward
from chunk_grpo.rewards.outputs import RewardOutputError
from chunk_grpo.rewards.remote import decode_score_request, encode_score_request
from chunk_grpo.rewards.server import Limits, is_loopback, serve
from chunk_grpo.train.checkpoint import latest_checkpoint
from chunk_grpo.train.loop import run
from chunk_grpo.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[3]
MODULE = '''
import time

from chunk_grpo.rewards import register_reward


@register_reward("bright")
def bright():
    return lambda images, prompts: images.float().mean(dim=(1, 2, 3))


@register_reward("slow_red")
def slow_red():
    def score(images, prompts):
        time.sleep(0.3)  # a slow model: requests pile up meanwhile
        return images[:, 0].mean((1, 2)) - images[:, 1:].mean((1, 2, 3))
    return score


@register_reward("hangs")
def hangs():
    def score(images, prompts):
        time.sleep(3)  # a reward that blocks far longer than the server allows
        return images.float().mean(dim=(1, 2, 3))
    return score


@register_reward("broken")
def broken():
    def score(images, prompts):
        raise RuntimeError("weights not loaded")
    return score
'''
SPEC = "srv_rewards:bright=1.0,srv_rewards:slow_red=0.5"


class Server:
    """``python -m chunk_grpo.reward_server`` on a free loopback port, stopped by `stop`."""

    def __init__(self, spec: str, root: Path, *extra: str):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(root)]),
                   OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "chunk_grpo.reward_server", "--reward.name", spec, "--port", "0",
             "--max-batch", "16", "--batch-wait-ms", "50", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout=120)  # imports torch: slow on a loaded machine, never unbounded
        if not line or "serving" not in line[0]:
            self.stop()
            raise RuntimeError(f"reward server did not start: {line} {self.proc.stderr.read()}")
        self.url = line[0].split(" on ")[1].strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


def _write_module(root: Path) -> None:
    (root / "srv_rewards.py").write_text(MODULE)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    _write_module(root)
    sys.path.insert(0, str(root))  # the local reference imports the same module
    server = Server(SPEC, root)
    yield server
    server.stop()
    sys.path.remove(str(root))


def _images(n: int, seed: int, size: int = 8) -> torch.Tensor:
    """Images on the 8-bit grid the wire carries, so both sides see the same pixels."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=gen).float() / 255


def test_wire_format_round_trips():
    images = _images(3, 0)
    back, prompts = decode_score_request(encode_score_request(images, ["a", "b", "c"]))
    assert torch.equal(back, images) and prompts == ["a", "b", "c"]
    with pytest.raises(ValueError, match="expected 576 pixel bytes"):
        decode_score_request(encode_score_request(images, ["a", "b", "c"])[:-1])


def test_round_trip_equals_the_local_reward(served):
    remote = RemoteReward(served.url)
    assert remote.health()["reward"] == SPEC
    images, prompts = _images(5, 1), ["p"] * 5
    local = build_reward(SPEC)(images, prompts)
    torch.testing.assert_close(remote(images, prompts), local, rtol=0, atol=0)
    # Through the trainer's path: "remote:URL" in a spec, mixed with a local reward.
    mix = build_reward(f"remote:{served.url}=2.0,srv_rewards:bright=1.0")
    torch.testing.assert_close(mix(images, prompts), 2 * local + build_reward(
        "srv_rewards:bright")(images, prompts))


def test_concurrent_requests_are_batched(served):
    remote = RemoteReward(served.url)
    before = remote.health()
    results, requests = {}, 6
    threads = [threading.Thread(target=lambda i=i: results.update({i: remote(
        _images(2, 10 + i), ["p", "q"])})) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    after = remote.health()
    assert after["requests"] - before["requests"] == requests
    assert after["images"] - before["images"] == 2 * requests
    assert after["calls"] - before["calls"] < requests  # several requests per reward call
    local = build_reward(SPEC)
    for i in range(requests):  # each request got its own rows back
        torch.testing.assert_close(results[i], local(_images(2, 10 + i), ["p", "q"]))


class InProcessServer:
    """The same server (`reward_server.serve`) on a thread of this process: no start-up cost."""

    def __init__(self, spec: str, **options):
        self.server, self.scorer = serve(spec, "127.0.0.1", 0, **{"max_batch": 16, **options})
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.scorer.stop()


def test_a_reward_failing_on_the_server_is_named_at_once(served):
    server = InProcessServer("srv_rewards:broken")
    try:
        start = time.monotonic()
        with pytest.raises(RewardOutputError, match="answered HTTP 500: reward "
                                                    "'srv_rewards:broken' raised RuntimeError"):
            RemoteReward(server.url, backoff=5.0)(_images(1, 0), ["p"])
        assert time.monotonic() - start < 5  # not retried: the answer would be the same
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_down_is_a_quick_clear_error():
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RewardUnavailableError) as err:
        RemoteReward(url, retries=2, backoff=0.05)(_images(1, 0), ["p"])
    assert time.monotonic() - start < 5
    message = str(err.value)
    assert message.startswith(f"reward server {url} did not answer /score after 3 attempts")
    assert "python -m chunk_grpo.reward_server --reward.name NAME" in message


def test_a_server_that_never_answers_times_out():
    with socket.socket() as silent:  # accepts connections (backlog) but never replies
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        start = time.monotonic()
        with pytest.raises(RewardUnavailableError, match="timed out"):
            RemoteReward(url, read_timeout=0.3, retries=1, backoff=0.0)(_images(1, 0), ["p"])
        assert time.monotonic() - start < 5


def test_bad_server_urls_are_config_errors():
    for spec in ("remote:localhost:8000", "remote:http://127.0.0.1"):
        with pytest.raises(ConfigError, match="remote:http://HOST:PORT"):
            build_config(None, {"reward.name": spec})


@pytest.mark.slow
def test_a_run_whose_reward_server_dies_stops_with_an_intact_checkpoint(tiny_flux, tmp_path,
                                                                        capsys):
    _write_module(tmp_path)
    server = Server("srv_rewards:bright", tmp_path)
    model = tiny_flux
    cfg = tiny_config(model, tmp_path / "run", {"reward.name": f"remote:{server.url}",
                                                "run.max_steps": 3,
                                                "run.checkpoint_every": 1})

    def kill_after_first_step(step, metrics):
        if step == 1:
            server.stop()

    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stop:
            run_command(lambda: run(cfg, on_step_end=kill_after_first_step), "prog",
                        errors=(RewardUnavailableError,))
    finally:
        server.stop()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("prog: error:") == 1
    line = err.splitlines()[-1]
    kept = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert line.startswith(f"prog: error: reward server {server.url} did not answer /score")
    assert f"the run stopped at step 2, its last checkpoint {kept} is intact" in line
    assert latest_checkpoint(tmp_path / "run") == kept
    # The reward is back (on another port): the run resumes from that checkpoint and finishes.
    sys.path.insert(0, str(tmp_path))
    again = InProcessServer("srv_rewards:bright")
    try:
        resumed = tiny_config(model, tmp_path / "run", {"reward.name": f"remote:{again.url}",
                                                        "run.max_steps": 3,
                                                        "run.checkpoint_every": 1})
        run(resumed, run_dir=tmp_path / "run", resume=True)
    finally:
        again.stop()
        sys.path.remove(str(tmp_path))
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    assert latest_checkpoint(tmp_path / "run").name == "step-00000003"


# ----------------------------------------------------------------------------- bounds

def _request(url: str, method: str = "POST", route: str = "/score", body: bytes = b"",
             headers: dict | None = None) -> tuple[int, dict]:
    """One raw request: (status, JSON answer)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=20)
    try:
        conn.request(method, route, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        conn.close()


@pytest.fixture
def bright(served):
    """An in-process server of a fast reward (its module is importable through `served`)."""
    servers = []

    def start(**options):
        servers.append(InProcessServer("srv_rewards:bright", **options))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def test_200_concurrent_clients_each_get_an_answer(bright):
    server = bright()  # 16 threads, 64 waiting: beyond that 503, never a reset
    body = encode_score_request(_images(1, 0), ["p"])
    statuses, errors = [], []

    def client():
        try:
            statuses.append(_request(server.url, body=body)[0])
        except OSError as err:
            errors.append(err)

    start = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(statuses) == 200
    assert set(statuses) <= {200, 503} and statuses.count(200) >= 80
    assert time.monotonic() - start < 20


def test_a_saturated_server_answers_503_at_once(served):
    server = InProcessServer("srv_rewards:slow_red", threads=1, queue_size=1, batch_wait=0)
    try:
        body = encode_score_request(_images(1, 0), ["p"])
        statuses = []
        threads = [threading.Thread(target=lambda: statuses.append(
            _request(server.url, body=body))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        codes = [status for status, _ in statuses]
        assert len(codes) == 6 and set(codes) == {200, 503} and codes.count(200) >= 2
        assert all("busy" in answer["error"] for status, answer in statuses if status == 503)
    finally:
        server.stop()


def test_huge_bodies_are_refused_before_they_are_read(bright):
    server = bright(limits=Limits(max_body=1 << 20))
    for claim in (200 << 20, 50 << 30):  # 200 MB and 50 GB claimed, 100 bytes sent
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.server.server_address[1])) as sock:
            sock.sendall(f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: {claim}\r\n\r\n"
                         .encode() + b"x" * 100)
            answer = sock.makefile("rb").read()
        assert answer.startswith(b"HTTP/1.1 413") and b"--max-body-mb" in answer
        assert time.monotonic() - start < 3
    status, _ = _request(server.url, body=encode_score_request(_images(1, 0), ["p"]))
    assert status == 200  # still serving


def test_a_slow_client_is_dropped_and_others_are_served(bright):
    server = bright(threads=2, limits=Limits(read_timeout=0.5))
    port = server.server.server_address[1]
    with socket.create_connection(("127.0.0.1", port)) as slow:
        slow.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                     + b"x" * 10)  # then nothing
        status, _ = _request(server.url, body=encode_score_request(_images(1, 0), ["p"]))
        assert status == 200  # another thread serves meanwhile
        start = time.monotonic()
        slow.settimeout(10)
        answer = slow.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - start < 5


def test_bad_requests_are_4xx_with_a_message(bright):
    server = bright()

    def body(header: bytes, pixels: bytes = b"") -> bytes:
        return len(header).to_bytes(4, "big") + header + pixels

    cases = [
        (dict(body=body(b'{"shape": [1, 3, Infinity, 2], "prompts": ["p"]}')), 400, "shape"),
        (dict(body=body(b'{"shape": [1, 3, 1, 1], "prompts": "p"}')), 400, "prompts"),
        (dict(body=body(b'{"shape": [1, 3, 1, 2], "prompts": ["p"]}', b"x")), 400,
         "pixel bytes"),
        (dict(body=b"", headers={"Content-Length": "abc"}), 400, "Content-Length"),
        (dict(method="PUT"), 405, "PUT is not served"),
        (dict(route="/nowhere"), 404, "no route"),
    ]
    for kwargs, status, words in cases:
        got, answer = _request(server.url, **kwargs)
        assert got == status and words in answer["error"], (kwargs, got, answer)


def test_a_reward_that_hangs_is_504_and_the_client_says_so(served):
    server = InProcessServer("srv_rewards:hangs", limits=Limits(score_timeout=0.3))
    try:
        status, answer = _request(server.url, body=encode_score_request(_images(1, 0), ["p"]))
        assert status == 504 and "--score-timeout" in answer["error"]
        with pytest.raises(RewardUnavailableError, match="answered /score with HTTP 504 2 times: "
                                                         "its reward did not finish"):
            RemoteReward(server.url, retries=1, backoff=0)(_images(1, 0), ["p"])
    finally:
        server.stop()


def test_a_token_is_required_when_configured(bright, tmp_path, monkeypatch):
    server = bright(limits=Limits(token="s3cret"))
    assert _request(server.url, "GET", "/health")[0] == 401
    wrong = {"Authorization": "Bearer nope"}
    status, answer = _request(server.url, body=b"x" * 10, headers=wrong)
    assert status == 401 and "bearer token" in answer["error"]
    with pytest.raises(RewardOutputError, match="HTTP 401: missing or wrong bearer token"):
        RemoteReward(server.url)(_images(1, 0), ["p"])
    (tmp_path / "token").write_text("s3cret\n")
    monkeypatch.setenv("CHUNK_GRPO_REWARD_TOKEN_FILE", str(tmp_path / "token"))
    assert RemoteReward(server.url).health()["reward"] == "srv_rewards:bright"


def test_bad_server_flags_are_one_line_and_a_public_host_is_warned_of(capsys):
    for flags in (["--port", "-1"], ["--port", "0", "--batch-wait-ms", "nan"],
                  ["--port", "0", "--token-file", "/nonexistent/token"]):
        with pytest.raises(SystemExit) as stop:
            server_main(["--reward.name", "srv_rewards:bright", *flags])
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and "error:" in err[-1], flags
    assert [is_loopback(h) for h in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "10.1.2.3")] \
        == [True, True, True, False, False]


def test_server_settings_are_the_configs_reward_keys(capsys):
    from chunk_grpo.cli.reward_server import reward_server_parser

    own, cfg = reward_server_parser().parse_config(
        ["--reward.name", "a=1.0,b=0.5", "--reward.device", "cuda:1", "--port", "0"])
    assert (cfg.reward.name, cfg.reward.device, own["port"]) == ("a=1.0,b=0.5", "cuda:1", 0)
    for argv, message in (
            (["--reward", "shapes", "--port", "0"], "--reward is a section; set its keys, e.g. "
                                                     "--reward.name VALUE"),
            (["--reward.name", "shapes", "--device", "cpu", "--port", "0"],
             "did you mean 'reward.device'?"),
            (["--reward.name", "shapes", "--reward.device", "gpu", "--port", "0"],
             "reward.device must be '' (the reward's own default), cpu, cuda or cuda:N"),
            (["--reward.name", "a=x", "--port", "0"], "reward.name: reward entry 'a=x'"),
            (["--port", "0"], "--reward.name is required")):
        with pytest.raises(SystemExit) as stop:
            server_main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and message in err[0], (argv, err)
