"""Command-line flags generated from the config dataclasses: one flag per setting, one help text per setting.

Every setting a command reads is the flag ``--section.field`` (``--train.lr``, ``--model.ops.attention``), with
the field's comment in ``zero2all/config.py`` as its help (``zero2all.config.config_fields``). A few settings also
get a short name, listed once in :data:`SHORT_FLAGS` (``--tp`` is ``parallel.tp``): the short and the dotted name
are option strings of ONE argparse action, so they cannot mean different things. A short flag that was renamed
keeps its old name as a further option string (:data:`ALIASES`).

A flag sets its key exactly as the override ``section.field=VALUE`` would: the value is read as TOML (``true``,
``3``, ``1e-3``), a text field takes the text as it is, ``none`` clears an optional field, a list field takes one
or more values (``--post.lora_targets qkv_proj o_proj``) and a true/false field given alone means true. What a
value may be is checked by the config, which names the key; a choice field lists its choices in the help.

Building the flags reads only ``zero2all.config`` (no torch), so ``z2all --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

from zero2all.config import ConfigField, config_fields

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10
    import tomli as tomllib

# the short names of settings: a short flag means the same key in every command that offers it (``--data`` is
# the one name whose key depends on the command: data.path for pretraining, post.data for post-training)
SHORT_FLAGS: dict[str, str] = {
    "--out": "train.out_dir", "--resume": "train.resume", "--device": "train.device", "--lr": "train.lr",
    "--max-steps": "train.max_steps", "--micro-batch-size": "train.micro_batch_size",
    "--grad-accum-steps": "train.grad_accum_steps",
    "--tp": "parallel.tp", "--pp": "parallel.pp", "--cp": "parallel.cp", "--ep": "parallel.ep",
    "--init": "post.init", "--valid": "post.valid", "--valid-fraction": "post.valid_fraction",
    "--tokenizer": "post.tokenizer", "--lora-rank": "post.lora_rank", "--lora-alpha": "post.lora_alpha",
    "--lora-dropout": "post.lora_dropout", "--lora-targets": "post.lora_targets",
    "--prompt-tuning": "post.prompt_tuning", "--num-virtual-tokens": "post.num_virtual_tokens",
    "--packing": "post.packing", "--beta": "post.beta", "--ref": "post.ref", "--precompute-ref": "post.precompute_ref",
    "--algo": "rl.algo", "--reward-fn": "rl.reward_fn", "--reward-model": "rl.reward_model",
    "--group-size": "rl.group_size", "--max-new-tokens": "rl.max_new_tokens", "--kl-coef": "rl.kl_coef",
    "--kl-estimator": "rl.kl_estimator", "--epochs": "rl.epochs",
}
# earlier names of short flags: a command that offered the old name lists it too, and it becomes one more option
# string of the same action (nothing printed when it is used)
ALIASES: dict[str, str] = {"--micro-batch": "--micro-batch-size", "--grad-accum": "--grad-accum-steps"}
# switches that set a key to one value
SWITCHES: dict[str, tuple[str, Any]] = {"--skip-bad": ("post.on_error", "skip")}


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether ``None`` is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else typing.Union[tuple(args)]), type(None) in typing.get_args(tp)
    return tp, False


def _is_list(tp: Any) -> bool:
    return tp is list or typing.get_origin(tp) is list


def _item_type(tp: Any) -> Any:
    args = typing.get_args(tp)
    return args[0] if args else str


def convert(text: Any, tp: Any) -> Any:
    """A command-line word as the value of a field of type ``tp``: text fields keep the text, ``none`` is None
    where allowed, anything else is read as a TOML value (``true``, ``3``, ``1e-3``) or else kept as text (the
    config then names the key and what it expected)."""
    if not isinstance(text, str):  # a flag's constant (``--train.compile`` alone means true)
        return text
    inner, optional = _optional(tp)
    if optional and text.lower() == "none":
        return None
    if inner is str:
        return text
    if inner is bool and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _accepts_bool(tp: Any) -> bool:
    inner, _ = _optional(tp)
    return inner is bool or bool in typing.get_args(inner)


class ConfigFlag(argparse.Action):
    """Sets one config key (``self.key``); remembers the option string used, so that a message can name it."""

    def __init__(self, option_strings, dest, *, key: str, field: ConfigField, value: Any = None, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.key, self.field, self.value = key, field, value

    def __call__(self, parser, namespace, values, option_string=None):
        if self.nargs == 0:
            value = self.value
        elif _is_list(self.field.type):
            value = [convert(v, _item_type(self.field.type)) for v in values]
        else:
            value = convert(values, self.field.type)
        setattr(namespace, self.dest, value)
        sources = dict(getattr(namespace, "_config_sources", None) or {})
        sources[self.key] = option_string
        namespace._config_sources = sources


def _metavar(field: ConfigField) -> str:
    if field.choices:
        return "{" + ",".join(c for c in field.choices if c) + "}"
    if _accepts_bool(field.type):
        return "true|false" if _optional(field.type)[0] is bool else "true|false|auto"
    inner = _optional(field.type)[0]
    return "N" if inner is int else "NUM" if inner is float else field.key.rsplit(".", 1)[-1].upper()


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


class ConfigFlags:
    """The config flags of one command (see :func:`add_config_flags`)."""

    def __init__(self, actions: list[ConfigFlag]):
        self.actions = actions

    def given(self, args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
        """(dotted key -> typed value, dotted key -> the option that set it), for ``build_config``."""
        values, sources = {}, {}
        used = getattr(args, "_config_sources", None) or {}
        for action in self.actions:
            if not hasattr(args, action.dest) or action.key in values:  # not given (the default is no attribute)
                continue
            value = getattr(args, action.dest)
            values[action.key] = list(value) if isinstance(value, (list, tuple)) else value
            sources[action.key] = used.get(action.key) or action.option_strings[0]
        return values, sources

    def by_key(self) -> dict[str, ConfigFlag]:
        return {a.key: a for a in self.actions if a.nargs != 0}


def _wanted(key: str, sections: Iterable[str], exclude: Iterable[str]) -> bool:
    def under(prefix: str) -> bool:
        return key == prefix or key.startswith(prefix + ".")

    return any(under(s) for s in sections) and not any(under(x) for x in exclude)


def add_config_flags(parser: argparse.ArgumentParser, sections: Iterable[str], short: Iterable[str] = (), *,
                     exclude: Iterable[str] = (), extra: dict[str, str] | None = None,
                     options: dict[str, dict] | None = None, notes: dict[str, str] | None = None) -> ConfigFlags:
    """Add ``--KEY`` for every setting under ``sections`` (``"train"``, ``"model.ops"``; not those under
    ``exclude``), grouped by section in ``--help``.

    ``short``: the short flags of :data:`SHORT_FLAGS` / :data:`ALIASES` / :data:`SWITCHES` this command offers
    (their keys must be among the settings added); ``extra``: short flags of this command only
    (``{"--data": "data.path"}``); ``options``: more ``add_argument`` keywords per short flag (``required``,
    ``metavar``); ``notes``: a remark appended to a short flag's help (``default runs/sft``). Table fields
    (``model.rope_scaling``) get no flag: they are set with ``key=value`` overrides."""
    sections, exclude = list(sections), list(exclude)
    table = {**SHORT_FLAGS, **{old: SHORT_FLAGS[new] for old, new in ALIASES.items()}, **(extra or {})}
    names: dict[str, list[str]] = {}
    switches = []
    for flag in sorted(short, key=lambda f: f in ALIASES):  # an alias after the name it stands for
        if flag in SWITCHES:
            switches.append(flag)
            continue
        names.setdefault(table[flag], []).append(flag)
    fields = [f for f in config_fields() if _wanted(f.key, sections, exclude)]
    known = {f.key for f in fields}
    for key in names:
        if key not in known:
            raise ValueError(f"short flag for {key}: not among this command's settings")
    groups: dict[str, argparse._ArgumentGroup] = {}
    actions, by_key = [], {}
    for f in fields:
        if typing.get_origin(_optional(f.type)[0]) is dict or _optional(f.type)[0] is dict:
            continue
        section = f.key.rsplit(".", 1)[0]
        if section not in groups:
            groups[section] = parser.add_argument_group(f"[{section}] settings")
        flags = names.get(f.key, [])
        extra_kw = dict((options or {}).get(flags[0], {})) if flags else {}
        note = (notes or {}).get(flags[0]) if flags else None
        kwargs: dict[str, Any] = {"metavar": _metavar(f)}
        if _is_list(f.type):
            kwargs["nargs"] = "+"
        elif _accepts_bool(f.type):
            kwargs.update(nargs="?", const=True)
        kwargs.update(extra_kw)
        dest = flags[0][2:].replace("-", "_") if flags else f.key
        action = groups[section].add_argument(*flags, "--" + f.key, action=ConfigFlag, key=f.key, field=f,
                                              dest=dest, default=argparse.SUPPRESS,
                                              help=_escape(f.help + (f" ({note})" if note else "")), **kwargs)
        actions.append(action)
        by_key[f.key] = action
    for flag in switches:
        key, value = SWITCHES[flag]
        target = by_key[key]
        actions.append(parser.add_argument(flag, action=ConfigFlag, nargs=0, key=key, field=target.field,
                                           value=value, dest=target.dest, default=argparse.SUPPRESS,
                                           help=f"the same as --{key} {value}"))
    parser.usage = "%(prog)s [options] [--SECTION.FIELD VALUE ...] [SECTION.FIELD=VALUE ...]"
    return ConfigFlags(actions)
