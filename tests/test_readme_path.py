"""README's main path runs as written: the ```bash block under "## The main path", one command after the other, in
a scratch directory that holds a copy of ``examples/`` (what a checkout has). Every file a command reads must have
been written by an earlier command or ship in ``examples/``: a README line naming anything else fails here.

Only the sizes shrink (so the whole path takes about half a minute on 2 cores): fewer documents, a smaller
vocabulary, a tiny model, a few updates, a few new tokens, one worker; the options and ``key=value`` overrides
are replaced or appended per command (``SMALLER``), the paths never. ``chat`` reads two lines from stdin, ``serve``
runs as its own process on a free port until it answers ``/health``.
"""

import glob
import io
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from zero2all.cli import main

ROOT = Path(__file__).resolve().parents[1]

TINY_MODEL = {"model.vocab_size": "384", "model.hidden_dim": "32", "model.intermediate_size": "64",
              "model.n_layers": "1", "model.n_heads": "4", "model.n_kv_heads": "2", "model.max_seq_len": "128"}
QUICK_TRAIN = {"train.max_steps": "2", "train.micro_batch_size": "2", "train.warmup_steps": "1",
               "train.eval_every": "0", "train.num_samples": "0", "train.log_every": "0", "train.ckpt_every": "0",
               "train.tensorboard": "false", "train.device": "'cpu'", "train.precision": "'fp32'"}
# per command: options set (replaced when the README gives them, else appended) and key=value overrides likewise
SMALLER = {
    "clean": ({"--max-docs": "100", "--workers": "1"}, {}),
    "train-tokenizer": ({"--vocab-size": "384"}, {}),
    "prepare": ({"--seq-len": "128", "--workers": "1", "--no-progress": None}, {}),
    "estimate": ({}, {}),
    "pretrain": ({"--no-progress": None}, {**TINY_MODEL, **QUICK_TRAIN}),
    "sft": ({"--no-progress": None}, {**QUICK_TRAIN, "data.seq_len": "128"}),
    "dpo": ({"--no-progress": None}, {**QUICK_TRAIN, "data.seq_len": "128"}),
    "generate": ({"--max-new-tokens": "4", "--device": "cpu"}, {}),
    "chat": ({"--max-new-tokens": "4", "--device": "cpu"}, {}),
    "serve": ({"--device": "cpu"}, {}),
    "eval": ({"--device": "cpu", "--no-progress": None}, {}),
    "export-hf": ({}, {}),
    "export-gguf": ({}, {}),
}
# the options whose value a command reads (the rest are outputs or settings)
INPUT_OPTIONS = {"--input", "--tokenizer", "--data", "--valid", "--init", "--ckpt"}


def main_path_commands() -> list[list[str]]:
    """The README's main-path commands, each as its argument list (continuation lines joined, comments dropped)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## The main path"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [c for c in commands if c]


def smaller(args: list[str]) -> list[str]:
    """``args`` (without the leading ``z2all``) with the sizes of ``SMALLER``; paths untouched."""
    options, overrides = SMALLER[args[0]]
    args = list(args)
    for option, value in options.items():
        if option in args:
            i = args.index(option)
            if value is not None:
                args[i + 1] = value
        else:
            args += [option] if value is None else [option, value]
    for key, value in overrides.items():
        given = [i for i, a in enumerate(args) if a.startswith(key + "=")]
        if given:
            args[given[0]] = f"{key}={value}"
        else:
            args.append(f"{key}={value}")
    return args


def read_paths(args: list[str]) -> list[str]:
    """The paths a command reads: the values of ``INPUT_OPTIONS`` (several after ``--input`` / ``--data``)."""
    paths, reading = [], False
    for a in args[1:]:
        if a.startswith("-"):
            reading = a in INPUT_OPTIONS
        elif reading and "=" not in a and a != "stdlib":
            paths.append(a)
    return paths


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(args: list[str], cwd: Path) -> None:
    """``z2all serve`` as its own process on a free port: it must answer /health and a chat request, then stop."""
    port = str(_free_port())
    args = [a if a != args[args.index("--port") + 1] else port for a in args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "zero2all.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.time() < deadline, "serve did not answer /health within 60 s"
                time.sleep(0.3)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as r:
            model = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 2}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as r:
            assert json.loads(r.read())["choices"][0]["message"]["role"] == "assistant"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_main_path_is_all_z2all_commands_with_known_sizes():
    commands = main_path_commands()
    assert len(commands) >= 12 and all(c[0] == "z2all" for c in commands), commands
    assert {c[1] for c in commands} <= set(SMALLER), "a new README command needs its sizes in SMALLER"
    # outputs of their own, apart from the demo's runs/demo/
    assert not any(a.startswith("runs/demo") for c in commands for a in c)


def test_read_paths_finds_what_a_command_reads():
    assert read_paths(["z2all", "sft", "--init", "a/final", "--data", "x.jsonl", "y.jsonl", "--out", "o",
                       "train.lr=1"]) == ["a/final", "x.jsonl", "y.jsonl"]


def test_the_readme_main_path_runs_as_written(tmp_path, monkeypatch, capsys):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    have_gguf = True
    try:
        import gguf  # noqa: F401
    except ImportError:
        have_gguf = False
    for command in main_path_commands():
        args = smaller(command[1:])
        for path in read_paths(command):
            found = glob.glob(path) if glob.has_magic(path) else Path(path).exists()
            assert found, (f"README's main path: `{shlex.join(command)}` reads {path}, which no earlier command "
                           f"wrote and examples/ does not ship")
        if args[0] == "serve":
            _serve(args, tmp_path)
            continue
        if args[0] == "export-gguf" and not have_gguf:
            continue  # the optional `gguf` package (zero2all[gguf])
        if args[0] == "chat":
            monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n/exit\n"))
        code = main(args)
        captured = capsys.readouterr()
        assert code in (0, None), f"`z2all {shlex.join(args)}` exited {code}:\n{captured.err[-2000:]}"
    assert (tmp_path / "runs" / "main" / "hf" / "config.json").is_file()
    assert json.loads((tmp_path / "runs" / "main" / "eval.json").read_text())["overall"]["tokens"] > 0
    assert not (tmp_path / "runs" / "demo").exists()
