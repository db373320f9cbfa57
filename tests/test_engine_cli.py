"""``rollbus engine`` as shipped: flags, checkpoint save/load and serving from a real subprocess."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from rollbus.services.engine.main import add_arguments, run
from rollbus.tokenizer import SpecialIds, load_tokenizer
from tests.waiting import until_sync

TINY_FLAGS = "--hidden-size 32 --layers 1 --heads 2 --kv-heads 1 --intermediate-size 64".split()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(client: httpx.Client, process: subprocess.Popen, deadline_s: float = 180) -> None:
    def healthy() -> bool:
        assert process.poll() is None, process.stderr.read()
        try:
            return client.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    until_sync(healthy, "the engine healthy", timeout=deadline_s, interval=0.3)


def test_saved_checkpoint_is_served_with_the_scripted_policy(tmp_path: Path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    checkpoint = tmp_path / "ckpt"
    assert run(parser.parse_args([*TINY_FLAGS, "--seed", "3", "--save-checkpoint", str(checkpoint)])) == 0
    assert json.loads((checkpoint / "config.json").read_text())["hidden_size"] == 32
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"turns": ["hello from the script"]}))
    port = free_port()
    command = [sys.executable, "-m", "rollbus", "engine", "--port", str(port), "--threads", "1",
               "--model-path", str(checkpoint), "--policy", "scripted", "--script", str(script)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            wait_healthy(client, process)
            info = client.get("/get_model_info").json()
            assert info["model_path"] == str(checkpoint) and info["policy"] == "scripted"
            tokenizer = load_tokenizer("qwen3.6")
            prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                                      add_special_tokens=False)
            body = client.post("/generate", json={"input_ids": prompt, "return_logprob": True}).json()
            assert body["text"] == "hello from the script"
            im_end = SpecialIds.from_tokenizer(tokenizer).im_end
            assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": im_end}
    finally:
        process.terminate()
        process.wait(timeout=30)
