"""Command-line flags from help-annotated dataclasses: every option is declared once, as a field.

transformers' ``HfArgumentParser`` turns each field of an options dataclass (``TrainOptions``, ``HealOptions``,
``CompareOptions``) into a flag: ``--max-steps`` (``--max_steps`` works too), the default and the help from the
field (``field(default=..., metadata={"help": ...})``), a bool field as ``--flag`` (or ``--flag yes/no``) and, when it
defaults to True, ``--no-flag``; ``list[...]`` fields take one or more values, ``Literal[...]`` fields their choices.

``HfArgumentParser`` hands a field's metadata to ``add_argument`` as it is. Where the annotation alone cannot say how
a flag's text becomes the value, the metadata names one of the actions below, which takes the place of the type the
parser derives from the annotation:

- ``parsed_by(parse)``: store ``parse(text)`` (``--phase-ramp 0:0.5`` -> ``(0.0, 0.5)``, ``--warmup 10`` -> steps);
- ``collected_by(parse)``: a repeatable flag whose values form a list (``--variant``);
- ``OverridesAction``: a repeatable ``FIELD=VALUE`` flag whose values form a dict (``--config``);

and ``metadata={"nargs": "?", "const": ...}`` gives a flag an optional value (``--resume [CHECKPOINT]``).
A value that does not parse raises ``ValueError`` naming the flag, which ``qkmap_hf.cli.main`` reports (exit 2).

``HfArgumentParser`` makes every field a ``--flag``; ``OptionsParser`` adds the two things a command line also
needs and it lacks: ``metadata={"positional": True}`` makes a field a positional argument (``qkmap convert SRC
DST``), ``metadata={"switch": True}`` makes a boolean field a flag that takes no value (``--dry-run``, or
``--no-progress`` for a field that defaults to True, whose help then describes that flag), as the commands that
wrote their flags by hand had them, and ``metadata={"negated_by": {"--old-spelling": help}}`` adds an old spelling
of a boolean field's ``--no-...`` flag. ``overridden`` lets a composed options class change one inherited field's default or help in
one place, so the shared declaration stays the only one.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import inspect
import json
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, TypeVar

from transformers import HfArgumentParser

T = TypeVar("T")


def parse_value(text: str) -> Any:
    """JSON when it parses (numbers, true, null, lists), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["key=value", ...]`` -> dict; values are JSON when they parse (numbers, true, null), else strings."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config {item!r} must look like FIELD=VALUE, e.g. qkmap_min_frequency=0.1.")
        key = key.strip()
        text, nullable = value.strip(), key in _boolean_fields(nullable=True)
        if nullable or key in _boolean_fields():
            overrides[key] = boolean_value(item, text, nullable)
        else:
            overrides[key] = parse_value(text)
    return overrides


BOOLEAN_VALUES = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _boolean_fields(nullable: bool = False) -> list[str]:
    from .modeling.configuration_qkmap import QKMapConfig

    return QKMapConfig.boolean_field_names(nullable)


def boolean_value(item: str, text: str, nullable: bool = False) -> bool | None:
    """``true/false/1/0/yes/no`` (any case) as a bool, and ``null``/``none`` as None for a ``nullable`` field (its
    default in effect); anything else is refused (a word is not a truthy value)."""
    if nullable and text.lower() in ("null", "none"):
        return None
    try:
        return BOOLEAN_VALUES[text.lower()]
    except KeyError:
        default = ", or null for its default" if nullable else ""
        raise ValueError(
            f"--config {item!r}: {item.partition('=')[0].strip()} is a boolean field; use true/false (or 1/0, "
            f"yes/no){default}."
        ) from None


def flag_name(name: str) -> str:
    """``max_steps`` -> ``--max-steps``: how a field is spelt on the command line (and in refusals)."""
    return "--" + name.replace("_", "-")


def check_numbers(
    options: Any,
    *,
    positive: tuple[str, ...] = (),
    non_negative: tuple[str, ...] = (),
    fractions: tuple[str, ...] = (),
) -> None:
    """``ValueError`` naming the flag unless every float of ``options`` (a dataclass; tuples of floats too) is
    finite, the ``positive`` fields (numbers or tuples) are > 0, the ``non_negative`` ones >= 0 and the
    ``fractions`` in [0, 1]. ``None`` means "not given" and passes. A NaN slips through every comparison, and a
    negative count is read as "all" or "none" by the libraries below, so both are refused where they enter."""
    for option in fields(options):
        value = getattr(options, option.name)
        values = value if isinstance(value, (tuple, list)) else (value,)
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        shown = ":".join(map(str, values)) if isinstance(value, (tuple, list)) else value
        if any(not math.isfinite(v) for v in numbers):
            raise ValueError(f"{flag_name(option.name)} {shown}: must be a finite number.")
        name = option.name
        if name in positive and any(v <= 0 for v in numbers):
            raise ValueError(f"{flag_name(name)} {shown}: must be positive.")
        if name in non_negative and any(v < 0 for v in numbers):
            raise ValueError(f"{flag_name(name)} {shown}: must not be negative.")
        if name in fractions and any(not 0 <= v <= 1 for v in numbers):
            raise ValueError(f"{flag_name(name)} {shown}: must lie in [0, 1] (a fraction).")


