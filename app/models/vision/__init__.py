"""Image encoders: a checkpoint's vision tower and projector, turning one image's
processed pixels into the rows the language model reads at its placeholder tokens."""
