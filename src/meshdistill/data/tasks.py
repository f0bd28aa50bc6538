"""Tasks with checkable answers: multi-digit arithmetic as prompt -> answer text, with its scorer.

A problem of `ArithmeticTask` (``digits=3``, ``op="+"``), 47 + 985 = 1032::

  prompt      "740+589="       operands zero-padded to ``digits``, each written REVERSED
  completion  "2301"           the answer zero-padded to its fixed width, REVERSED too; the tokenizer's EOS
                               follows it

Every number is written least significant digit first (``reverse=True``, the default). Why: a column sum
depends on the digits to its right (the carry). Written most significant digit first, the first answer
digit needs the whole carry chain before anything is written; written least significant first, answer digit
``i`` is a function of operand digits ``i`` and the carry the model has just written itself. With the
operands reversed as well, operand digit ``i`` sits at a fixed distance from answer digit ``i`` for every
``i``, which a decoder with relative (RoPE) positions finds at once: on this machine a 2-layer d=64 byte-level
model with the answer alone reversed stalled near 9% held-out accuracy after 1,500 steps (it must count
positions to find the right column), while with all numbers reversed it learns the task. Every answer digit
is still a step of generation that conditions on the model's own previous digits (its carries) -- where its
own mistakes compound, the setting on-policy distillation is for. ``reverse=False`` writes every number in
the usual order.

The answer has a fixed width (``digits + 1`` for ``+``, ``2 * digits`` for ``*``): every completion is the
same number of tokens, so a model's length never hides an error.

Splits: a problem ``(a, b)`` belongs to the held-out split when a fixed hash of the pair falls below
``held_out`` (a share of the whole problem space), otherwise to the train split; the two never share a
problem, for any seed or sample size. `ArithmeticTask.rows` draws distinct problems of one split.

Scorer: `ArithmeticTask.score` -- exact match of the final answer (the digits a completion starts with,
up to the first other character) against the true answer of the prompt's own operands.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

OPS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}
SPLITS = ("train", "held_out")
_PROMPT = re.compile(r"^(\d+)([+*])(\d+)=$")


def _held_out_hash(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """A fixed pseudo-random number in [0, 1) per pair ``(a, b)`` (a 64-bit mix; the same on every machine)."""
  with np.errstate(over="ignore"):  # arithmetic modulo 2**64 is the point
    return _mix(a, b)


def _mix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  x = (a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ (b.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019))
  x ^= x >> np.uint64(31)
  x *= np.uint64(0xBF58476D1CE4E5B9)
  x ^= x >> np.uint64(29)
  return (x >> np.uint64(11)).astype(np.float64) / float(1 << 53)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
  """Multi-digit addition (``op="+"``) or multiplication (``op="*"``) of two ``digits``-digit operands.

  Args:
    digits: the difficulty, operands in ``[0, 10**digits)``, 1 to 9.
    op: ``"+"`` or ``"*"``.
    reverse: answers written least significant digit first (see the module docstring).
    held_out: the share of all problems kept for the held-out split, in (0, 1).
  """

  digits: int = 3
  op: str = "+"
  reverse: bool = True
  held_out: float = 0.1

  def __post_init__(self):
    if isinstance(self.digits, bool) or not isinstance(self.digits, int) or not 1 <= self.digits <= 9:
      raise ValueError(f"task digits={self.digits!r} must be an integer in [1, 9] (the operands' length, e.g. 3)")
    if self.op not in OPS:
      raise ValueError(f"task op={self.op!r} is unknown; choose one of {sorted(OPS)}")
    if not isinstance(self.held_out, (int, float)) or isinstance(self.held_out, bool) or not 0 < self.held_out < 1:
      raise ValueError(f"task held_out={self.held_out!r} must be a share in (0, 1) of all problems, e.g. 0.1")

  @property
  def answer_width(self) -> int:
    """Digits of every answer (zero-padded): ``digits + 1`` for ``+``, ``2 * digits`` for ``*``."""
    return self.digits + 1 if self.op == "+" else 2 * self.digits

  @property
  def prompt_len(self) -> int:
    """Characters of every prompt (``"047+985="``)."""
    return 2 * self.digits + 2

  def _write(self, n: int, width: int) -> str:
    text = f"{n:0{width}d}"
    return text[::-1] if self.reverse else text

  def prompt(self, a: int, b: int) -> str:
    return f"{self._write(a, self.digits)}{self.op}{self._write(b, self.digits)}="

  def answer(self, a: int, b: int) -> str:
    """The completion ``a op b`` should get: fixed width, reversed when ``reverse``."""
    return self._write(OPS[self.op](a, b), self.answer_width)

  def operands(self, prompt: str) -> tuple[int, int]:
    """``(a, b)`` of a prompt of this task; ValueError naming the prompt otherwise."""
    m = _PROMPT.match(prompt.strip())
    if m is None or m.group(2) != self.op or len(m.group(1)) != self.digits or len(m.group(3)) != self.digits:
      raise ValueError(f"{prompt!r} is not a prompt of this task (like {self.prompt(47, 985)!r})")
    a, b = m.group(1), m.group(3)
    return (int(a[::-1]), int(b[::-1])) if self.reverse else (int(a), int(b))

  def split_of(self, a, b) -> np.ndarray:
    """True where problem ``(a, b)`` is held out (arrays or ints)."""
    return _held_out_hash(np.asarray(a), np.asarray(b)) < self.held_out

  def problems(self, split: str, n: int, seed: int = 0) -> list[tuple[int, int]]:
    """``n`` distinct problems ``(a, b)`` of ``split`` (``"train"`` or ``"held_out"``), drawn with ``seed``."""
    if split not in SPLITS:
      raise ValueError(f"split={split!r} is unknown; choose one of {SPLITS}")
    space = 10 ** (2 * self.digits)
    share = self.held_out if split == "held_out" else 1 - self.held_out
    if n > 0.9 * share * space:
      raise ValueError(f"{n} distinct {split} problems asked of {self.digits}-digit {self.op!r}, whose {split} split "
                       f"holds about {int(share * space)}; ask for fewer or raise digits")
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    out: dict[tuple[int, int], None] = {}
    while len(out) < n:
      a, b = rng.integers(0, 10**self.digits, size=(2, 2 * (n - len(out)) + 16))
      keep = self.split_of(a, b) == (split == "held_out")
      for pair in zip(a[keep].tolist(), b[keep].tolist()):
        out.setdefault(pair)
        if len(out) == n:
          break
    return list(out)

  def rows(self, split: str, n: int, seed: int = 0) -> list[dict]:
    """``[{"prompt", "completion"}]`` of ``n`` distinct problems of ``split`` (rows of
    `meshdistill.data.prompts.PromptData`)."""
    return [{"prompt": self.prompt(a, b), "completion": self.answer(a, b)} for a, b in self.problems(split, n, seed)]

  @staticmethod
  def final_answer(completion: str) -> str:
    """The answer a completion gives: the digits it starts with (after leading spaces), up to any other character."""
    m = re.match(r"\d*", completion.lstrip())
    return m.group(0)

  def score(self, prompt: str, completion: str) -> bool:
    """Exact match of ``completion``'s final answer with the answer to ``prompt`` (a prompt of this task)."""
    return self.final_answer(completion) == self.answer(*self.operands(prompt))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChainTask:
  """Running sums: a prompt of ``length`` digits ``d_1 .. d_n`` and ``=``, the answer ``s_1 .. s_n`` with
  ``s_i = (s_{i-1} + d_i) mod 10`` (``s_0 = 0``): ``"38205716="`` -> ``"31338562"``.

  Every answer digit is the previous answer digit plus one prompt digit, so a model that reads its own previous digit
  (the short way, which a small model learns) carries an early wrong digit into every later one: one mistake at
  ``s_1`` makes the whole rest wrong. The same interface and scorer (exact match of the final answer) as
  `ArithmeticTask`; the held-out split is a fixed hash of the prompt's digits.

  Args:
    length: digits of every prompt and answer, 2 to 18.
    held_out: the share of all problems kept for the held-out split, in (0, 1).
  """

  length: int = 8
  held_out: float = 0.1

  def __post_init__(self):
    if isinstance(self.length, bool) or not isinstance(self.length, int) or not 2 <= self.length <= 18:
      raise ValueError(f"chain task length={self.length!r} must be an integer in [2, 18] (digits per prompt, e.g. 8)")
    if not isinstance(self.held_out, (int, float)) or isinstance(self.held_out, bool) or not 0 < self.held_out < 1:
      raise ValueError(f"task held_out={self.held_out!r} must be a share in (0, 1) of all problems, e.g. 0.1")

  @property
  def answer_width(self) -> int:
    return self.length

  @property
  def prompt_len(self) -> int:
    return self.length + 1

  def _digits(self, x: int) -> str:
    return f"{x:0{self.length}d}"

  def prompt(self, x: int) -> str:
    return self._digits(x) + "="

  def answer(self, x: int) -> str:
    out, s = [], 0
    for d in self._digits(x):
      s = (s + int(d)) % 10
      out.append(str(s))
    return "".join(out)

  def operand(self, prompt: str) -> int:
    text = prompt.strip()
    if len(text) != self.length + 1 or not text.endswith("=") or not text[:-1].isdigit():
      raise ValueError(f"{prompt!r} is not a prompt of this task (like {self.prompt(38205716 % 10**self.length)!r})")
    return int(text[:-1])

  def split_of(self, x) -> np.ndarray:
    """True where problem ``x`` (the prompt's digits as a number) is held out."""
    return _held_out_hash(np.asarray(x), np.zeros_like(np.asarray(x))) < self.held_out

  def problems(self, split: str, n: int, seed: int = 0) -> list[int]:
    """``n`` distinct problems of ``split`` (``"train"`` or ``"held_out"``), drawn with ``seed``."""
    if split not in SPLITS:
      raise ValueError(f"split={split!r} is unknown; choose one of {SPLITS}")
    share = self.held_out if split == "held_out" else 1 - self.held_out
    if n > 0.9 * share * 10**self.length:
      raise ValueError(f"{n} distinct {split} problems asked of chain length {self.length}, whose {split} split holds "
                       f"about {int(share * 10**self.length)}; ask for fewer or raise length")
    rng = np.random.default_rng([seed, SPLITS.index(split), 7])
    out: dict[int, None] = {}
    while len(out) < n:
      x = rng.integers(0, 10**self.length, size=2 * (n - len(out)) + 16)
      for v in x[self.split_of(x) == (split == "held_out")].tolist():
        out.setdefault(v)
        if len(out) == n:
          break
    return list(out)

  def rows(self, split: str, n: int, seed: int = 0) -> list[dict]:
    return [{"prompt": self.prompt(x), "completion": self.answer(x)} for x in self.problems(split, n, seed)]

  final_answer = staticmethod(ArithmeticTask.final_answer)

  def score(self, prompt: str, completion: str) -> bool:
    return self.final_answer(completion) == self.answer(self.operand(prompt))


def parse_task(spec: str) -> ArithmeticTask | ChainTask:
  """A task from its name: ``add<digits>`` or ``mul<digits>`` (``add3``: 3-digit addition), with an optional
  ``-fwd`` for answers in the usual digit order (``add3-fwd``); ``chain<length>`` (`ChainTask`, e.g. ``chain8``)."""
  chain = re.fullmatch(r"chain(\d+)", str(spec).strip())
  if chain is not None:
    return ChainTask(length=int(chain.group(1)))
  m = re.fullmatch(r"(add|mul)(\d)(-fwd)?", str(spec).strip())
  if m is None:
    raise ValueError(f"task {spec!r} is unknown; use add<digits> or mul<digits> (e.g. add3, mul2; -fwd for answers "
                     "most significant digit first, e.g. add3-fwd), or chain<length> (running sums, e.g. chain8)")
  return ArithmeticTask(digits=int(m.group(2)), op="+" if m.group(1) == "add" else "*", reverse=m.group(3) is None)
