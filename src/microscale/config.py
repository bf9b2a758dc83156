"""Configs are frozen dataclasses; YAML files and ``key=value`` overrides are serializations.

Every microscale config is a ``@dataclasses.dataclass(frozen=True, kw_only=True)`` with a
``# comment`` above each field (or trailing it) and presets as classmethods. This module
turns such a class into and out of plain data, generically, from its type annotations:

* :func:`to_dict` / :func:`from_dict` -- nested dataclasses, ``tuple[...]``, ``list[...]``,
  ``dict[str, ...]``, ``X | None``, ``Literal[...]``, ``int``/``float``/``bool``/``str``;
* :func:`to_yaml` / :func:`load_yaml` / :func:`dump_yaml` -- the same through YAML;
* :func:`apply_overrides` -- command-line ``key=value`` strings with dotted keys for nested
  fields (``model.d_model=256 optim.lr=1e-3``), coerced from the field annotations;
* :func:`field_comments` / :func:`describe` -- the per-field comments, for help text.

Validation is strict and names what went wrong:

* an unknown key names the key, lists the valid ones and suggests a close match
  (``unknown key 'optim.lrr' ... did you mean 'optim.lr'?``);
* a value of the wrong type names the key, the value and the expected type;
* a dataclass's own ``__post_init__`` checks (``d_model`` divisible by the heads, ...) are
  reported with the dotted path of the dataclass they came from.

All of these raise :class:`ConfigError` (a ``ValueError``).

A nested dataclass field can also be set from a string: the name of one of its presets
(``model=small`` calls ``ModelConfig.preset("small")``) -- later overrides then refine it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import yaml

from microscale.files import atomic_write_text, read_text

T = TypeVar("T")

__all__ = [
    "ConfigError",
    "apply_overrides",
    "config_keys",
    "describe",
    "dump_yaml",
    "field_comments",
    "from_dict",
    "load_yaml",
    "parse_overrides",
    "to_dict",
    "to_yaml",
]


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key and the expectation."""


# ----------------------------------------------------------------------------- introspection


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """Resolved field annotations (works with ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls, include_extras=False)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _type_name(tp: Any) -> str:
    """Readable name of an annotation: ``float``, ``int | None``, ``'cosine' | 'wsd'``."""
    if tp is type(None):
        return "None"
    if tp is Any:
        return "any"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_type_name(args[0])}, ...]"
        return f"tuple[{', '.join(_type_name(a) for a in args)}]"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """``{field: comment}``: the ``# ...`` lines above each field (or its trailing comment)."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    out: dict[str, str] = {}
    pending: list[str] = []
    names = set(_fields(cls))
    for line in src.splitlines():
        s = line.strip()
        if s.startswith("#"):
            pending.append(s.lstrip("#").strip())
            continue
        m = re.match(r"([A-Za-z_]\w*)\s*:", s)
        if m and m.group(1) in names and m.group(1) not in out:
            # a comment above the field, else a trailing `# ...` on its own line
            trailing = re.search(r"\s#\s*(.*)$", s)
            text = " ".join(pending) or (trailing.group(1).strip() if trailing else "")
            if text:
                out[m.group(1)] = text
        pending = []
    return out


def config_keys(cls: type, prefix: str = "") -> list[str]:
    """All dotted keys of a config class, nested dataclasses expanded."""
    keys = []
    hints = _hints(cls)
    for name in _fields(cls):
        key = prefix + name
        keys.append(key)
        tp = _strip_optional(hints[name])
        if _is_dataclass_type(tp):
            keys.extend(config_keys(tp, key + "."))
    return keys


