"""Writes the packaged ``default.yaml`` from the defaults of `meshdistill.config.Config`.

The dataclass defaults are the one source of the main job's settings; run this after changing
one of them (``tests/test_config.py`` fails until the file matches):

    python scripts/write_default_config.py          # rewrites src/meshdistill/config/presets/default.yaml
    python scripts/write_default_config.py --check  # exit status 1 when the file is out of date
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from meshdistill.config import Config
from meshdistill.config.files import default_yaml

PATH = pathlib.Path(__file__).resolve().parents[1] / "src" / "meshdistill" / "config" / "presets" / "default.yaml"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="only compare; exit 1 when the file differs")
  args = parser.parse_args()
  text = default_yaml(Config().to_dict())
  if args.check:
    same = PATH.read_text(encoding="utf-8") == text
    print(f"{PATH}: {'up to date' if same else 'out of date; run python scripts/write_default_config.py'}")
    return 0 if same else 1
  PATH.write_text(text, encoding="utf-8")
  print(f"wrote {PATH}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
