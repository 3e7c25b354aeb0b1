"""The config flags are generated from the config dataclasses (zero2all/cli_flags.py): every flag sets exactly its
field, with the field's type; a short flag and its dotted name are one action; every short flag of earlier versions
keeps its meaning; the help text is the field's comment. Parsing only: nothing runs."""

import argparse
import dataclasses
import re
import typing

import pytest

from zero2all.cli import POST_MODEL_KEYS, build_parser, main
from zero2all.cli_flags import ALIASES, SHORT_FLAGS, ConfigFlag, ConfigFlags
from zero2all.config import Config, ConfigError, build_config_dict, config_fields, from_dict, preset_path, to_dict

CONFIG_COMMANDS = ("pretrain", "ladder", "estimate", "sft", "dpo", "reward", "rl")
# what a command needs on every line (the value is not under test)
REQUIRED = {"ladder": ["--out", "L"], "sft": ["--init", "I", "--data", "D"], "dpo": ["--init", "I", "--data", "D"],
            "reward": ["--init", "I", "--data", "D"], "rl": ["--init", "I", "--data", "D"]}

# the options that set a config key before the flags were generated, per command: each keeps its meaning
EARLIER_FLAGS = {
    "pretrain": {"--data": "data.path", "--out": "train.out_dir", "--resume": "train.resume",
                 "--device": "train.device"},
    "ladder": {"--data": "data.path", "--device": "train.device"},
    "estimate": {"--tp": "parallel.tp", "--pp": "parallel.pp", "--cp": "parallel.cp", "--ep": "parallel.ep",
                 "--micro-batch": "train.micro_batch_size", "--grad-accum": "train.grad_accum_steps"},
}
_POST = {"--init": "post.init", "--data": "post.data", "--out": "train.out_dir", "--resume": "train.resume",
         "--device": "train.device", "--valid": "post.valid", "--valid-fraction": "post.valid_fraction",
         "--tokenizer": "post.tokenizer", "--lora-rank": "post.lora_rank", "--lora-alpha": "post.lora_alpha",
         "--lora-dropout": "post.lora_dropout", "--lora-targets": "post.lora_targets",
         "--prompt-tuning": "post.prompt_tuning", "--num-virtual-tokens": "post.num_virtual_tokens"}
EARLIER_FLAGS["sft"] = {**_POST, "--packing": "post.packing"}
EARLIER_FLAGS["dpo"] = {**_POST, "--beta": "post.beta", "--ref": "post.ref"}
EARLIER_FLAGS["reward"] = dict(_POST)
EARLIER_FLAGS["rl"] = {**_POST, "--algo": "rl.algo", "--reward-fn": "rl.reward_fn", "--reward-model": "rl.reward_model",
                       "--group-size": "rl.group_size", "--max-new-tokens": "rl.max_new_tokens",
                       "--kl-coef": "rl.kl_coef", "--kl-estimator": "rl.kl_estimator", "--epochs": "rl.epochs",
                       "--ref": "post.ref"}
# switches of earlier versions: flag -> (key, the value it sets)
EARLIER_SWITCHES = {"sft": {"--skip-bad": ("post.on_error", "skip")},
                    "dpo": {"--skip-bad": ("post.on_error", "skip"), "--precompute-ref": ("post.precompute_ref", True)},
                    "reward": {"--skip-bad": ("post.on_error", "skip")},
                    "rl": {"--skip-bad": ("post.on_error", "skip")}}


@pytest.fixture(scope="module")
def parsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: sub.choices[name] for name in CONFIG_COMMANDS}


def _flags(p: argparse.ArgumentParser) -> ConfigFlags:
    return ConfigFlags([a for a in p._actions if isinstance(a, ConfigFlag)])


def _given(p: argparse.ArgumentParser, command: str, argv: list[str]) -> tuple[dict, dict]:
    values, sources = _flags(p).given(p.parse_args(REQUIRED.get(command, []) + argv))
    for key, value in (("post.init", "I"), ("post.data", ["D"])):   # what REQUIRED set
        if values.get(key) == value:
            values.pop(key), sources.pop(key)
    return values, sources


def _inner(tp):
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, __import__("types").UnionType) and len(args) == 1 \
        else tp


