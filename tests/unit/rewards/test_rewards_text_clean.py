"""The CLIP prompt cleaning of OpenAI's and open_clip's tokenizers (ftfy, HTML, whitespace)."""

import pytest

from chunk_grpo.rewards.text_clean import clip_clean


@pytest.mark.parametrize("prompt,clean", [
    ("Tom &amp; Jerry", "Tom & Jerry"),
    ("Tom &amp;amp; Jerry", "Tom & Jerry"),  # unescaped twice
    ("Van Gogh\u2019s \u201cStarry Night\u201d", 'Van Gogh\'s "Starry Night"'),
    ("  a  cat\n\ton a\u00a0mat ", "a cat on a mat"),
    ("\ufb01ne caf\u0065\u0301", "fine caf\u00e9"),  # ligature; NFC
    ("a red circle", "a red circle"),
])
def test_clip_clean(prompt, clean):
    assert clip_clean(prompt) == clean
