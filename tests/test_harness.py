"""lm-evaluation-harness adapter (``zero2all/eval/harness.py``): the same numbers as the harness's own ``hf`` model on
our HF export, and loglikelihood_rolling equal to ``z2all eval``. Skipped when lm-eval is not installed (it is the
``eval`` extra, not part of ``test``)."""

import json
import math
import random
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'zero2all[eval]')")

from data_helpers import exported_tiny_model  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "harness"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return exported_tiny_model(tmp_path_factory.mktemp("harness"), random.Random(0))


@pytest.fixture
def in_fixtures(monkeypatch, tmp_path):
    monkeypatch.chdir(FIXTURES)  # the task YAML's data_files are relative to the working directory
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def per_item(results, task):
    """Per (doc, choice) log-likelihoods of a run with log_samples."""
    out = {}
    for s in results["samples"][task]:
        for j, r in enumerate(s["filtered_resps"]):
            out[(s["doc_id"], j)] = float(r[0])
    return out


def test_multiple_choice_equals_harness_hf_model(ckpt, in_fixtures):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from zero2all.eval.harness import Z2allLM

    manager = TaskManager(include_path=[str(FIXTURES)], include_defaults=False)
    ours = simple_evaluate(model="z2all", model_args={"pretrained": str(ckpt / "ours"), "device": "cpu"},
                           tasks=["z2all_tiny_mc"], task_manager=manager, batch_size=3, log_samples=True,
                           bootstrap_iters=0)
    ref = simple_evaluate(model="hf", model_args={"pretrained": str(ckpt / "hf"), "dtype": "float32",
                                                  "device": "cpu"},
                          tasks=["z2all_tiny_mc"], task_manager=manager, batch_size=3, log_samples=True,
                           bootstrap_iters=0)
    a, b = per_item(ours, "z2all_tiny_mc"), per_item(ref, "z2all_tiny_mc")
    assert len(a) == 8 * 3 and a.keys() == b.keys()
    for k in a:
        assert abs(a[k] - b[k]) < 1e-4, (k, a[k], b[k])
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["z2all_tiny_mc"][metric] == ref["results"]["z2all_tiny_mc"][metric]
    # the long question does not fit the 32-id context: it was truncated on the left, like the harness's own
    lm = Z2allLM(pretrained=str(ckpt / "ours"), device="cpu")
    doc = [json.loads(x) for x in (FIXTURES / "tiny_mc.jsonl").read_text().splitlines()][6]
    assert len(lm.encode(doc["question"])) > 32
    # greedy flag: a continuation built from the argmax tokens is greedy, another one is not
    ctx = lm.encode("the model reads text")
    import torch

    ids = list(ctx)
    for _ in range(3):
        logits, _ = lm.model(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    (lp, greedy), (lp2, greedy2) = lm.score_pairs([(ctx, ids[len(ctx):]), (ctx, [(ids[-1] + 1) % 300] * 3)])
    assert greedy and not greedy2 and lp <= 0 and lp2 <= 0


def test_cli_tasks_and_rolling_equals_z2all_eval(ckpt, in_fixtures, tmp_path, capsys):
    from zero2all.cli import main
    from zero2all.eval.harness import Z2allLM
    from zero2all.eval.perplexity import evaluate_texts

    out = tmp_path / "tasks.json"
    assert main(["eval", "--ckpt", str(ckpt / "ours"), "--tasks", "z2all_tiny_mc,z2all_tiny_ppl", "--include-path",
                 str(FIXTURES), "--json", str(out), "--device", "cpu", "--bootstrap-iters", "0"]) == 0
    printed = capsys.readouterr().out
    assert "z2all_tiny_mc" in printed and "bits_per_byte" in printed
    got = json.loads(out.read_text())["results"]
    assert 0.0 <= got["z2all_tiny_mc"]["acc,none"] <= 1.0

    # loglikelihood_rolling: minus each document's NLL of z2all eval (perplexity.py's windows), and bits per byte
    texts = [json.loads(x)["text"] for x in (FIXTURES / "tiny_ppl.jsonl").read_text().splitlines()]
    lm = Z2allLM(pretrained=str(ckpt / "ours"), device="cpu", batch_size=2)

    class Req:
        def __init__(self, text):
            self.args = (text,)

    rolling = lm.loglikelihood_rolling([Req(t) for t in texts])
    for t, r in zip(texts, rolling):
        doc = evaluate_texts(lm.model, lm.tokenizer, [("d", t)], progress=False).overall
        assert abs(r + doc.nll) < 1e-4
    whole = evaluate_texts(lm.model, lm.tokenizer, [("d", t) for t in texts], progress=False).overall
    assert whole.tokens > 32  # the long document is scored in several windows
    assert abs(got["z2all_tiny_ppl"]["bits_per_byte,none"] - whole.nll / math.log(2) / whole.bytes) < 1e-4


def test_generate_until_stops_and_errors(ckpt, capsys, monkeypatch):
    import functools

    import lm_eval.tasks

    from zero2all.cli import main
    from zero2all.eval.harness import Z2allLM

    lm = Z2allLM(pretrained=str(ckpt / "ours"), device="cpu")

    class Req:
        def __init__(self, ctx, kw):
            self.args = (ctx, kw)

    free = lm.generate_until([Req("the model reads", {"until": [], "max_gen_toks": 12})])[0]
    assert free  # greedy, 12 tokens
    cut = free[len(free) // 2:][:2]
    stopped, again = lm.generate_until([Req("the model reads", {"until": [cut], "max_gen_toks": 12}),
                                        Req("the model reads", {"until": [], "max_gen_toks": 12})])
    assert stopped == free[:free.find(cut)] and again == free
    # a long prompt keeps its last max_length - max_gen_toks ids
    long_prompt = " ".join(["the model reads text"] * 20)
    assert isinstance(lm.generate_until([Req(long_prompt, {"max_gen_toks": 40})])[0], str)

    # (the harness's own task index takes half a minute to build: left out here)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", functools.partial(lm_eval.tasks.TaskManager,
                                                                         include_defaults=False))
    assert main(["eval", "--ckpt", str(ckpt / "ours"), "--tasks", "no_such_task_xyz", "--include-path",
                 str(FIXTURES)]) == 2
    assert "unknown task 'no_such_task_xyz'" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(ckpt / "ours")]) == 2
    assert "--data" in capsys.readouterr().err
