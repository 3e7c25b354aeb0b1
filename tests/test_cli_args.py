"""Command-line argument handling without running anything heavy: parser build, --version, overrides anywhere,
options versus config files and overrides, error messages. The run functions are stubbed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import zero2all
from zero2all.cli import build_parser, main, split_overrides

ROOT = Path(__file__).resolve().parents[1]


def _python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


# ------------------------------------------------------------------------------------------ parser, --version


def test_building_the_parser_does_not_import_torch():
    out = _python("-c", "import sys; from zero2all.cli import build_parser; build_parser(); "
                        "print('torch' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_help_exits_zero():
    out = _python("-m", "zero2all.cli", "--help")
    assert out.returncode == 0, out.stderr
    for name in ("pretrain", "sft", "dpo", "bench", "--version"):
        assert name in out.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"z2all {zero2all.__version__}\n"


# ------------------------------------------------------------------------------------------ pretrain


@pytest.fixture
def pretrain_calls(monkeypatch):
    import zero2all.train.trainer as trainer

    calls = []
    monkeypatch.setattr(trainer, "pretrain", lambda cfg, show_progress=True: calls.append((cfg, show_progress)))
    return calls


def test_pretrain_overrides_anywhere(pretrain_calls):
    assert main(["pretrain", "--config", "tiny", "train.max_steps=1", "--out", "X", "train.lr=1e-3",
                 "--no-progress", "model.ops.attention=naive"]) == 0
    (cfg, show_progress), = pretrain_calls
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.out_dir) == (1, 1e-3, "X")
    assert cfg.model.ops.attention == "naive" and cfg.model.n_layers == 4 and not show_progress


def test_pretrain_options_win_over_the_config_file(tmp_path, pretrain_calls):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nn_layers = 2\nhidden_dim = 64\nn_heads = 4\nn_kv_heads = 2\nmax_seq_len = 32\n'
                    '[train]\nout_dir = "from-file"\ndevice = "cuda"\nresume = ""\n[data]\npath = "file-data"\n')
    assert main(["pretrain", "--config", str(path), "--out", "from-flag", "--data", "flag-data", "--device", "cpu",
                 "--resume", "auto"]) == 0
    t = pretrain_calls[0][0].train
    assert (t.out_dir, t.device, t.resume, pretrain_calls[0][0].data.path) == ("from-flag", "cpu", "auto",
                                                                             "flag-data")
    assert pretrain_calls[0][0].model.n_layers == 2


def test_pretrain_option_and_override_of_one_key_is_refused(pretrain_calls, capsys):
    assert main(["pretrain", "--config", "tiny", "--out", "a", "train.out_dir=b"]) == 2
    err = capsys.readouterr().err
    assert "train.out_dir: set twice, by --out and by the override 'train.out_dir=b'" in err
    assert not pretrain_calls


def test_pretrain_value_that_looks_like_an_override_stays_the_options(pretrain_calls):
    assert main(["pretrain", "--config", "tiny", "--out", "runs=1", "train.max_steps=3"]) == 0
    assert pretrain_calls[0][0].train.out_dir == "runs=1" and pretrain_calls[0][0].train.max_steps == 3


@pytest.mark.parametrize("argv, message", [
    (["train.lr=nan"], "train.lr: must be a finite number, got nan"),
    (["train.lr=-1"], "train.lr: must be positive"),
    (["train.lrr=1e-3"], "train.lrr: unknown key (did you mean 'lr'?)"),
    (["trian.lr=1e-3"], "trian: unknown key (did you mean 'train'?)"),
    (["data.num_workers=2"], "data.num_workers: was removed"),
    (["train.max_steps"], "train.max_steps': expected key=value"),
])
def test_pretrain_config_errors_exit_2_naming_the_key(argv, message, pretrain_calls, capsys):
    assert main(["pretrain", "--config", "tiny", *argv]) == 2
    assert message in capsys.readouterr().err
    assert not pretrain_calls


def test_pretrain_nan_lr_exits_2_in_a_subprocess():
    out = _python("-m", "zero2all.cli", "pretrain", "--config", "tiny", "train.lr=nan")
    assert out.returncode == 2 and "train.lr" in out.stderr


# ------------------------------------------------------------------------------------------ sft, dpo


@pytest.fixture
def init_dir(config_only_init):
    return config_only_init


@pytest.fixture
def post_calls(monkeypatch):
    import zero2all.train.posttrain as posttrain

    calls = []
    for stage in ("sft", "dpo"):
        monkeypatch.setattr(posttrain, stage, lambda cfg, show_progress=True, stage=stage: calls.append((stage, cfg)))
    return calls


def test_sft_overrides_anywhere_and_after_data(init_dir, tmp_path, post_calls):
    assert main(["sft", "train.max_steps=5", "--init", str(init_dir), "--data", "a.jsonl", "b.jsonl",
                 "train.lr=1e-4", "--out", str(tmp_path / "o"), "post.lora_alpha=8", "--lora-rank", "4",
                 "--lora-targets", "qkv_proj", "o_proj", "model.ops.attention=naive", "--packing", "pad",
                 "--skip-bad", "--valid-fraction", "0.1"]) == 0
    (stage, cfg), = post_calls
    assert stage == "sft" and cfg.post.data == ["a.jsonl", "b.jsonl"]
    assert (cfg.train.max_steps, cfg.train.lr, cfg.train.out_dir) == (5, 1e-4, str(tmp_path / "o"))
    assert (cfg.post.lora_rank, cfg.post.lora_alpha, cfg.post.lora_targets) == (4, 8.0, ["qkv_proj", "o_proj"])
    assert (cfg.post.packing, cfg.post.on_error, cfg.post.valid_fraction) == ("pad", "skip", 0.1)
    assert cfg.model.ops.attention == "naive" and cfg.model.hidden_dim == 64      # the rest from --init
    assert cfg.train.micro_batch_size == 8 and cfg.train.warmup_steps == 20      # the sft defaults


def test_sft_data_file_whose_name_looks_like_an_override_is_data(init_dir, tmp_path, post_calls, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mix=1.jsonl").write_text("{}\n")
    assert main(["sft", "--init", str(init_dir), "--data", "mix=1.jsonl", "train.lr=1e-4"]) == 0
    cfg = post_calls[0][1]
    assert cfg.post.data == ["mix=1.jsonl"] and cfg.train.lr == 1e-4


def test_dpo_options_overrides_and_config_file(init_dir, tmp_path, post_calls, capsys):
    path = tmp_path / "dpo.toml"
    path.write_text('[train]\nlr = 3e-6\nout_dir = "from-file"\n[post]\nbeta = 0.5\nref = "file-ref"\n')
    assert main(["dpo", "--config", str(path), "--init", str(init_dir), "post.lora_rank=2", "--data", "p.jsonl",
                 "--beta", "0.2", "--precompute-ref", "train.max_steps=3"]) == 0
    (stage, cfg), = post_calls
    assert stage == "dpo" and cfg.post.beta == 0.2 and cfg.post.precompute_ref and cfg.post.ref == "file-ref"
    assert (cfg.train.lr, cfg.train.out_dir, cfg.train.max_steps, cfg.post.lora_rank) == (3e-6, "from-file", 3, 2)
    assert cfg.post.on_error == "raise"                                # --skip-bad not given: the default stays
    # an option and an override naming the same key
    assert main(["dpo", "--init", str(init_dir), "--data", "p.jsonl", "--beta", "0.2", "post.beta=0.3"]) == 2
    assert "post.beta: set twice, by --beta and by the override 'post.beta=0.3'" in capsys.readouterr().err
    # a bad value is named
    assert main(["dpo", "--init", str(init_dir), "--data", "p.jsonl", "post.beta=nan"]) == 2
    assert "post.beta: must be a finite number" in capsys.readouterr().err
    assert len(post_calls) == 1


def test_posttrain_needs_data_after_the_overrides_are_taken_out(init_dir, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sft", "--init", str(init_dir), "--data", "train.lr=1e-4"])
    assert e.value.code == 2 and "--data" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ other commands


def test_info_overrides_anywhere(capsys):
    assert main(["info", "model.n_layers=3", "--config", "tiny", "model.hidden_dim=128"]) == 0
    out = capsys.readouterr().out
    assert "n_layers                   3" in out and "hidden_dim                 128" in out


def test_estimate_overrides_anywhere(capsys):
    assert main(["estimate", "--config", "tiny", "--json", "model.n_layers=2", "--gpus", "2"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["estimate", "model.n_layers=2", "--config", "tiny", "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == first
    assert main(["estimate", "--config", "tiny", "--json", "--gpus", "2"]) == 0
    assert json.loads(capsys.readouterr().out) != first


def test_demo_overrides_anywhere(monkeypatch):
    import zero2all.demo as demo

    calls = []
    monkeypatch.setattr(demo, "run_demo", lambda out, **kw: calls.append((out, kw)))
    assert main(["demo", "train.lr=1e-3", "--out", "d", "model.n_layers=2", "--steps", "3"]) == 0
    (out, kw), = calls
    assert out == "d" and kw["steps"] == 3 and kw["overrides"] == ["train.lr=1e-3", "model.n_layers=2"]


def test_bench_options_are_added_at_run_time_and_take_overrides_anywhere(monkeypatch, capsys):
    import zero2all.bench as bench

    calls = []
    monkeypatch.setattr(bench, "main_from_args", lambda args: calls.append(args) or 0)
    assert main(["bench", "train", "train.lr=1e-3", "--rows", "hf", "model.n_layers=2", "--iters", "3"]) == 0
    (args,), = [calls]
    assert (args.rows, args.iters, args.overrides) == ("hf", 3, ["train.lr=1e-3", "model.n_layers=2"])
    with pytest.raises(SystemExit) as e:
        main(["bench", "train", "--help"])
    assert e.value.code == 0 and "--rows" in capsys.readouterr().out


TINY_BENCH = ["--config", "tiny", "--seq", "32", "--micro-batch", "2", "--accum", "1", "--iters", "2", "--warmup",
              "1", "model.vocab_size=256", "model.hidden_dim=64", "model.intermediate_size=96", "model.n_layers=2",
              "model.n_heads=4", "model.n_kv_heads=2"]


def test_bench_train_runs_its_rows_on_the_cpu(tmp_path, capsys):
    """The real benchmark loop (no mock) on a tiny model: our plain row and the HF peer train, the table and the
    JSON carry their numbers; the CPU has no MFU or memory column, and a peer that needs a GPU says so."""
    pytest.importorskip("transformers")
    out = tmp_path / "bench.json"
    assert main(["bench", "train", "--device", "cpu", "--rows", "naive,hf,tt_compile", "--out", str(out),
                 *TINY_BENCH]) == 0
    printed = capsys.readouterr().out
    table = printed[printed.index("row "):].splitlines()
    naive, hf = (next(line for line in table if line.startswith(label)) for label in ("naive ", "HF Llama"))
    for line in (naive, hf):
        mb, seq, step_ms, tok_s, mfu, peak = line.split()[-7:-1]
        assert (mb, seq, mfu, peak) == ("2", "32", "-", "-") and float(step_ms) > 0 and float(tok_s) > 0, line
    assert "needs a CUDA GPU" in next(line for line in table if line.startswith("torchtitan"))
    assert "device: CPU (" in printed and "not a measurement" in printed
    results = {r["row"]: r for r in json.loads(out.read_text())["results"]}
    assert results["naive"]["tokens_per_s"] > 0 and len(results["naive"]["step_times_ms"]) == 2
    assert results["hf"]["tokens_per_s"] > 0 and results["tt_compile"]["error"] == "needs a CUDA GPU"


def test_bench_train_clips_gradients_at_train_grad_clip_as_pretrain_does(monkeypatch, capsys):
    """Each benchmark step runs the trainer's grad_norm_and_clip with the config's train.grad_clip, and the clipping
    acts: clipped to a norm of 1e-12, AdamW's steps shrink to what its eps and the weight decay leave."""
    import types

    import torch

    import zero2all.bench as bench
    import zero2all.train.optim as optim

    calls = []
    real = optim.grad_norm_and_clip
    monkeypatch.setattr(optim, "grad_norm_and_clip", lambda params, max_norm: calls.append(max_norm) or
                        real(params, max_norm))
    assert main(["bench", "train", "--device", "cpu", "--rows", "naive", *TINY_BENCH, "train.grad_clip=0.25"]) == 0
    assert calls == [0.25] * 3  # --warmup 1 + --iters 2 steps, each clipped at the config's value
    assert "grad clip 0.25" in capsys.readouterr().out

    def moved(grad_clip: float) -> float:
        kept = {}

        def build(cfg, row, device, seq):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16))
            kept["model"], kept["start"] = model, [p.detach().clone() for p in model.parameters()]
            return model, lambda x, y: torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

        r = bench.run_row("custom", types.SimpleNamespace(padded_vocab_size=16), 2, 8, 1, 2, 0, device="cpu",
                          build=build, grad_clip=grad_clip, log=lambda m: None)
        assert r.error is None, r.error
        return sum((p.detach() - p0).abs().sum().item() for p, p0 in zip(kept["model"].parameters(), kept["start"]))

    unclipped, clipped = moved(0.0), moved(1e-12)
    assert unclipped > 0 and clipped < 0.25 * unclipped, (unclipped, clipped)  # measured 0.05x (weight decay)


def test_bench_train_without_a_gpu_is_one_line(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "train", *TINY_BENCH]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("z2all bench train: error: no CUDA GPU")
    assert "--device cpu" in err


def test_split_overrides_rules():
    parser = build_parser()
    sft = parser._subparsers._group_actions[0].choices["sft"]
    tokens = ["--out", "a=b", "train.lr=1", "--data", "x.jsonl", "post.beta=2", "--", "train.x=1"]
    kept, found = split_overrides(tokens, sft._option_string_actions)
    assert found == ["train.lr=1", "post.beta=2"]
    assert kept == ["--out", "a=b", "--data", "x.jsonl", "--", "train.x=1"]
