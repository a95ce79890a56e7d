"""Load a run configuration: TOML file, then dotted CLI overrides, then validation.

Contract: ``load_config(path, ["trainer.lr=1e-5", "run.name=x"])`` returns a validated
:class:`ShipyardConfig` or raises :class:`ConfigError` whose message names the file, the dotted
field and the offending value. Override values are parsed as TOML literals (numbers, booleans,
arrays, quoted strings) and fall back to bare strings. Derived values live in :func:`derive`.
Relative ``tasks.files`` and ``eval.files`` entries written in the file are resolved against the file's directory
(:func:`_resolve_file_paths`); :func:`derive` makes the rest (overrides) absolute against the
working directory, so the paths mean the same in every process.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from shipyard.config.schema import ShipyardConfig


class ConfigError(ValueError):
    """A configuration file or override is wrong; the message says which field and how to fix it."""


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``a.b.c=value`` into its key path and its TOML-parsed value."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value (e.g. trainer.lr=1e-5)")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override {text!r} has an empty field name")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def _set_path(tree: dict[str, Any], parts: list[str], value: Any) -> None:
    node = tree
    for p in parts[:-1]:
        child = node.setdefault(p, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override of {'.'.join(parts)}: {p} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(
                f"  {field}: unknown field (check the spelling; `shipyard train CONFIG --dry-run` lists fields)"
            )
        else:
            lines.append(f"  {field}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> ShipyardConfig:
    """Read ``path`` (TOML; None = all defaults), apply ``overrides``, validate."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (see configs/ for examples)")
        try:
            tree = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {p} is not valid TOML: {e}") from e
        source = str(p)
        _resolve_file_paths(tree, p.parent)
    for text in overrides or []:
        parts, value = parse_override(text)
        _set_path(tree, parts, value)
    if overrides:
        source += " + overrides " + " ".join(overrides)
    try:
        return derive(ShipyardConfig.model_validate(tree))
    except ValidationError as e:
        raise ConfigError(_format_errors(e, source)) from None


def _resolve_file_paths(tree: dict[str, Any], base: Path) -> None:
    """Make the relative ``tasks.files`` and ``eval.files`` entries of a config file's ``tree``
    absolute against ``base``."""
    for section in ("tasks", "eval"):
        table = tree.get(section)
        files = table.get("files") if isinstance(table, dict) else None
        if isinstance(files, list):
            table["files"] = [
                os.path.abspath(base / f)
                if isinstance(f, str) and not os.path.isabs(os.path.expanduser(f))
                else f
                for f in files
            ]


def derive(cfg: ShipyardConfig) -> ShipyardConfig:
    """The one place where values are derived from others (none rewrite user-set values; relative
    ``tasks.files``, ``eval.files``, ``harness.files`` and ``harness.venv`` paths are made absolute against the
    working directory, ``~`` expanded, so Ray actors started elsewhere read the same files)."""
    cfg.tasks.files = [os.path.abspath(os.path.expanduser(f)) for f in cfg.tasks.files]
    cfg.eval.files = [os.path.abspath(os.path.expanduser(f)) for f in cfg.eval.files]
    h = cfg.harness
    h.files, h.venv = (os.path.abspath(os.path.expanduser(p)) if p else "" for p in (h.files, h.venv))
    return cfg


def to_toml(cfg: ShipyardConfig) -> str:
    """Render the resolved config as TOML (what `--dry-run` prints)."""
    out: list[str] = []
    for section, values in cfg.model_dump().items():
        _toml_table(out, section, values)
    return "\n".join(out)


def _toml_table(out: list[str], name: str, values: dict[str, Any]) -> None:
    """Append ``[name]`` with its values, then its nested sections as ``[name.child]`` tables."""
    out.append(f"[{name}]")
    for k, v in values.items():
        if not isinstance(v, dict):
            out.append(f"# {k} is unset" if v is None else f"{k} = {_toml_value(v)}")
    out.append("")
    for k, v in values.items():
        if isinstance(v, dict):
            _toml_table(out, f"{name}.{k}", v)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an element of a list of sections: an inline table
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    return json.dumps(str(v))  # JSON string escapes are valid TOML basic-string escapes