def steps_or_fraction(text: str) -> float:
    """``"10"`` -> 10 (steps), ``"0.05"`` -> 0.05 (a fraction of the run), as the Trainer reads them."""
    value = float(text)
    return int(value) if value >= 1 and value.is_integer() else value


def fraction_window(text: str) -> tuple[float, float]:
    """``"START:END"`` (fractions of the run) -> ``(start, end)``."""
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(f"{text!r}: give START:END as fractions of the run, e.g. 0:0.5")
    return float(start), float(end)


def comma_floats(text: str) -> tuple[float, ...]:
    """``"0.5,2,4"`` -> ``(0.5, 2.0, 4.0)``."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of numbers") from None


def comma_ints(text: str) -> tuple[int, ...]:
    """``"256,512"`` -> ``(256, 512)``."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of integers") from None


def default_of(function: Callable[..., Any], name: str) -> Any:
    """The default of ``function``'s parameter ``name``: a flag that forwards to a library function takes its
    default from there instead of writing it a second time."""
    default = inspect.signature(function).parameters[name].default
    if default is inspect.Parameter.empty:
        raise TypeError(f"{function.__qualname__}({name}) has no default")
    return default


class _ParsedAction(argparse.Action):
    """Stores ``parse(value)``; subclasses set ``parse`` and ``collect``."""

    parse: Callable[[str], Any] = staticmethod(str)
    collect = False

    def __init__(self, option_strings, dest, type=None, **kwargs):  # noqa: A002 (argparse's keyword)
        super().__init__(option_strings, dest, **kwargs)  # the annotation's type gives way to ``parse``

    def _parse(self, text: str, option_string: str | None) -> Any:
        try:
            return type(self).parse(text)
        except (ValueError, TypeError) as error:
            if str(error).startswith("--"):  # the parser already named the flag
                raise
            raise ValueError(f"{option_string or self.dest} {text!r}: {error}") from None

    def __call__(self, parser, namespace, values, option_string=None):
        if not self.collect:
            setattr(namespace, self.dest, self._parse(values, option_string))
            return
        current = getattr(namespace, self.dest, None)
        collected = [] if current is None or current is self.default else list(current)
        for text in values if isinstance(values, list) else [values]:
            collected.append(self._parse(text, option_string))
        setattr(namespace, self.dest, collected)


def parsed_by(parse: Callable[[str], Any]) -> type[argparse.Action]:
    """The argparse action for a flag whose value is ``parse(text)``."""
    return type(f"Parsed_{parse.__name__}", (_ParsedAction,), {"parse": staticmethod(parse)})


def collected_by(parse: Callable[[str], Any]) -> type[argparse.Action]:
    """The argparse action for a repeatable flag: the list of ``parse(text)`` (replacing the field's default)."""
    return type(f"Collected_{parse.__name__}", (_ParsedAction,), {"parse": staticmethod(parse), "collect": True})


class OverridesAction(argparse.Action):
    """``--config FIELD=VALUE`` (repeatable) -> ``{field: value, ...}``, values as in ``parse_overrides``."""

    def __init__(self, option_strings, dest, type=None, **kwargs):  # noqa: A002 (argparse's keyword)
        kwargs.setdefault("metavar", "FIELD=VALUE")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from .modeling.configuration_qkmap import QKMapConfig

        current = getattr(namespace, self.dest, None) or {}
        parsed = parse_overrides([values])
        try:  # a misspelt qkmap_* field would otherwise be dropped (checkpoints) or stored unused
            QKMapConfig.validate_known_qkmap_keys(parsed)
        except ValueError as error:
            raise ValueError(f"{option_string or '--config'} {values!r}: {error}") from None
        setattr(namespace, self.dest, {**current, **parsed})


def options_from_namespace(cls: type[T], namespace: argparse.Namespace) -> T:
    """An options dataclass from a parsed namespace (the fields it has; the rest keep their defaults)."""
    values = {f.name: getattr(namespace, f.name) for f in fields(cls) if f.init and hasattr(namespace, f.name)}
    return cls(**values)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None, the flag takes no value, or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.nargs == 0 or "default" in text:
            return text
        return super()._get_help_string(action)