def _sample(field) -> tuple[list[str], object]:
    """(command-line words, the value the field must then hold): never the default, of the field's type."""
    tp = _inner(field.type)
    if field.choices:
        choice = next(c for c in field.choices if c and c != field.default)
        return [choice], choice
    if tp is bool:
        return (["false"], False) if field.default else (["true"], True)
    if bool in typing.get_args(tp):       # true | false | "auto"
        return (["false"], False) if field.default == "auto" else (["auto"], "auto")
    if tp is int:
        value = (field.default or 0) + 3
        return [str(value)], value
    if tp is float:
        value = field.default + 0.25
        return [repr(value)], value
    if tp is str:                         # text stays text, even when it reads as a number
        return ["7e3"], "7e3"
    if typing.get_origin(tp) is list and typing.get_args(tp) == (int,):
        return ["3", "5"], [3, 5]
    if typing.get_origin(tp) is list:
        return ["alpha", "7"], ["alpha", "7"]
    raise AssertionError(f"{field.key}: no sample for type {field.type}")


def _settings(values: dict) -> dict:
    """The config's settings (flattened to dotted keys) once ``values`` are applied, types checked."""
    flat = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k != "rope_scaling":
                walk(v, f"{prefix}{k}.")
            else:
                flat[prefix + k] = v

    walk(to_dict(from_dict(Config, build_config_dict(None, [], values))))
    return flat


def test_every_generated_flag_sets_exactly_its_field(parsers):
    """Each option string of each config flag of each command: the value given arrives in exactly the field the
    flag names, converted to the field's type (text, numbers, true/false, choices, lists), and nowhere else."""
    defaults = _settings({})
    checked = 0
    for command, p in parsers.items():
        fields = {f.key: f for f in config_fields()}
        for action in _flags(p).actions:
            if action.nargs == 0:
                continue
            field = fields[action.key]
            words, expected = _sample(field)
            for option in action.option_strings:
                values, sources = _given(p, command, [option, *words])
                assert values == {action.key: expected}, (command, option)
                assert sources == {action.key: option}
                after = _settings(values)
                changed = {k for k in after if after[k] != defaults[k]}
                assert changed == {field.key} and after[field.key] == expected, (command, option, changed)
                checked += 1
    assert checked > 700


def test_each_command_offers_a_flag_for_every_setting_it_reads(parsers):
    keys = {f.key for f in config_fields() if _inner(f.type) is not dict}
    def offered(command):
        return {a.key for a in _flags(parsers[command]).actions}
    train = {k for k in keys if k.split(".")[0] in ("model", "train", "data", "parallel")}
    for command in ("pretrain", "ladder", "estimate"):
        assert offered(command) == train, command
    post = {k for k in keys if k.split(".")[0] in ("train", "data", "parallel", "post")} - {"data.path"}
    post |= {k for k in keys if any(k == m or k.startswith(m + ".") for m in POST_MODEL_KEYS)}
    for command in ("sft", "dpo", "reward"):
        assert offered(command) == post, command
    assert offered("rl") == post | {k for k in keys if k.startswith("rl.")}


def test_post_training_model_flags_are_what_the_post_training_config_accepts():
    from zero2all.train.posttrain import MODEL_OVERRIDABLE

    assert set(POST_MODEL_KEYS) == {"model." + k for k in MODEL_OVERRIDABLE}


@pytest.mark.parametrize("command", CONFIG_COMMANDS)
def test_every_earlier_short_flag_keeps_its_meaning(command, parsers):
    p = parsers[command]
    fields = {f.key: f for f in config_fields()}
    for flag, key in EARLIER_FLAGS.get(command, {}).items():
        words, expected = _sample(fields[key])
        values, _ = _given(p, command, [flag, *words])
        assert values == {key: expected}, (command, flag)
    for flag, (key, value) in EARLIER_SWITCHES.get(command, {}).items():
        assert _given(p, command, [flag]) == ({key: value}, {key: flag}), (command, flag)


def test_a_short_flag_means_one_key_everywhere(parsers):
    """--tp is parallel.tp in every command that has it (only --data names the shard directory for pretraining
    and the records for post-training); an alias is the name it stands for."""
    for command, p in parsers.items():
        for action in _flags(p).actions:
            for option in action.option_strings:
                if option in ALIASES:
                    option = ALIASES[option]
                if option in SHORT_FLAGS:
                    assert SHORT_FLAGS[option] == action.key, (command, option)
                    # and it is the field's name, or the start of it (--out: out_dir; --data: data.path)
                    name = option[2:].replace("-", "_")
                    assert action.key.rsplit(".", 1)[-1].startswith(name) or \
                        action.key.replace(".", "_").startswith(name), (option, action.key)
                elif option == "--data":
                    assert action.key == ("data.path" if command in ("pretrain", "ladder") else "post.data")
                elif action.nargs != 0:
                    assert option == "--" + action.key, (command, option)