def describe(cfg_or_cls: Any, prefix: str = "") -> str:
    """One line per key: ``key = value  # comment`` (or the type for a class)."""
    cls = cfg_or_cls if isinstance(cfg_or_cls, type) else type(cfg_or_cls)
    comments = field_comments(cls)
    hints = _hints(cls)
    lines = []
    for name in _fields(cls):
        tp = hints[name]
        key = prefix + name
        if _is_dataclass_type(_strip_optional(tp)):
            sub = cfg_or_cls if isinstance(cfg_or_cls, type) else getattr(cfg_or_cls, name)
            if sub is None or isinstance(cfg_or_cls, type):
                sub = _strip_optional(tp)
            c = comments.get(name)
            lines.append(f"{key}:" + (f"  # {c}" if c else ""))
            lines.append(describe(sub, key + "."))
            continue
        if isinstance(cfg_or_cls, type):
            val = _type_name(tp)
        else:
            val = _yaml_scalar(_plain(getattr(cfg_or_cls, name)))
        c = comments.get(name)
        lines.append(f"{key} = {val}" + (f"  # {c}" if c else ""))
    return "\n".join(lines)


def _yaml_scalar(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10**9).strip().removesuffix("\n...")


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


# ----------------------------------------------------------------------------- to plain data


def _plain(v: Any) -> Any:
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return to_dict(v)
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, Path):
        return str(v)
    if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", None) == 0:
        return v.item()  # numpy scalars
    return v


