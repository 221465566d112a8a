"""``edge chat`` (cli/chat.py over runtime/chat.py): a conversation with one engine kept up between turns.

The engine test drives the real command through a pseudo-terminal, as a person would: a question, its answer,
a follow-up, Ctrl-C in the middle of a long answer (the chat goes on), then Ctrl-D: exit 0 within seconds and
no engine process left.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import pty
import select
import shutil
import subprocess
import sys
import termios
import time

import psutil
import pytest
from servers import DEMO_QUESTION

from edge_core.artifact import DEMO_MODEL, DEMO_MODEL_HD16
from edge_core.runtime.chat import ChatSession, Turn

NEEDS = [name for name in ("vllm", "edge_cpu") if importlib.util.find_spec(name) is None]


def edge(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edge_core", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_each_question_carries_the_conversation_so_far():
    chat = ChatSession.__new__(ChatSession)  # the history alone: no plan, no engine
    chat.system, chat.turns = "Be brief.", [Turn("Hi?", "Hello.", "stop", 2, 0.1, 10.0)]
    assert chat.messages("And you?") == (
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "And you?"})


@pytest.mark.skipif(importlib.util.find_spec("edge_cpu") is None, reason="needs edge-cpu (a device to plan on)")
def test_a_base_model_without_a_chat_template_is_refused_with_the_way_to_complete_text(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(DEMO_MODEL, base)
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    proc = edge("chat", "--model", str(base))
    assert proc.returncode == 2, proc.stderr
    assert "has no chat template" in proc.stderr and "edge run --raw" in proc.stderr
    assert "engine log" not in proc.stderr  # nothing started


@pytest.mark.skipif(importlib.util.find_spec("edge_cpu") is None, reason="needs edge-cpu (a device to plan on)")
def test_a_refused_plan_exits_2_before_anything_loads(tmp_path):
    record = tmp_path / "chat.json"
    proc = edge("chat", "--model", str(DEMO_MODEL_HD16), "--json", str(record))
    assert proc.returncode == 2, proc.stderr
    doc = json.loads(record.read_text())
    assert doc["schema"] == "edge.chat" and doc["outcome"] == "refused"
    assert [r["code"] for r in doc["plan"]["refusals"]] == ["kernel_unsupported"]


def test_chat_help_says_how_to_leave():
    out = " ".join(edge("chat", "--help").stdout.split())
    for words in ("Ctrl-D", "/bye", "Ctrl-C stops an answer", "--max-tokens", "--system"):
        assert words in out, words


def _controlling_terminal() -> None:
    """In the child: a session of its own whose controlling terminal is the pty, so Ctrl-C there is a SIGINT."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A command on a pseudo-terminal: write keys, read what it shows until a marker appears."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.fd, child = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=child, stdout=child, stderr=child, env=env, close_fds=True,
                                     preexec_fn=_controlling_terminal)
        os.close(child)
        self.seen = ""

    def read_until(self, marker: str, timeout: float) -> str:
        """Everything shown from now until ``marker`` has been shown (and the marker)."""
        start = len(self.seen)
        deadline = time.monotonic() + timeout
        while marker not in self.seen[start:]:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None and not select.select([self.fd], [], [], 0)[0]:
                raise AssertionError(f"{marker!r} not shown within {timeout} s; the screen ends:\n{self.seen[-3000:]}")
            if select.select([self.fd], [], [], min(remaining, 0.5))[0]:
                try:
                    self.seen += os.read(self.fd, 65536).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    pass
        return self.seen[start:]

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.fd)


@pytest.mark.vllm
@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(bool(NEEDS), reason=f"needs the real vLLM CPU build and edge-cpu; missing: {NEEDS}")
def test_a_conversation_in_a_terminal(demo_model, tmp_path):
    record = tmp_path / "chat.json"
    env = {**os.environ, "EDGE_LEDGER_DIR": str(tmp_path / "ledger"), "TERM": "dumb"}
    terminal = Terminal([sys.executable, "-m", "edge_core", "chat", "--max-model-len", "1024", "--json", str(record)],
                        env)
    try:
        terminal.read_until("ready.", 300)
        terminal.read_until(">>> ", 30)
        engines = [p.pid for p in psutil.Process(terminal.proc.pid).children(recursive=True)]
        terminal.type(DEMO_QUESTION + "\r")
        first = terminal.read_until(">>> ", 120)
        assert "Paris" in first, first
        terminal.type("Say that again in one word.\r")
        second = terminal.read_until(">>> ", 120)
        assert second.strip().splitlines()[1:], second  # an answer below the echoed question
        terminal.type("Write a long story about a lighthouse keeper and the sea.\r")
        terminal.read_until("\n", 60)  # the echoed question
        terminal.read_until(" ", 60)  # the answer has begun
        terminal.type("\x03")  # Ctrl-C: stop this answer, keep the chat
        stopped = terminal.read_until(">>> ", 60)
        assert "answer stopped" in stopped and "the chat goes on" in stopped, stopped
        terminal.type("\x04")  # Ctrl-D: leave
        asked = time.monotonic()
        assert terminal.proc.wait(timeout=30) == 0, terminal.seen[-3000:]
        assert time.monotonic() - asked < 10, "leaving took longer than 10 s"
        assert not [pid for pid in engines if psutil.pid_exists(pid)], "an engine process outlived the chat"
    finally:
        terminal.close()
    doc = json.loads(record.read_text())
    assert doc["schema"] == "edge.chat" and doc["outcome"] == "ended"
    assert [t["cancelled"] for t in doc["turns"]] == [False, False, True]
    assert "Paris" in doc["turns"][0]["answer"]
    assert doc["memory"]["ratio"] is not None


@pytest.mark.parametrize("files,source", [
    ({"chat_template.jinja": "{{ messages }}"}, "chat_template.jinja"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"})}, "tokenizer_config.json"),
    ({"tokenizer_config.json": json.dumps({"bos_token": "<s>"})}, None),
    ({"tokenizer_config.json": "{not json"}, None),
    ({}, None),
])
def test_where_a_checkpoint_keeps_its_chat_template(tmp_path, files, source):
    from edge_core.artifact.tokenizer import chat_template_source

    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert chat_template_source(tmp_path) == source
