"""The VLM-judge reward (`judge:`) against a real chat-completions server on 127.0.0.1: the server
checks each request's shape and answers with a score made from the image's mean brightness (as
text, or as yes/no logprobs), so the scores are known. Also: the bound on concurrent requests,
retries on 503/429, a timeout, a server that is down, malformed replies, the options' errors, and
a training step whose reward is the judge."""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from trainer_utils import tiny_config

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.config.parsing import build_config
from chunk_grpo.config.reward_spec import RewardSpecError
from chunk_grpo.rewards import RewardUnavailableError, build_reward, get_reward
from chunk_grpo.rewards.judge_options import judge_options
from chunk_grpo.rewards.outputs import RewardOutputError
from chunk_grpo.train.loop import run
from chunk_grpo.train.metrics import read_metrics
from chunk_grpo.train.setup import check_reward_name

# tiny_config's default reward, registered for each test
pytestmark = pytest.mark.usefixtures("brightness_reward")

MODEL = "judge-test-vl"
TEMPLATE = "Rate how well this image shows: {prompt}. Reply 'Score: N' from 1 to 10."


class JudgeServer:
    """A chat-completions server in a thread. Each image's score is its mean brightness b (of
    the decoded 8-bit image): the text "... Score: {1 + 9 b}" and, when asked for logprobs, a
    first token whose top_logprobs give "Yes"/" yes" 0.9 b and "no" 0.9 (1 - b). Knobs:
    ``fail`` (statuses to answer first, one per request), ``delay`` (seconds before answering),
    ``reply`` (a raw body to send instead), ``logprobs`` (False: never send them)."""

    def __init__(self):
        self.fail: list[int] = []
        self.delay = 0.0
        self.reply: bytes | None = None
        self.logprobs = True
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.brightness: list[float] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with server.lock:
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    fail = server.fail.pop(0) if server.fail else None
                try:
                    time.sleep(server.delay)
                    if fail is not None:
                        return self._send(fail, b'{"error": {"message": "busy"}}')
                    status, answer = server.answer(self.path, json.loads(body),
                                                   dict(self.headers))
                    self._send(status, answer)
                finally:
                    with server.lock:
                        server.in_flight -= 1

        return Handler

    def answer(self, path: str, request: dict, headers: dict) -> tuple[int, bytes]:
        try:
            b, rejected = check_request(path, request), None
        except AssertionError as err:  # a malformed request: 400 with the reason, like vLLM
            b, rejected = None, f"bad request: {err}"
        with self.lock:  # brightness[i] is the image of requests[i]
            self.requests.append(request)
            self.headers.append(headers)
            self.brightness.append(b)
        if rejected:
            return 400, json.dumps({"object": "error", "message": rejected}).encode()
        if self.reply is not None:
            return 200, self.reply
        choice = {"index": 0, "finish_reason": "stop",
                  "message": {"role": "assistant", "content": f"Looks fine. Score: {1 + 9 * b}"}}
        if request.get("logprobs") and self.logprobs:
            top = [{"token": "Yes", "logprob": math.log(0.9 * b * 0.6)},
                   {"token": " yes", "logprob": math.log(0.9 * b * 0.4)},
                   {"token": "no", "logprob": math.log(0.9 * (1 - b))},
                   {"token": "Maybe", "logprob": math.log(0.1)}]
            choice["logprobs"] = {"content": [{"token": "Yes", "logprob": top[0]["logprob"],
                                               "top_logprobs": top[:request["top_logprobs"]]}]}
        return 200, json.dumps({"object": "chat.completion", "model": request.get("model"),
                                "choices": [choice]}).encode()


