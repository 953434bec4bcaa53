"""Prompt sets: one loader for every command (train, evaluate, credit, profile, gradient_snr).

A prompt set is named by a string:
  - ``shapes:rl``, ``shapes:train``, ``shapes:heldout``: the embedded world's shipped sets;
  - ``FILE.txt`` (or any other suffix): one prompt a line; blank lines and lines starting with
    ``#`` are skipped;
  - ``FILE.jsonl``: one JSON object a line with a ``prompt`` (or ``caption``) string;
  - ``FILE.csv``: a header row with a ``prompt`` (or ``caption``) column;
  - ``DIR`` or ``DIR::SPLIT``: a Hugging Face ``datasets`` directory written by ``save_to_disk``
    (a DatasetDict needs its split);
  - ``hf:NAME:SPLIT``: a dataset by name, through ``datasets.load_dataset`` (the local cache when
    ``HF_DATASETS_OFFLINE=1``).
``datasets`` is an optional extra (``pip install -e ".[prompts]"``), imported only for the last
two. Every problem (missing, empty, undecodable, a malformed row) is a `PromptSetError`: one line
naming the file, the line and the fix. `check_prompts` runs the set through the model's
tokenizers and the reward's prompt parser before a run starts, so a prompt nothing can read fails
up front rather than at the final evaluation.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path

from chunk_grpo.config.errors import ConfigError

SHAPES_DATA = Path(__file__).resolve().parents[1] / "shapes" / "data"
BUILTIN_SETS = {
    "shapes:rl": SHAPES_DATA / "rl_prompts.txt",
    "shapes:train": SHAPES_DATA / "train_prompts.txt",
    "shapes:heldout": SHAPES_DATA / "heldout_prompts.txt",
}
PROMPT_FIELDS = ("prompt", "caption")  # HPDv2 and GenEval name it prompt, Pick-a-Pic caption
_SPLIT_SEPARATOR = "::"


class PromptSetError(ConfigError):
    """A prompt set cannot be read or holds a prompt the run cannot use; says where and how."""


@dataclass(frozen=True)
class PromptSet:
    """The prompts of a set and, for error messages, where each came from (a line or a row)."""

    source: str
    prompts: list[str]
    places: list[str]  # e.g. "line 12" or "row 7", one per prompt

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompt_set(spec: str | Path) -> PromptSet:
    """Read a prompt set named as the module docstring describes."""
    spec = str(spec)
    if spec in BUILTIN_SETS:
        return _read_file(BUILTIN_SETS[spec])
    if spec.startswith("shapes:"):
        raise PromptSetError(f"unknown built-in prompt set {spec!r}; use one of "
                             f"{', '.join(BUILTIN_SETS)} or a file")
    if spec.startswith("hf:"):
        return _read_hub_dataset(spec)
    path_part, _, split = spec.partition(_SPLIT_SEPARATOR)
    path = Path(path_part).expanduser()
    if path.is_dir():
        return _read_saved_dataset(path, split or None)
    if split:
        raise PromptSetError(f"prompt set {spec!r}: {path_part!r} is not a directory; "
                             f"'{_SPLIT_SEPARATOR}SPLIT' follows a datasets save_to_disk directory")
    return _read_file(path)


def load_prompts(spec: str | Path) -> list[str]:
    """Just the prompts of `load_prompt_set`."""
    return load_prompt_set(spec).prompts


# ----------------------------------------------------------------------------- files

MAX_PROMPT_FILE_BYTES = 128 << 20  # about two million prompts


def _read_text(path: Path) -> str:
    if not path.exists():
        raise PromptSetError(f"prompt file {str(path)!r} does not exist; give a .txt, .jsonl "
                             f"or .csv file, a datasets directory, or one of "
                             f"{', '.join(BUILTIN_SETS)}")
    if not path.is_file():  # a device or pipe (/dev/zero) would be read without end
        raise PromptSetError(f"prompt file {str(path)!r} is not a regular file; give a text "
                             "file of prompts")
    try:
        size = path.stat().st_size
        if size > MAX_PROMPT_FILE_BYTES:
            raise PromptSetError(f"prompt file {str(path)!r} has {size} bytes, more than the "
                                 f"{MAX_PROMPT_FILE_BYTES >> 20} MiB a prompt file may have; "
                                 "split it or give a datasets directory")
        data = path.read_bytes()
    except OSError as err:
        raise PromptSetError(f"cannot read prompt file {str(path)!r}: {err.strerror}") from None
    if b"\x00" in data:
        line = data[:data.index(b"\x00")].count(b"\n") + 1
        raise PromptSetError(f"prompt file {str(path)!r} is not text (a NUL byte on line "
                             f"{line}); give a text file of prompts")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise PromptSetError(
            f"prompt file {str(path)!r} is not UTF-8 text (byte 0x{data[err.start]:02x} on line "
            f"{line}); re-save it as UTF-8, e.g. iconv -f latin1 -t utf-8") from None


def _read_file(path: Path) -> PromptSet:
    text = _read_text(path)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        prompts, places = _parse_jsonl(text, path)
    elif suffix == ".csv":
        prompts, places = _parse_csv(text, path)
    else:
        prompts, places = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.strip()
            if line and not line.startswith("#"):
                prompts.append(line)
                places.append(f"line {number}")
    if not prompts:
        raise PromptSetError(f"prompt file {str(path)!r} has no prompts (only blank lines or "
                             f"'#' comments); write one prompt a line")
    return PromptSet(str(path), prompts, places)


def _prompt_of(row: dict, where: str) -> str:
    for name in PROMPT_FIELDS:
        if name in row:
            value = row[name]
            if not isinstance(value, str) or not value.strip():
                raise PromptSetError(f"{where}: {name!r} must be a non-empty string, "
                                     f"got {value!r}")
            return value.strip()
    raise PromptSetError(f"{where} has no {' or '.join(map(repr, PROMPT_FIELDS))} field "
                         f"(it has {', '.join(map(repr, list(row)[:8])) or 'none'})")


def _parse_jsonl(text: str, path: Path) -> tuple[list[str], list[str]]:
    prompts, places = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"prompt file {str(path)!r} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PromptSetError(f"{where} is not JSON ({err.msg}); write one object a line, "
                                 'e.g. {"prompt": "a red circle"}') from None
        if not isinstance(row, dict):
            raise PromptSetError(f'{where} must be a JSON object like {{"prompt": "..."}}')
        prompts.append(_prompt_of(row, where))
        places.append(f"line {number}")
    return prompts, places


def _parse_csv(text: str, path: Path) -> tuple[list[str], list[str]]:
    reader = csv.DictReader(io.StringIO(text))
    header = reader.fieldnames or []
    if not any(name in header for name in PROMPT_FIELDS):
        raise PromptSetError(f"prompt file {str(path)!r} has no 'prompt' column in its header "
                             f"row (columns: {', '.join(header) or 'none'}); add one")
    prompts, places = [], []
    for row in reader:
        where = f"prompt file {str(path)!r} line {reader.line_num}"
        prompts.append(_prompt_of({k: v for k, v in row.items() if k in PROMPT_FIELDS}, where))
        places.append(f"line {reader.line_num}")
    return prompts, places


# ----------------------------------------------------------------------------- datasets

def _datasets_module():
    try:
        import datasets
    except ImportError:
        raise PromptSetError("a datasets prompt set needs the `datasets` package: "
                             'pip install -e ".[prompts]"') from None
    return datasets


def _from_dataset(table, source: str) -> PromptSet:
    columns = list(table.column_names)
    name = next((c for c in PROMPT_FIELDS if c in columns), None)
    if name is None:
        raise PromptSetError(f"dataset {source!r} has no 'prompt' or 'caption' column "
                             f"(columns: {', '.join(columns)})")
    prompts, places = [], []
    for index, value in enumerate(table[name]):
        prompts.append(_prompt_of({name: value}, f"dataset {source!r} row {index}"))
        places.append(f"row {index}")
    if not prompts:
        raise PromptSetError(f"dataset {source!r} has no rows")
    return PromptSet(source, prompts, places)


def _read_saved_dataset(path: Path, split: str | None) -> PromptSet:
    datasets = _datasets_module()
    source = str(path) + (f"{_SPLIT_SEPARATOR}{split}" if split else "")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise PromptSetError(f"{str(path)!r} is a directory but not a datasets save_to_disk "
                             f"directory ({_first_line(err)}); give a prompt file or such a "
                             f"directory") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split is None or split not in loaded:
            raise PromptSetError(f"dataset {str(path)!r} has splits {', '.join(loaded)}; name one "
                                 f"as {path}{_SPLIT_SEPARATOR}SPLIT")
        loaded = loaded[split]
    elif split is not None:
        raise PromptSetError(f"dataset {str(path)!r} has no splits; drop "
                             f"'{_SPLIT_SEPARATOR}{split}'")
    return _from_dataset(loaded, source)


def _read_hub_dataset(spec: str) -> PromptSet:
    name, _, split = spec[len("hf:"):].partition(":")
    if not name or not split:
        raise PromptSetError(f"prompt set {spec!r}: write hf:NAME:SPLIT, e.g. hf:ORG/DATASET:test")
    datasets = _datasets_module()
    try:
        table = datasets.load_dataset(name, split=split)
    except Exception as err:  # datasets raises many types (connection, missing split, cache)
        raise PromptSetError(f"cannot load dataset {name!r} split {split!r}: {_first_line(err)}; "
                             f"download it on a machine with network access (it is then read "
                             f"from the cache) or save it with save_to_disk and give the "
                             f"directory") from None
    return _from_dataset(table, spec)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ----------------------------------------------------------------------------- checks

def check_prompts(prompt_set: PromptSet, policy, reward=None) -> list[str]:
    """Check every prompt before a run starts; returns notes for the user (e.g. truncation).

    Each prompt goes through the model's tokenizers (all of them: tokenization is where a text
    can fail; the encoders then only read token ids) and, if the reward can check prompts
    (``reward.check_prompts``), through the reward's parser. A prompt longer than a tokenizer's
    limit is truncated there, as FLUX's pipeline does: noted, not refused. Raises
    PromptSetError naming the prompt's place in its file.
    """
    notes = []
    pipeline = getattr(policy, "pipeline", None)
    limits = {"tokenizer": 77, "tokenizer_2": getattr(policy, "max_sequence_length", 512)}
    for attr, limit in limits.items():
        tokenizer = getattr(pipeline, attr, None)
        if tokenizer is None:
            continue
        longest, count = (0, ""), 0
        for prompt, place in zip(prompt_set.prompts, prompt_set.places, strict=True):
            try:
                text = prompt.lower() if reads_lowercase_only(tokenizer) else prompt
                n_tokens = len(tokenizer(text, truncation=False, verbose=False).input_ids)
            except Exception as err:  # a tokenizer may raise anything on a text it cannot read
                raise PromptSetError(f"{prompt_set.source} {place}: the text encoder's {attr} "
                                     f"refuses {_short(prompt)} ({_first_line(err)}); edit or "
                                     f"remove that prompt") from None
            if n_tokens > limit:
                count += 1
                longest = max(longest, (n_tokens, place))
        if count:
            notes.append(f"{count} prompt(s) of {prompt_set.source} exceed {attr}'s {limit} "
                         f"tokens and are truncated as the pipeline does (longest: {longest[1]}, "
                         f"{longest[0]} tokens)")
    checker = getattr(reward, "check_prompts", None)
    if checker is not None:
        for prompt, place in zip(prompt_set.prompts, prompt_set.places, strict=True):
            try:
                checker([prompt])
            except ValueError as err:
                raise PromptSetError(f"{prompt_set.source} {place}: the reward cannot score "
                                     f"{_short(prompt)} ({_first_line(err)}); edit or remove "
                                     f"that prompt, or use another reward") from None
    return notes


def reads_lowercase_only(tokenizer) -> bool:
    """True when no token of the tokenizer's vocabulary has a capital letter: it cannot read
    capitals, so prompts are lowercased for it (the tiny models' word-level T5; a real T5 is
    case-sensitive and gets prompts as written, and CLIP lowercases by itself)."""
    cached = getattr(tokenizer, "_chunk_grpo_lowercase_only", None)
    if cached is None:
        cached = not any(c.isupper() for token in tokenizer.get_vocab() for c in token)
        tokenizer._chunk_grpo_lowercase_only = cached
    return cached


def _short(prompt: str, limit: int = 60) -> str:
    return repr(prompt if len(prompt) <= limit else prompt[:limit] + "...")
