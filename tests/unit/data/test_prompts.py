"""Prompt sets: every format reads the same prompts, every bad file is one clear error, and the
pre-run check refuses a prompt the reward cannot score and notes over-long ones."""

import json

import pytest

from chunk_grpo.config.errors import ConfigError
from chunk_grpo.data.prompts import (
    BUILTIN_SETS,
    MAX_PROMPT_FILE_BYTES,
    PromptSetError,
    check_prompts,
    load_prompt_set,
    load_prompts,
)
from chunk_grpo.models import FluxPolicy
from chunk_grpo.rewards import get_reward
from chunk_grpo.shapes import HELDOUT_PROMPTS_FILE
from chunk_grpo.shapes import load_prompts as shapes_load_prompts

PROMPTS = ["a red circle", "two blue squares", 'a "quoted", comma prompt']


def _write(tmp_path, kind):
    if kind == "txt":
        path = tmp_path / "p.txt"
        path.write_text("# a comment\n\n" + "\n".join(PROMPTS) + "\n")
    elif kind == "jsonl":
        path = tmp_path / "p.jsonl"
        path.write_text("\n".join(json.dumps({"prompt": p, "id": i})
                                  for i, p in enumerate(PROMPTS)) + "\n\n")
    elif kind == "jsonl-caption":  # Pick-a-Pic names the field caption
        path = tmp_path / "p.jsonl"
        path.write_text("\n".join(json.dumps({"caption": p}) for p in PROMPTS) + "\n")
    else:
        path = tmp_path / "p.csv"
        rows = "".join(f'{i},"{p.replace(chr(34), chr(34) * 2)}"\n' for i, p in enumerate(PROMPTS))
        path.write_text("id,prompt\n" + rows)
    return path


@pytest.mark.parametrize("kind", ["txt", "jsonl", "jsonl-caption", "csv"])
def test_every_format_reads_the_same_prompts(tmp_path, kind):
    assert load_prompts(_write(tmp_path, kind)) == PROMPTS


def test_builtin_sets_match_the_shipped_files():
    assert set(BUILTIN_SETS) == {"shapes:rl", "shapes:train", "shapes:heldout"}
    assert load_prompts("shapes:heldout") == shapes_load_prompts(HELDOUT_PROMPTS_FILE)


def _bad(tmp_path, case):
    path = tmp_path / "bad.txt"
    if case == "missing":
        return tmp_path / "nowhere.txt", "does not exist"
    if case == "empty":
        path.write_text("")
    elif case == "comments-only":
        path.write_text("# only\n\n   \n# comments\n")
    elif case == "latin-1":
        path.write_bytes("a red circle\nun caf\u00e9 rouge\n".encode("latin-1"))
        return path, "not UTF-8 text (byte 0xe9 on line 2)"
    elif case == "jsonl-not-json":
        path = tmp_path / "bad.jsonl"
        path.write_text('{"prompt": "a"}\n{prompt: b}\n')
        return path, "line 2 is not JSON"
    elif case == "jsonl-no-field":
        path = tmp_path / "bad.jsonl"
        path.write_text('{"text": "a"}\n')
        return path, "line 1 has no 'prompt' or 'caption' field"
    elif case == "jsonl-empty-prompt":
        path = tmp_path / "bad.jsonl"
        path.write_text('{"prompt": "a"}\n{"prompt": "  "}\n')
        return path, "line 2: 'prompt' must be a non-empty string"
    elif case == "csv-no-column":
        path = tmp_path / "bad.csv"
        path.write_text("id,text\n1,a\n")
        return path, "no 'prompt' column"
    elif case == "split-on-a-file":
        path.write_text("a\n")
        return f"{path}::train", "is not a directory"
    elif case == "unknown-builtin":
        return "shapes:test", "unknown built-in prompt set"
    elif case == "hf-without-split":
        return "hf:org/name", "write hf:NAME:SPLIT"
    elif case == "device":
        return "/dev/zero", "is not a regular file"
    elif case == "binary":
        path.write_bytes(b"a red circle\n\x00\x00\x01")
        return path, "is not text (a NUL byte on line 2)"
    elif case == "too-large":
        with open(path, "wb") as f:
            f.truncate(MAX_PROMPT_FILE_BYTES + 1)  # sparse: nothing is written
        return path, f"has {MAX_PROMPT_FILE_BYTES + 1} bytes, more than the 128 MiB"
    return path, "has no prompts"


@pytest.mark.parametrize("case", ["missing", "empty", "comments-only", "latin-1", "jsonl-not-json",
                                  "jsonl-no-field", "jsonl-empty-prompt", "csv-no-column",
                                  "split-on-a-file", "unknown-builtin", "hf-without-split",
                                  "device", "binary", "too-large"])
def test_bad_prompt_sets_are_one_line_errors(tmp_path, case):
    spec, message = _bad(tmp_path, case)
    with pytest.raises(PromptSetError) as err:
        load_prompt_set(spec)
    assert isinstance(err.value, ConfigError)  # the CLIs print it in one line, exit status 2
    assert message in str(err.value) and "\n" not in str(err.value)


def test_saved_dataset_directory_with_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"prompt": PROMPTS, "id": [0, 1, 2]})
    datasets.DatasetDict({"test": table}).save_to_disk(tmp_path / "dd")
    table.save_to_disk(tmp_path / "single")
    assert load_prompts(f"{tmp_path / 'dd'}::test") == PROMPTS
    assert load_prompts(tmp_path / "single") == PROMPTS
    with pytest.raises(PromptSetError, match="has splits test; name one"):
        load_prompts(tmp_path / "dd")


@pytest.fixture(scope="module")
def policy(tiny_flux):
    return FluxPolicy.from_pretrained(tiny_flux)


def test_check_refuses_a_prompt_the_reward_cannot_score(tmp_path, policy):
    path = tmp_path / "p.txt"
    good = load_prompts("shapes:heldout")[0]
    path.write_text(f"{good}\n# fine so far\n{good} \U0001F600\n")
    with pytest.raises(PromptSetError, match=r"p.txt line 3: the reward cannot score"):
        check_prompts(load_prompt_set(path), policy, get_reward("shapes"))
    # a reward without a prompt grammar takes any text (the tiny model notes the truncation)
    notes = check_prompts(load_prompt_set(path), policy, reward=object())
    assert all("truncated" in note for note in notes)


def test_check_notes_prompts_longer_than_the_encoder_takes(tmp_path, policy):
    path = tmp_path / "p.txt"
    path.write_text("a red circle\n" + "red " * 5000 + "\n")
    notes = check_prompts(load_prompt_set(path), policy)
    assert len(notes) == 2  # both tokenizers truncate line 2, as the pipeline does
    assert all("1 prompt(s)" in n and "line 2" in n and "truncated" in n for n in notes)
