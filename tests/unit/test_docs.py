"""The documentation: the generated reference pages match the code, every relative link points
to a file that exists, and the README keeps its size and its first two commands."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "docs_reference.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("docs_reference", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_pages_match_the_code(tool):
    for rel, text in tool.pages().items():
        path = ROOT / rel
        assert path.is_file(), f"{rel} is missing: run `python tools/docs_reference.py`"
        assert path.read_text(encoding="utf-8") == text, (
            f"{rel} is out of date with the code: run `python tools/docs_reference.py`")


def test_config_reference_lists_every_key(tool):
    from chunk_grpo.config.schema import PATHS, TrainConfig

    text = tool.config_reference()
    for path in PATHS:
        assert f"| `{path}` |" in text, path
    assert "| `optim.lr` | float | `0.001` |" in text
    assert f"`{TrainConfig().reward.name}`" in text


def test_field_comments_join_the_lines_above_and_beside():
    from chunk_grpo.config.describe import field_comments
    from chunk_grpo.config.schema import ModelConfig, RunConfig

    model = field_comments(ModelConfig)
    assert model["base_quantization"] == (
        "LoRA's frozen base in 4 or 8 bits (QLoRA, bitsandbytes; chunk_grpo.models.quantize)")
    assert model["mixed_precision"] == "auto: bf16 where native, else fp32"
    assert model["lora_rank"] == "0 = full fine-tuning"
    assert model["gradient_checkpointing"] == ""
    assert RunConfig.__dataclass_fields__["export"].name in field_comments(RunConfig)


# [text](target) and ![alt](target), outside code; the target up to a space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def relative_links(page: Path) -> list[str]:
    text = INLINE_CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(text)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    dashes, a repeated heading suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_links_point_to_files_and_headings_that_exist():
    broken = []
    for page in PAGES:
        links = relative_links(page) + [t for t in LINK.findall(
            INLINE_CODE.sub("", FENCE.sub("", page.read_text(encoding="utf-8"))))
            if t.startswith("#")]
        for target in links:
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{page.relative_to(ROOT)} -> {target} (no such heading)")
    assert not broken, "broken relative links: " + "; ".join(broken)


def test_anchors_follow_github(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# Quantized base: `model.base_quantization: none | nf4 | int8`\n"
                    "## FLUX.1-dev on one GPU\n## 2026-11-23: mixed precision by CPU\n"
                    "## Notes\n## Notes\n```\n# not a heading\n```\n")
    assert anchors(page) == {"quantized-base-modelbase_quantization-none--nf4--int8",
                             "flux1-dev-on-one-gpu", "2026-11-23-mixed-precision-by-cpu",
                             "notes", "notes-1"}


def test_link_finder_skips_code_and_urls(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("[a](x.md) ![i](img/y.png) [u](https://e.org/z.md) [s](#top)\n"
                    "`[c](code.md)`\n```\n[f](fenced.md)\n```\n[b](docs/b.md#part)\n")
    assert relative_links(page) == ["x.md", "img/y.png", "docs/b.md#part"]


def test_readme_is_short_and_opens_with_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250, "README.md is over 250 lines: move detail to docs/"
    first = re.search(r"```bash\n(.*?)```", readme, re.DOTALL).group(1).splitlines()
    commands = [line.split("#", 1)[0].strip() for line in first]
    assert commands == [
        'pip install -c constraints/ci.txt -e ".[dev]" && python -m chunk_grpo.train',
        "python -m pytest -q"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert 'pip install -q -c constraints/ci.txt -e ".[dev]"' in ci
    assert "python -m pytest -q" in ci