def to_dict(cfg: Any) -> dict[str, Any]:
    """A dataclass instance as nested plain data (tuples become lists), YAML/JSON-ready."""
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        raise TypeError(f"to_dict expects a dataclass instance, got {type(cfg).__name__}")
    return {f.name: _plain(getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.init}


def to_yaml(cfg: Any) -> str:
    """The config as a YAML document (keys in field order)."""
    buf = io.StringIO()
    yaml.safe_dump(to_dict(cfg), buf, sort_keys=False, default_flow_style=False, width=100)
    return buf.getvalue()


def dump_yaml(cfg: Any, path: str | os.PathLike) -> None:
    """Write :func:`to_yaml` to ``path`` atomically (:func:`microscale.files.atomic_write_text`)."""
    atomic_write_text(path, to_yaml(cfg))


# ----------------------------------------------------------------------------- from plain data

_NONE_STRINGS = {"none", "null", "~", ""}
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


class _Mismatch(Exception):
    """Internal: a value does not fit a type (turned into a ConfigError with the key)."""


def _parse_str(s: str) -> Any:
    """A command-line string as YAML (numbers, lists, mappings); the string itself on failure."""
    try:
        return yaml.safe_load(s)
    except yaml.YAMLError:
        return s


def _exact_int(f: float, key: str, text: str | None = None) -> int:
    """An int written as a float (``1e6``, ``2.5e3``): accepted when it is a whole number
    that a float holds exactly (up to 2^53); ``1e30`` would silently become
    1000000000000000019884624838656."""
    if not f.is_integer():
        raise _Mismatch
    if abs(f) > 2**53:
        raise ConfigError(
            f"{key}={text or f!r}: a whole number past 2^53 written as a float "
            "is not exact; write its digits"
        )
    return int(f)


def _is_none(value: Any) -> bool:
    """None, or a string that means it ("none", "null", "~", "")."""
    return value is None or (isinstance(value, str) and value.strip().lower() in _NONE_STRINGS)


def _coerce_none(value: Any, tp: Any, key: str) -> None:
    if _is_none(value):
        return None
    raise _Mismatch


def _coerce_union(value: Any, tp: Any, key: str) -> Any:
    """None first (also for ``str | None``), then the members in order, preferring an
    exact-type member over a coercion (1 stays int in ``int | float``)."""
    args = typing.get_args(tp)
    if type(None) in args and _is_none(value):
        return None
    members = [a for a in args if a is not type(None)]
    for a in members:
        if isinstance(a, type) and not _is_dataclass_type(a) and type(value) is a:
            return value
    for a in members:
        try:
            return _coerce(value, a, key)
        except _Mismatch:
            continue
    raise _Mismatch


def _coerce_literal(value: Any, tp: Any, key: str) -> Any:
    args = typing.get_args(tp)
    for a in args:
        if value == a and type(value) is type(a):
            return a
    if isinstance(value, str):
        for a in args:
            if str(a) == value or (isinstance(a, str) and a.lower() == value.lower()):
                return a
    raise _Mismatch


def _coerce_sequence(value: Any, tp: Any, key: str) -> tuple | list:
    """A tuple or list (bare, ``tuple[X, ...]``, fixed ``tuple[X, Y]``, ``list[X]``); a string
    is read as YAML, else split at commas."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(value, str):
        parsed = _parse_str(value)
        if isinstance(parsed, (list, tuple)):
            value = parsed
        elif value.strip() == "":
            value = []
        else:
            value = [v.strip() for v in value.strip().strip("()[]").split(",")]
    if not isinstance(value, (list, tuple)):
        raise _Mismatch
    if origin is tuple and args and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise _Mismatch
        items = [
            _coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args, strict=True))
        ]
    else:
        elem = args[0] if args else Any
        items = [_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if (origin is tuple or tp is tuple) else items


def _coerce_dict(value: Any, tp: Any, key: str) -> dict:
    if isinstance(value, str):
        value = _parse_str(value)
    if not isinstance(value, dict):
        raise _Mismatch
    kt, vt = typing.get_args(tp) or (Any, Any)
    return {_coerce(k, kt, key): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}


def _coerce_dataclass(value: Any, tp: Any, key: str) -> Any:
    """An instance, a preset's name (``tp.preset``), or a mapping of its fields."""
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    if isinstance(value, str):
        preset = getattr(tp, "preset", None)
        if callable(preset):
            try:
                return preset(value.strip())
            except (KeyError, ValueError) as e:
                raise ConfigError(f"key {key!r}: {e}") from None
        value = _parse_str(value)
    if isinstance(value, dict):
        return from_dict(tp, value, _prefix=key + ".")
    raise _Mismatch


def _coerce_bool(value: Any, tp: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _Mismatch


def _coerce_int(value: Any, tp: Any, key: str) -> int:
    """An int, or a whole float that holds it exactly (:func:`_exact_int`); never a bool."""
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return _exact_int(value, key)
    if not isinstance(value, str):
        raise _Mismatch
    s = value.strip()
    try:
        return int(s)
    except ValueError:
        pass
    try:
        f = float(s)
    except ValueError:
        raise _Mismatch from None
    return _exact_int(f, key, s)


def _coerce_float(value: Any, tp: Any, key: str) -> float:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            raise _Mismatch from None
    raise _Mismatch


def _coerce_str(value: Any, tp: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)  # `out=123` from YAML
    raise _Mismatch


def _coerce_path(value: Any, tp: Any, key: str) -> Path:
    if isinstance(value, (str, os.PathLike)):
        return Path(value)
    raise _Mismatch


_Coercer = typing.Callable[[Any, Any, str], Any]

# The coercer of each generic annotation form, by its origin (``list[int]`` -> list).
_FORMS: dict[Any, _Coercer] = {
    Union: _coerce_union,
    types.UnionType: _coerce_union,
    Literal: _coerce_literal,
    tuple: _coerce_sequence,
    list: _coerce_sequence,
    dict: _coerce_dict,
}
# The coercer of each bare type; dataclasses and other classes are handled after a miss.
_TYPES: dict[Any, _Coercer] = {
    type(None): _coerce_none,
    tuple: _coerce_sequence,
    list: _coerce_sequence,
    dict: _coerce_dict,
    bool: _coerce_bool,
    int: _coerce_int,
    float: _coerce_float,
    str: _coerce_str,
    Path: _coerce_path,
    os.PathLike: _coerce_path,
}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """``value`` converted to annotation ``tp``; raises ``_Mismatch`` if it does not fit."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    coercer = _TYPES.get(tp) if origin is None else _FORMS.get(origin)
    if coercer is not None:
        return coercer(value, tp, key)
    if _is_dataclass_type(tp):
        return _coerce_dataclass(value, tp, key)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _Mismatch
    return value  # unknown typing construct: pass through


def _type_error(key: str, value: Any, tp: Any) -> ConfigError:
    return ConfigError(f"key {key!r}: expected {_type_name(tp)}, got {value!r}")


def _removed(cls: type, key: str) -> ConfigError | None:
    """The error for a key ``cls`` no longer has (its ``_removed_keys``, ``{old dotted key
    or group: what replaces it}``, as docs/release-notes.md lists them); None for any
    other key."""
    removed: dict[str, str] = getattr(cls, "_removed_keys", None) or {}
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        old = ".".join(parts[:n])
        if old in removed:
            return ConfigError(
                f"key {key!r} was removed ({cls.__name__}, docs/release-notes.md): "
                f"write {removed[old]}"
            )
    return None


def _unknown_key(cls: type, key: str, local: str, prefix: str, value: Any = None) -> ConfigError:
    rel = key[len(prefix) :]
    while isinstance(value, dict) and value:  # a YAML group: its first key, dotted
        sub, value = next(iter(value.items()))
        rel += f".{sub}"
    removed = _removed(cls, rel)
    if removed is not None:
        return removed
    valid = list(_fields(cls))
    all_keys = config_keys(cls, prefix)
    guess = difflib.get_close_matches(local, valid, n=1, cutoff=0.6) or difflib.get_close_matches(
        key, all_keys, n=1, cutoff=0.6
    )
    hint = ""
    if guess:
        full = prefix + guess[0] if guess[0] in valid else guess[0]
        hint = f"; did you mean {full!r}?"
    where = f" in {prefix.rstrip('.')!r}" if prefix else ""
    return ConfigError(
        f"unknown key {key!r}{where} ({cls.__name__}){hint} valid keys: {', '.join(valid)}"
    )


def _construct(cls: type[T], kwargs: dict[str, Any], prefix: str) -> T:
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, KeyError) as e:
        where = prefix.rstrip(".") or cls.__name__
        raise ConfigError(f"invalid {where}: {e}") from None


def from_dict(cls: type[T], data: dict[str, Any] | None, *, _prefix: str = "") -> T:
    """Build ``cls`` from nested plain data (as :func:`to_dict` or YAML produce).

    Missing keys take the field defaults; unknown keys and ill-typed values raise
    :class:`ConfigError` naming the dotted key.
    """
    if not _is_dataclass_type(cls):
        raise TypeError(f"from_dict expects a dataclass type, got {cls!r}")
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(
            f"{_prefix.rstrip('.') or cls.__name__}: expected a mapping of "
            f"keys to values, got {type(data).__name__} {data!r}"
        )
    fields = _fields(cls)
    hints = _hints(cls)  # type: ignore[arg-type]  # a dataclass type: hashable
    kwargs = {}
    for k, v in data.items():
        key = _prefix + str(k)
        if k not in fields:
            raise _unknown_key(cls, key, str(k), _prefix, v)
        tp = hints[k]
        try:
            kwargs[k] = _coerce(v, tp, key)
        except _Mismatch:
            raise _type_error(key, v, tp) from None
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            f"{_prefix.rstrip('.') or cls.__name__}: missing required "
            f"key(s) {', '.join(repr(_prefix + m) for m in missing)}"
        )
    return _construct(cls, kwargs, _prefix)


def load_yaml(cls: type[T], path: str | os.PathLike) -> T:
    """Read a YAML file into ``cls`` (strictly: unknown keys and bad types raise)."""
    path = Path(path)
    try:
        data = yaml.safe_load(read_text(path, what="config file"))
    except OSError as e:  # missing, a folder, unreadable: the message names the file
        raise ConfigError(str(e)) from None
    except ValueError as e:  # not UTF-8
        raise ConfigError(str(e)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML{where}: {problem}"
        ) from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} holds a YAML {type(data).__name__}; "
            "expected a mapping of config keys (key: value)"
        )
    try:
        return from_dict(cls, data or {})
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None


# ----------------------------------------------------------------------------- overrides


def parse_overrides(overrides: typing.Iterable[str]) -> list[tuple[str, str]]:
    """``["a.b=3", ...]`` -> ``[("a.b", "3"), ...]``; raises on items without ``=``."""
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} is not of the form key=value "
                f"(dotted keys for nested fields, e.g. optim.lr=1e-3)"
            )
        k, v = item.split("=", 1)
        k = k.strip()
        if not k:
            raise ConfigError(f"override {item!r} has an empty key")
        out.append((k, v))
    return out


class _Pending:
    """A config being edited by overrides: its class and field values, not yet validated.

    Overrides edit these in place; the config objects are built (and their ``__post_init__``
    checks run) once, after the last override, so a check that relates two fields never sees
    a half-applied combination and the order of the overrides does not matter.
    """

    def __init__(self, cls: type, values: dict[str, Any]):
        self.cls, self.values = cls, values

    @classmethod
    def of(cls, cfg: Any) -> _Pending:
        return cls(type(cfg), {n: getattr(cfg, n) for n in _fields(type(cfg))})


def _set(node: _Pending, parts: list[str], raw: Any, prefix: str) -> None:
    fields = _fields(node.cls)
    name = parts[0]
    key = prefix + name
    if name not in fields:
        raise _unknown_key(node.cls, prefix + ".".join(parts), name, prefix)
    tp = _hints(node.cls)[name]
    if len(parts) == 1:
        try:
            node.values[name] = _coerce(raw, tp, key)
        except _Mismatch:
            raise _type_error(key, raw, tp) from None
        return
    sub = node.values[name]
    sub_tp = _strip_optional(tp)
    if not _is_dataclass_type(sub_tp):
        raise ConfigError(
            f"key {prefix + '.'.join(parts)!r}: {key!r} is a {_type_name(tp)}, not a nested config"
        )
    if not isinstance(sub, _Pending):
        sub = node.values[name] = _Pending.of(sub_tp() if sub is None else sub)
    _set(sub, parts[1:], raw, key + ".")


def _build(node: _Pending, prefix: str) -> Any:
    kwargs = {
        n: _build(v, prefix + n + ".") if isinstance(v, _Pending) else v
        for n, v in node.values.items()
    }
    return _construct(node.cls, kwargs, prefix)


def apply_overrides(cfg: T, overrides: typing.Iterable[str] | dict[str, Any]) -> T:
    """Return ``cfg`` with ``key=value`` overrides applied, left to right, then validated once
    (so ``precision.bf16_first=3 precision.bf16_last=0`` and the reverse order are the same
    request).

    Keys are dotted for nested dataclasses (``model.d_model=256``). Values are strings
    coerced from the field annotation: numbers (``1e-3``, ``10_000``), booleans
    (``true``/``false``), ``none``, tuples (``0.9,0.95`` or ``[0.9, 0.95]``), literals,
    or a preset name for a nested config (``model=small``). A dict ``{key: value}`` is
    accepted too (values may then be typed already). A config class may define a
    ``_aliases`` class attribute ``{shorthand: dotted key}`` (e.g. ``lr -> optim.lr``), and
    ``_removed_keys`` ``{old key: what replaces it}``, which the unknown-key error names
    (here and in :func:`from_dict`).
    """
    items = list(overrides.items()) if isinstance(overrides, dict) else parse_overrides(overrides)
    aliases: dict[str, str] = getattr(type(cfg), "_aliases", None) or {}
    if not items:
        return cfg
    items = [(aliases.get(k, k), v) for k, v in items]
    root = _Pending.of(cfg)
    for k, v in items:
        _set(root, k.split("."), v, "")
    return _build(root, "")