def overridden(cls: type, name: str, **changes: Any) -> Any:
    """Field ``name`` of ``cls`` for a subclass that changes only its ``default`` and/or ``help``.

    A command whose effective default differs from the shared one (``qkmap compare``'s ``max_eval_blocks``) says
    so in one line; the type, the help and the other metadata stay declared once, on ``cls``."""
    base = next(option for option in fields(cls) if option.name == name)
    metadata = dict(base.metadata)
    if "help" in changes:
        metadata["help"] = changes.pop("help")
    if set(changes) - {"default"}:
        raise TypeError(f"overridden({cls.__name__}, {name!r}): only default and help can change, not {changes}")
    if "default" in changes:  # keyword-only, as the shared groups' fields are, so field order never matters
        return field(default=changes["default"], metadata=metadata, kw_only=True)
    if base.default_factory is not dataclasses.MISSING:
        return field(default_factory=base.default_factory, metadata=metadata, kw_only=True)
    if base.default is not dataclasses.MISSING:
        return field(default=base.default, metadata=metadata, kw_only=True)
    return field(metadata=metadata, kw_only=True)


class OptionsParser(HfArgumentParser):
    """``HfArgumentParser`` plus positional fields and old ``--no-...`` spellings (see the module docstring)."""

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
        metadata = dict(field.metadata)
        if metadata.pop("positional", False):  # HfArgumentParser only makes --flags
            if field.default is not dataclasses.MISSING:
                metadata.setdefault("nargs", "?")
                metadata["default"] = field.default
            parser.add_argument(field.name, **metadata)
            return
        if metadata.pop("switch", False):  # a flag that takes no value, so it never eats the positional after it
            names = [field.name, field.name.replace("_", "-")] if field.default is False else []
            names = names or [f"no_{field.name}", f"no-{field.name.replace('_', '-')}"]
            action = "store_true" if field.default is False else "store_false"
            options = ["--" + name for name in dict.fromkeys(names)]
            parser.add_argument(*options, dest=field.name, action=action, default=field.default, **metadata)
            return
        negated_by: Mapping[str, str] = metadata.pop("negated_by", {})
        if negated_by:
            field = copy.copy(field)
            field.metadata = MappingProxyType(metadata)
        HfArgumentParser._parse_dataclass_field(parser, field)
        for option, text in negated_by.items():  # after the field's own flags, so their default stands
            parser.add_argument(option, dest=field.name, action="store_false", default=argparse.SUPPRESS, help=text)


def make_parser(
    dataclass_types: tuple[type, ...], overrides: Mapping[str, Mapping[str, Any]] | None = None, **kwargs: Any
) -> argparse.ArgumentParser:
    """``OptionsParser`` over ``dataclass_types`` (flags with their defaults in ``--help``).

    ``overrides`` maps a field to argparse settings of its flag that one command changes, e.g. ``qkmap heal``
    hides ``--model`` (its positional CONVERTED stands for it): ``{"model": {"required": False, "help": SUPPRESS}}``.
    """
    kwargs.setdefault("formatter_class", _DefaultsFormatter)
    parser = OptionsParser(dataclass_types, **kwargs)
    for action in parser._actions:
        for name, value in (overrides or {}).get(action.dest, {}).items():
            setattr(action, name, value)
    for action in parser._actions:  # usage and help show the dashed spelling first (--max-steps, not --max_steps)
        action.option_strings.sort(key=lambda option: "_" in option)
    switches = {o for a in parser._actions if a.nargs == "?" and a.const is True for o in a.option_strings}
    parse_known_args = parser.parse_known_args

    def parse_switches_first(args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return parse_known_args(bare_switches_as_true(args, switches), namespace)

    parser.parse_known_args = parse_switches_first  # subcommands parse through it too
    return parser


# The words transformers' ``string_to_bool`` takes for a boolean field's value.
BOOLEAN_WORDS = frozenset({"yes", "no", "true", "false", "t", "f", "y", "n", "1", "0"})


def bare_switches_as_true(args: list[str], switches: set[str]) -> list[str]:
    """``--lora CONVERTED`` as ``--lora=true CONVERTED``: a boolean flag takes the next word only if it is a boolean.

    ``HfArgumentParser`` gives boolean fields an optional value (``--lora``, ``--lora true``), so argparse would
    read the positional after a bare switch as the switch's value and fail on it.
    """
    rewritten = []
    for index, arg in enumerate(args):
        following = args[index + 1] if index + 1 < len(args) else None
        if arg == "--":
            return rewritten + args[index:]
        if arg in switches and (following is None or following.lower() not in BOOLEAN_WORDS):
            arg = f"{arg}=true"
        rewritten.append(arg)
    return rewritten


@dataclass
class OverwriteFlag:
    """``--overwrite`` of the commands whose output folder may hold another command's model (train, heal, compare).

    Kept apart from their options so that it is not recorded as a training setting."""

    overwrite: bool = field(
        default=False,
        metadata={"help": "write into an output folder another qkmap command wrote (e.g. a heal folder), replacing it"},
    )
