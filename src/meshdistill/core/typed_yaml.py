"""Typed dataclasses from nested YAML mappings, with dotted-key errors (`ConfigError`): the config's reader and the
error every setting check raises, below every package that checks a setting (`meshdistill.config`, the teacher sources).

`from_dict` builds a (nested) frozen dataclass from a mapping: every key must be a field
(an unknown key is reported with its full dotted path, the closest valid key and the list
of valid keys), every value must fit the field's annotation (``int``, ``float``, ``bool``,
``str``, ``None``, unions, tuples, dicts, nested dataclasses), and errors raised by the
dataclass's own validation are re-raised naming the dotted key. `parse_override` and
`set_path` apply ``key.path=value`` overrides (values parsed as YAML).

YAML is read with `load_yaml` / `Loader`: PyYAML's safe loader with YAML 1.2's float syntax added
to its implicit resolver. PyYAML follows YAML 1.1, where a float needs a dot and a signed exponent
(``3.0e-4``), so ``3e-4``, ``1e9`` and ``1.0e9`` would load as strings and be rejected as "wrong type".
Before anything is built from a document, `Loader` refuses (`YamlRefused`, naming the lines):

* a key given twice in one mapping, at any depth (PyYAML keeps the last silently: a second ``train:`` would drop
  the whole first one); a merge key ``<<: *base`` is not a duplicate, the keys written beside it win as YAML says;
* aliases (``*name``) that expand the document by more than `ALIAS_EXPANSION_LIMIT` values beyond those it writes
  (nested aliases grow exponentially, "billion laughs": a few lines expand to billions of values), and an alias
  inside the value it names (a document that contains itself).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Sequence
from typing import Any, Union

import yaml


ALIAS_EXPANSION_LIMIT = 100_000  # values aliases may add to a document (a config writes a few hundred)
_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlRefused(yaml.YAMLError):
  """A YAML document that parses but is refused: a duplicated key, or aliases that expand it beyond
  `ALIAS_EXPANSION_LIMIT` (or into itself). The message names the lines; a reader prefixes the file."""


class Loader(yaml.SafeLoader):
  """`yaml.SafeLoader` that also resolves YAML 1.2 floats (``3e-4``, ``1e9``, ``1.0e9``, ``.5``) as floats, and
  refuses duplicated keys and alias bombs before building anything (`YamlRefused`)."""

  def compose_document(self):
    node = super().compose_document()
    _check_document(self, node)
    return node


def _line(node) -> int:
  return node.start_mark.line + 1


def _places(first, second) -> tuple[str, str]:
  """``("line 3", "line 7")`` of two nodes; with their columns when they share a line."""
  if _line(first) != _line(second):
    return f"line {_line(first)}", f"line {_line(second)}"
  at = [f"line {_line(n)}, column {n.start_mark.column + 1}" for n in (first, second)]
  return at[0], at[1]


def _check_document(loader: Loader, root) -> None:
  """Raises `YamlRefused` for a duplicated key anywhere in the composed document ``root`` or for aliases that
  expand it by more than `ALIAS_EXPANSION_LIMIT` values. Each node is visited once (an alias is the node it names),
  so the check costs what the written document costs, however far its aliases would expand."""
  sizes: dict[int, int] = {}  # id(node) -> values under it with every alias expanded
  open_nodes: set[int] = set()  # the nodes on the way from the root (an alias to one of them: a cycle)

  def size(node, where: str) -> int:
    key = id(node)
    if key in sizes:
      return sizes[key]
    if key in open_nodes:
      raise YamlRefused(f"the value at line {_line(node)} ({where.rstrip('.') or 'the document'}) contains an alias "
                        "to itself: it would never end; write the value out")
    open_nodes.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
      total += sum(size(item, f"{where.rstrip('.')}[{i}].") for i, item in enumerate(node.value))
    elif isinstance(node, yaml.MappingNode):
      seen: dict[Any, Any] = {}
      for key_node, value_node in node.value:
        name = None
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
          name = loader.construct_object(key_node)
          if isinstance(name, typing.Hashable):
            if name in seen:
              (first_key, first_value), second_key = seen[name], key_node
              first, second = _places(first_key, second_key)
              lost = "the whole first section" if isinstance(first_value, yaml.MappingNode) else "the first"
              raise YamlRefused(f"key '{where}{name}' is given twice, at {first} and at {second}: YAML would keep "
                                f"only the second and silently drop {lost}; write each key once (merge the two)")
            seen[name] = (key_node, value_node)
        total += size(key_node, where) + size(value_node, f"{where}{name}." if name is not None else where)
    open_nodes.discard(key)
    sizes[key] = total
    return total

  expanded = size(root, "")
  if expanded - len(sizes) > ALIAS_EXPANSION_LIMIT:
    raise YamlRefused(
      f"its aliases (*name) expand {len(sizes):,} written values to {expanded:,} (more than "
      f"{ALIAS_EXPANSION_LIMIT:,} added: nested aliases grow exponentially, a \"billion laughs\" document); write "
      "the values out, or use fewer nested aliases")


Loader.add_implicit_resolver(
  "tag:yaml.org,2002:float",
  re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)[eE][-+]?[0-9]+
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
  ),
  list("-+0123456789."),
)


def load_yaml(stream: Any) -> Any:
  """YAML text or a file, parsed with `Loader`."""
  return yaml.load(stream, Loader=Loader)  # noqa: S506 -- a SafeLoader subclass


class ConfigError(ValueError):
  """A configuration key or value that cannot be used; the message names the dotted key."""


def positive_int(where: str, v: Any) -> None:
  if isinstance(v, bool) or not isinstance(v, int) or v < 1:
    raise ConfigError(f"{where}={v!r} must be a positive integer")


def nonneg_int(where: str, v: Any) -> None:
  if isinstance(v, bool) or not isinstance(v, int) or v < 0:
    raise ConfigError(f"{where}={v!r} must be an integer >= 0")


def in_range(where: str, v: Any, lo: float, hi: float, lo_open: bool = False, example: str = "") -> None:
  bad = isinstance(v, bool) or not isinstance(v, (int, float))
  if not bad:
    bad = not (v > lo if lo_open else v >= lo) or not v <= hi
  if bad:
    interval = f"{'(' if lo_open else '['}{lo}, {hi}]" if hi != float("inf") else f"{'>' if lo_open else '>='} {lo}"
    raise ConfigError(f"{where}={v!r} must be a number {'in ' if hi != float('inf') else ''}{interval}{example}")


def yaml_names(cls: Any) -> dict[str, str]:
  """Field name -> YAML key; a section names a field that is a Python keyword in ``YAML_NAMES``
  (e.g. ``{"lmbda": "lambda"}``)."""
  return getattr(cls, "YAML_NAMES", {})


def to_plain(x: Any) -> Any:
  if dataclasses.is_dataclass(x):
    names = yaml_names(x)
    return {names.get(f.name, f.name): to_plain(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
  if isinstance(x, (list, tuple)):
    return [to_plain(v) for v in x]
  if isinstance(x, dict):
    return {k: to_plain(v) for k, v in x.items()}
  return x


def _type_name(t: Any) -> str:
  if t is type(None):
    return "null"
  if typing.get_origin(t) in (Union, types.UnionType):
    return " or ".join(_type_name(a) for a in typing.get_args(t))
  if typing.get_origin(t) is not None:
    return getattr(typing.get_origin(t), "__name__", str(t))
  return getattr(t, "__name__", str(t))


def _matches(t: Any, v: Any) -> tuple[bool, Any]:
  """Whether YAML value ``v`` fits annotation ``t``; returns (ok, converted value)."""
  if t is Any:
    return True, v
  origin = typing.get_origin(t)
  if origin in (Union, types.UnionType):
    for a in typing.get_args(t):
      ok, cv = _matches(a, v)
      if ok:
        return True, cv
    return False, v
  if origin is tuple:
    if not isinstance(v, (list, tuple)):
      return False, v
    args = typing.get_args(t)
    inner = args[0] if args else Any
    conv = []
    for item in v:
      ok, cv = _matches(inner, item)
      if not ok:
        return False, v
      conv.append(cv)
    return True, tuple(conv)
  if origin is dict or t is dict:
    return isinstance(v, dict), v
  if t is type(None):
    return v is None, v
  if t is bool:
    return isinstance(v, bool), v
  if t is int:
    return isinstance(v, int) and not isinstance(v, bool), v
  if t is float:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    return ok, float(v) if ok else v
  if t is str:
    return isinstance(v, str), v
  if isinstance(t, type):
    return isinstance(v, t), v
  return True, v


def _optional_dataclass(t: Any) -> Any:
  """The dataclass of an annotation ``SomeDataclass | None``, else None."""
  if typing.get_origin(t) not in (Union, types.UnionType):
    return None
  args = [a for a in typing.get_args(t) if a is not type(None)]
  return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def unknown_key(where: str, key: str, allowed: Sequence[str]) -> ConfigError:
  close = difflib.get_close_matches(str(key), allowed, n=1)
  hint = f" (did you mean '{where}{close[0]}'?)" if close else ""
  return ConfigError(
    f"unknown key '{where}{key}'{hint}; valid keys in {where.rstrip('.') or 'the config'}: {sorted(allowed)}"
  )


def api_to_config(message: str, owners: Sequence[str], config_key) -> str:
  """``message`` with each API name ``Owner.setting`` (``Owner`` in ``owners``, e.g. ``LogitKD.alpha``) written
  as its config key ``config_key(setting)`` (e.g. ``distill.alpha``): the one place where errors of the
  library's objects are translated into the config's names."""
  if not owners:
    return message
  pattern = re.compile(rf"\b(?:{'|'.join(map(re.escape, owners))})\.(\w+)")
  return pattern.sub(lambda m: config_key(m.group(1)), message)


def from_dict(cls: type, raw: Any, where: str = "", base: Any = None) -> Any:
  """Builds dataclass ``cls`` from a nested dict, checking keys and value types.

  Keys missing from ``raw`` keep their values in ``base`` (default: ``cls()``; a class with a
  ``section_base(raw, base)`` classmethod chooses it), section by section, so a file may give only
  the settings it changes. Raises `ConfigError` naming the
  dotted key (``where`` is the prefix, e.g. ``"train."``).
  """
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise ConfigError(f"'{where.rstrip('.') or 'config'}' must be a mapping of keys to values, got {raw!r}")
  base = cls() if base is None else base
  if hasattr(cls, "section_base"):  # a section may choose what the mapping overlays (e.g. a new strategy kind)
    base = cls.section_base(raw, base)
  fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
  hints = typing.get_type_hints(cls)
  kwargs = {name: getattr(base, name) for name in fields}
  field_of = {v: k for k, v in yaml_names(cls).items()}
  for yaml_key, value in raw.items():
    key = field_of.get(yaml_key, yaml_key)
    if key not in fields or yaml_key in yaml_names(cls):
      raise unknown_key(where, yaml_key, [yaml_names(cls).get(f, f) for f in fields])
    t = hints[key]
    if isinstance(t, type) and dataclasses.is_dataclass(t):
      kwargs[key] = from_dict(t, value, f"{where}{key}.", getattr(base, key))
      continue
    optional = _optional_dataclass(t)
    if optional is not None and isinstance(value, dict):  # e.g. `moe: {n_experts: 8}` for `MoeConfig | None`
      current = getattr(base, key)
      kwargs[key] = from_dict(optional, value, f"{where}{key}.", current if isinstance(current, optional) else None)
      continue
    ok, conv = _matches(t, value)
    if not ok:
      null = (" (YAML reads a bare ~ or null as None: write a path such as '~/runs/x' or quote it)"
              if value is None else "")
      raise ConfigError(f"{where}{key}={value!r} has the wrong type: expected {_type_name(t)}{null}")
    kwargs[key] = conv
  try:
    return cls(**kwargs)
  except ConfigError:
    raise
  except ValueError as e:
    msg = str(e)
    section = where.rstrip(".")
    # Messages of other modules' configs name e.g. "ModelConfig.d_model"; name the config key instead.
    msg = api_to_config(msg, [cls.__name__], lambda key: f"{where}{key}")
    if section and not msg.startswith(section):
      msg = f"{section}: {msg}"
    raise ConfigError(msg) from None


# --------------------------------------------------------------------------- loading
def parse_override(item: str) -> tuple[list[str], Any]:
  if "=" not in item:
    raise ConfigError(f"override {item!r} must look like key.path=value, e.g. train.steps=200")
  key, text = item.split("=", 1)
  key = key.strip()
  if not key or any(not part for part in key.split(".")):
    raise ConfigError(f"override {item!r} has an empty key; write e.g. train.steps=200")
  try:
    value = load_yaml(text) if text.strip() else None
  except YamlRefused as e:
    raise ConfigError(f"override {item!r}: {e}") from None
  except yaml.YAMLError as e:
    raise ConfigError(f"override {item!r}: the value is not valid YAML ({e})") from None
  return key.split("."), value


def set_path(tree: dict, path: list[str], value: Any, item: str) -> None:
  node = tree
  for i, part in enumerate(path[:-1]):
    child = node.get(part)
    if child is None:
      child = node[part] = {}
    if not isinstance(child, dict):
      raise ConfigError(f"override {item!r}: '{'.'.join(path[: i + 1])}' is a value ({child!r}), not a section")
    node = child
  node[path[-1]] = value
