"""The prompt cleaning that OpenAI's CLIP tokenizer (and open_clip's copy of it) does before BPE.

`clip.simple_tokenizer` and `open_clip.tokenizer` run `ftfy.fix_text` (mojibake, curly quotes to
straight ones, ligatures, full-width forms, NFC), `html.unescape` twice (`Tom &amp;amp; Jerry`
-> `Tom & Jerry`), strip, and collapse every run of whitespace to one space; then lowercase. A
transformers CLIP tokenizer (tokenizer.json) only does NFC, the whitespace collapse and the
lowercase, so `clip_clean(prompt)` fed to it gives the tokens OpenAI's and open_clip's give.
Rewards whose authors use those tokenizers (`hpsv2`, `clip`) clean their prompts with it;
PickScore's authors use transformers' tokenizer, so `pickscore` does not.
"""

from __future__ import annotations

import html

import regex

_WHITESPACE = regex.compile(r"\s+")  # the `regex` module's \s, as the original's


def clip_clean(text: str) -> str:
    """basic_clean then whitespace_clean of OpenAI's simple_tokenizer (lowercasing is left to
    the tokenizer's normaliser)."""
    import ftfy  # imported here: only the CLIP-text rewards need it

    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return _WHITESPACE.sub(" ", text).strip()
