"""The shipped tiny models (FLUX and CLIP), pretrained on the shapes world."""