def check_request(path: str, request: dict) -> float:
    """The request's image brightness after checking its shape (AssertionError otherwise)."""
    assert path == "/v1/chat/completions", path
    assert request["model"] == MODEL, request.get("model")
    assert request["temperature"] == 0.0 and request["max_tokens"] >= 1
    user = request["messages"][-1]
    assert user["role"] == "user" and len(user["content"]) == 2
    picture, text = user["content"]
    assert picture["type"] == "image_url" and text["type"] == "text"
    head, _, data = picture["image_url"]["url"].partition(",")
    assert head in ("data:image/png;base64", "data:image/jpeg;base64"), head
    assert text["text"].startswith("Rate how well this image shows: "), text["text"]
    assert "{prompt}" not in text["text"]
    pixels = np.asarray(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
    return float(pixels.mean() / 255.0)


@pytest.fixture
def server():
    srv = JudgeServer()
    yield srv
    srv.stop()


def _images(n: int, seed: int = 0) -> torch.Tensor:
    """n images of distinct mean brightness between 0.15 and 0.85 (noise around a level)."""
    g = torch.Generator().manual_seed(seed)
    levels = torch.linspace(0.15, 0.85, n).view(n, 1, 1, 1)
    return (levels + 0.1 * (torch.rand(n, 3, 16, 16, generator=g) - 0.5)).clamp(0, 1)


def _brightness_8bit(images: torch.Tensor) -> torch.Tensor:
    """The mean brightness the server sees: the images rounded to 8 bits."""
    return (images.clamp(0, 1) * 255).round().mean(dim=(1, 2, 3)) / 255


def _judge(server: JudgeServer, **options):
    base = dict(model=MODEL, template=TEMPLATE, backoff=0.01)
    return get_reward("judge", base_url=server.url, **(base | options))


PROMPTS = [f"a {c} circle" for c in ("red", "blue", "green", "yellow", "white", "black")]


def test_scores_from_the_reply_text_are_the_images_brightness(server):
    images = _images(6)
    judge = _judge(server, score="number", pattern=r"Score:\s*([0-9.]+)", score_range=[1, 10],
                   system="You judge images.")
    scores = judge(images, PROMPTS)
    torch.testing.assert_close(scores, _brightness_8bit(images), atol=1e-6, rtol=0)
    assert len(server.requests) == 6 and len(set(server.brightness)) == 6
    first = server.requests[0]
    assert first["messages"][0] == {"role": "system", "content": "You judge images."}
    assert "logprobs" not in first  # only asked for in yes_probability mode
    texts = sorted(r["messages"][-1]["content"][1]["text"] for r in server.requests)
    assert texts == sorted(TEMPLATE.replace("{prompt}", p) for p in PROMPTS)


def test_scores_from_yes_no_logprobs(server):
    images = _images(5, seed=1)
    scores = _judge(server, top_logprobs=3, image_format="jpeg")(images, PROMPTS[:5])
    # p(yes) / (p(yes) + p(no)) = b of the JPEG the server decoded ("Yes" and " yes" summed)
    torch.testing.assert_close(scores, torch.tensor(server.brightness)[_order(server, images)],
                               atol=1e-6, rtol=0)
    torch.testing.assert_close(scores, _brightness_8bit(images), atol=0.02, rtol=0)  # JPEG loss
    assert all(r["logprobs"] is True and r["top_logprobs"] == 3 for r in server.requests)
    # with only the top 1 token ("Yes"), p(yes) / (p(yes) + 0) = 1
    assert _judge(server, top_logprobs=1)(images[:2], PROMPTS[:2]).tolist() == [1.0, 1.0]


def _order(server: JudgeServer, images: torch.Tensor) -> list[int]:
    """For each image, the index of its request in the server's record (requests overlap)."""
    seen = {r["messages"][-1]["content"][1]["text"]: i for i, r in enumerate(server.requests)}
    return [seen[TEMPLATE.replace("{prompt}", p)] for p in PROMPTS[:len(images)]]


@pytest.mark.parametrize("bound", [1, 3])
def test_requests_in_flight_never_exceed_max_concurrency(server, bound):
    server.delay = 0.2  # each answer takes a while, so the requests pile up to the bound
    judge = _judge(server, max_concurrency=bound)
    start = time.monotonic()
    judge(_images(6), PROMPTS)
    assert server.max_in_flight == bound
    assert time.monotonic() - start >= 0.2 * math.ceil(6 / bound) - 0.05


def test_503_and_429_are_retried_with_backoff(server):
    server.fail = [503, 429]
    start = time.monotonic()
    scores = _judge(server, retries=2, backoff=0.1)(_images(1), PROMPTS[:1])
    assert time.monotonic() - start >= 0.1 + 0.2  # waited 0.1 s, then 0.2 s
    torch.testing.assert_close(scores, _brightness_8bit(_images(1)), atol=1e-6, rtol=0)
    assert len(server.requests) == 1  # the two failures never reached `answer`
    server.fail = [503, 503, 429]
    with pytest.raises(RewardUnavailableError) as err:
        _judge(server, retries=2)(_images(1), PROMPTS[:1])
    assert str(err.value) == (
        f"judge {server.url}/v1/chat/completions did not answer after 3 attempts (last: HTTP "
        f"429); the server is overloaded or failing: lower max_concurrency (now 8) or raise "
        f"retries and backoff")


def _unavailable(judge, n: int) -> tuple[str, float]:
    """The one-line message of the RewardUnavailableError scoring n images raises, and the
    seconds it took."""
    start = time.monotonic()
    with pytest.raises(RewardUnavailableError) as err:
        judge(_images(n), PROMPTS[:n])
    assert "\n" not in str(err.value)
    return str(err.value), time.monotonic() - start


def test_a_slow_server_times_out_in_one_line(server):
    server.delay = 2.0
    message, seconds = _unavailable(_judge(server, timeout=0.3, retries=1), 1)
    assert seconds < 1.9  # two attempts of 0.3 s, not the server's 2 s
    assert message.startswith(f"judge {server.url}/v1/chat/completions did not answer after 2 "
                              f"attempts (last: TimeoutError: timed out)")
    assert message.endswith("raise the judge's timeout (now 0.3 s) or lower max_concurrency "
                            "(now 8)")


def test_a_server_that_is_down_is_a_one_line_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once closed
    judge = get_reward(f"judge:http://127.0.0.1:{port}", retries=2, backoff=0.01)
    message, seconds = _unavailable(judge, 2)
    assert seconds < 5
    assert message.startswith(f"judge http://127.0.0.1:{port}/v1/chat/completions did not "
                              f"answer after 3 attempts (last: ConnectionRefusedError")
    assert message.endswith("start the server (e.g. `vllm serve MODEL --port PORT`) or fix "
                            "base_url")


@pytest.mark.parametrize("reply, options, expected", [
    (b"<html>oops</html>", {}, "sent a reply that is not JSON: b'<html>oops</html>'"),
    (b'{"id": "x"}', {}, "sent a reply without choices[0].message.content"),
    (json.dumps({"choices": [{"message": {"content": "I cannot rate this."}}]}).encode(),
     {"score": "number", "pattern": r"Score:\s*([0-9.]+)"},
     "the reply 'I cannot rate this.' has no match of pattern 'Score:\\\\s*([0-9.]+)'"),
    (json.dumps({"choices": [{"message": {"content": "yes"}}]}).encode(), {},
     "sent no top_logprobs for the first token (score: yes_probability needs them)"),
    (json.dumps({"choices": [{"message": {"content": "Blue"}, "logprobs": {"content": [
        {"token": "Blue", "logprob": 0.0, "top_logprobs": [
            {"token": "Blue", "logprob": -0.1}]}]}}]}).encode(), {},
     "neither 'yes' nor 'no' is among the first token's top 20 (reply 'Blue')"),
])
def test_malformed_replies_are_one_line_errors(server, reply, options, expected):
    server.reply = reply
    with pytest.raises(RewardOutputError) as err:
        _judge(server, **options)(_images(1), PROMPTS[:1])
    assert expected in str(err.value) and "\n" not in str(err.value)
    assert len(server.requests) == 1  # a reply is never retried


def test_unparsed_score_replaces_a_reply_without_a_score(server):
    server.reply = json.dumps({"choices": [{"message": {"content": "no idea"}}]}).encode()
    scores = _judge(server, score="number", unparsed_score=0.0)(_images(2), PROMPTS[:2])
    assert scores.tolist() == [0.0, 0.0]


def test_a_rejected_request_is_reported_at_once_with_the_servers_message(server, monkeypatch):
    with pytest.raises(RewardOutputError) as err:
        _judge(server, model="another-model")(_images(1), PROMPTS[:1])
    assert str(err.value) == (f"judge {server.url}/v1/chat/completions answered HTTP 400: bad "
                              f"request: another-model")
    assert len(server.requests) == 1
    monkeypatch.setenv("JUDGE_TEST_KEY", "secret")
    _judge(server, api_key_env="JUDGE_TEST_KEY")(_images(1), PROMPTS[:1])
    assert server.headers[-1]["Authorization"] == "Bearer secret"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    _judge(server)(_images(1), PROMPTS[:1])
    assert "Authorization" not in server.headers[-1]


def test_options_file_and_a_base_url_ending_in_v1(server, tmp_path):
    path = tmp_path / "judge.json"
    path.write_text(json.dumps({"base_url": f"{server.url}/v1", "model": MODEL,
                                "template": TEMPLATE, "score": "number",
                                "pattern": r"Score:\s*([0-9.]+)", "score_range": [1, 10]}))
    mix = build_reward(f"judge:{path}=2.0,test_brightness=0.5")
    images = _images(3)
    scores = mix.score(images, PROMPTS[:3])
    label = next(label for label in scores if label.startswith("judge"))
    torch.testing.assert_close(scores[label], _brightness_8bit(images), atol=1e-6, rtol=0)
    assert server.requests and mix.weights[label] == 2.0


@pytest.mark.parametrize("text, message", [
    ("base_url: http://127.0.0.1:8000\nmax_concurency: 4\n",
     "unknown judge option 'max_concurency' in '{path}'; did you mean 'max_concurrency'?"),
    ("model: x\n", "judge options '{path}' have no base_url; add e.g. `base_url: "
                   "http://127.0.0.1:8000`"),
    ("base_url: 127.0.0.1:8000\n", "judge base_url '127.0.0.1:8000': write "
                                   "http(s)://HOST[:PORT][/PREFIX]"),
    ("base_url: http://h:1\nscore: logits\n",
     "judge option score must be one of number, yes_probability, got 'logits'"),
    ("base_url: http://h:1\ntemplate: 'Is this {caption}?'\n",
     "judge option template has the placeholder {caption}; the only placeholder is {prompt}"),
    ("base_url: http://h:1\nscore_range: [10, 1]\n",
     "judge option score_range must be [lo, hi] with lo < hi"),
    ("base_url: http://h:1\nmax_concurrency: 0\n", "judge option max_concurrency must be >= 1"),
    ("base_url: http://h:1\ntimeout: fast\n", "judge option timeout: expects float, got 'fast'"),
    ("- a list\n", "judge options file '{path}' must hold a mapping of options"),
    ("base_url: http://h:1\ntemplate: 'Reply 'yes' or 'no''\n",
     "judge options file '{path}' line 2, column 19 is not valid YAML or JSON"),
])
def test_bad_options_are_one_line_errors_before_anything_loads(tmp_path, text, message):
    path = tmp_path / "judge.yaml"
    path.write_text(text)
    with pytest.raises(RewardSpecError) as err:
        judge_options(str(path))
    assert message.replace("{path}", str(path)) in str(err.value)
    assert "\n" not in str(err.value)
    cfg = build_config(None, {"reward.name": f"judge:{path}"})  # the spec parses ...
    with pytest.raises(ConfigError, match="^reward: "):  # ... the options fail at the check
        check_reward_name(cfg)


def test_bad_judge_specs_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="name the judge's server or options file"):
        build_config(None, {"reward.name": "judge:"})
    for spec, fragment in ((f"judge:{tmp_path}/none.yaml", "does not exist"),
                           ("judge:localhost:8000", "name the judge's server or options file")):
        with pytest.raises(ConfigError, match=fragment):
            check_reward_name(build_config(None, {"reward.name": spec}))
    with pytest.raises(ValueError, match="a judge needs its server"):
        get_reward("judge")


