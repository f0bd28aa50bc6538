"""The public names a transformers user looks for (`md.generate`, `md.export`, `md.load_run`, `md.load_hf`) are the
functions behind them, and the docs set them beside their transformers counterparts."""

import dataclasses
import pathlib
import re

import meshdistill as md

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs"


def test_md_generate_is_the_sampler_and_md_export_the_run_export():
  from meshdistill.jobs.export import export_run
  from meshdistill.models import generate as sampler

  assert md.generate is sampler.generate  # the function, not the module of the same name
  assert (md.SamplingConfig, md.left_pad, md.Generation) == (sampler.SamplingConfig, sampler.left_pad,
                                                              sampler.Generation)
  assert md.export is export_run
  assert {"generate", "SamplingConfig", "left_pad", "Generation", "export"} <= set(md.__all__)
  assert md.compress.__name__ == "meshdistill.models.compress"  # a submodule entry still resolves to the module


def test_the_sampling_settings_are_documented_beside_transformers():
  text = (DOCS / "generation.md").read_text()
  section = text[text.index("### Sampling settings"):]
  section = section[:section.index("\n## ")]
  for field in dataclasses.fields(md.SamplingConfig):  # every setting, with its default and transformers' name
    row = next((line for line in section.splitlines() if line.startswith(f"| `{field.name}`")), None)
    assert row is not None, f"docs/generation.md's sampling table has no row for {field.name}"
    assert f"`{field.default}`" in row, (field.name, row)


def test_the_hugging_face_doc_sets_the_entry_points_beside_transformers():
  text = (DOCS / "huggingface.md").read_text()
  table = text[text.index("## Side by side with transformers"):]
  for name in ("md.load_hf", "md.export_hf", "md.export", "md.load_run", "md.generate", "md.export_quantized"):
    assert re.search(rf"`{re.escape(name)}\(", table), name
    assert callable(getattr(md, name.removeprefix("md.")))