def test_help_text_is_the_fields_comment(parsers):
    helps = {f.key: f.help for f in config_fields()}
    assert all(f.help for f in config_fields() if _inner(f.type) is not dict)
    for command, p in parsers.items():
        for action in _flags(p).actions:
            if action.nargs != 0:
                assert action.help.replace("%%", "%").startswith(helps[action.key]), (command, action.key)
    text = parsers["pretrain"].format_help()
    assert "--tp N, --parallel.tp N" in text and "tensor parallel (Megatron 1-D" in text
    assert "[parallel] settings" in text


def test_field_comments_are_read_whole():
    """The comment above a field and the lines continuing the one after it are both part of its help; a group
    heading (``# --``) belongs to no field."""
    helps = {f.key: f.help for f in config_fields()}
    assert helps["parallel.tp_impl"].startswith("tp: local (our kernels") and \
        helps["parallel.tp_impl"].endswith("dtensor (DTensor parallelize_module on every linear); distributed/tp.py")
    assert helps["parallel.tp_graphs"].startswith("tp local, CUDA: each block's forward")
    assert helps["train.lr"] == "peak learning rate"
    assert helps["parallel.dp_replicate"] == "HSDP replicas (gradients all-reduced across them)"


def test_choices_are_the_ones_validation_accepts():
    for f in config_fields():
        if not f.choices:
            continue
        section, name = f.key.rsplit(".", 1)
        cfg = Config()
        obj = cfg
        for part in section.split("."):
            obj = getattr(obj, part)
        setattr(obj, name, "not-a-choice")
        message = f"{f.key}: 'not-a-choice' is not one of {', '.join(f.choices)}"
        with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
            cfg.validate()
        assert dataclasses.is_dataclass(obj)


def test_true_false_flags_alone_mean_true(parsers):
    assert _given(parsers["pretrain"], "pretrain", ["--train.compile"])[0] == {"train.compile": True}
    assert _given(parsers["dpo"], "dpo", ["--precompute-ref"])[0] == {"post.precompute_ref": True}
    assert _given(parsers["pretrain"], "pretrain", ["--parallel.tp_graphs", "false"])[0] == \
        {"parallel.tp_graphs": False}
    assert _given(parsers["pretrain"], "pretrain", ["--model.pad_token_id", "none"])[0] == \
        {"model.pad_token_id": None}


@pytest.fixture
def pretrain_calls(monkeypatch):
    import zero2all.train.trainer as trainer

    calls = []
    monkeypatch.setattr(trainer, "pretrain", lambda cfg, show_progress=True: calls.append(cfg))
    return calls


def test_short_and_dotted_flags_reach_the_run(pretrain_calls):
    assert main(["pretrain", "--config", "tiny", "--tp", "1", "--lr", "2e-3", "--parallel.pp_schedule", "gpipe",
                 "--model.ops.attention", "naive", "--train.sample_prompts", "a b", "c"]) == 0
    cfg, = pretrain_calls
    assert (cfg.parallel.tp, cfg.train.lr, cfg.parallel.pp_schedule) == (1, 2e-3, "gpipe")
    assert cfg.model.ops.attention == "naive" and cfg.train.sample_prompts == ["a b", "c"]


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "3", "train.max_steps=4"], "train.max_steps: set twice, by --max-steps and by the override"),
    (["--train.max_steps", "3", "train.max_steps=4"],
     "train.max_steps: set twice, by --train.max_steps and by the override"),
    (["--train.max_steps", "abc"], "train.max_steps: expected an integer, got 'abc' (str)"),
    (["--train.compile", "maybe"], "train.compile: expected true/false, got 'maybe' (str)"),
    (["--train.precision", "fp7"], "train.precision: 'fp7' is not one of auto, bf16, fp16, fp32, fp64"),
])
def test_bad_flag_values_are_one_line_naming_the_key(argv, message, pretrain_calls, capsys):
    assert main(["pretrain", "--config", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not pretrain_calls


def test_estimate_reads_the_layout_from_the_config_and_its_flags(tmp_path, capsys):
    """`z2all estimate`'s --tp is parallel.tp: a config's [parallel] tp is estimated when --tp is not given (earlier
    versions took tp = 1 then), and --tp / --parallel.tp / the earlier --micro-batch override it."""
    import json

    path = tmp_path / "tp2.toml"
    path.write_text(preset_path("tiny").read_text() + "\n[parallel]\ntp = 2\n")
    assert main(["estimate", "--config", str(path), "--gpus", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["tp"] == 2
    for argv in (["--tp", "1"], ["--parallel.tp", "1"]):
        assert main(["estimate", "--config", str(path), "--gpus", "2", "--json", *argv]) == 0
        assert json.loads(capsys.readouterr().out)["layout"]["tp"] == 1
    assert main(["estimate", "--config", "tiny", "--json", "--micro-batch", "3"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"]["micro_batch_size"] == 3