def test_the_shipped_judge_configs_parse():
    qwen = judge_options("configs/judges/qwen2_5_vl_7b_yes_no.yaml")
    assert qwen["model"] == "Qwen/Qwen2.5-VL-7B-Instruct"
    assert qwen["score"] == "yes_probability"
    unified = get_reward("judge:configs/judges/unifiedreward_qwen_7b.yaml").options
    assert unified.score == "number" and unified.score_range == [1, 5]
    from chunk_grpo.rewards.judge import _number
    assert _number("The caption matches.\nFinal Score: 4.5", unified) == pytest.approx(0.875)


@pytest.mark.slow
def test_a_training_step_scores_its_rollouts_with_the_judge(tiny_flux, server, tmp_path):
    path = tmp_path / "judge.yaml"
    path.write_text(yaml.safe_dump({"base_url": server.url, "model": MODEL, "template": TEMPLATE,
                                    "max_concurrency": 4}))
    cfg = tiny_config(tiny_flux, tmp_path / "run", {"reward.name": f"judge:{path}",
                                                    "run.max_steps": 1,
                                                    "eval.images": 2,
                                                    "eval.final_images": 2})
    run(cfg)
    record = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    rows = cfg.sampling.prompts_per_step * cfg.sampling.group_size
    # the probe's 2 images come first, then the rollout batch: its mean is the logged reward
    rollout = server.brightness[2:2 + rows]
    assert len(rollout) == rows and server.max_in_flight <= 4
    assert record["reward_mean"] == pytest.approx(float(np.mean(rollout)), abs=1e-6)
