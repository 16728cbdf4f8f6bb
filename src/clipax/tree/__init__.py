"""Clipping rules as pure functions on pytrees, usable outside Optax."""

from clipax.tree._global_norm import clip_by_global_norm as clip_by_global_norm
from clipax.tree._global_norm import global_norm as global_norm
from clipax.tree._group_norms import group_norms as group_norms
from clipax.tree._norm import clip_by_norm as clip_by_norm
from clipax.tree._per_example import (
    per_example_global_norm_clip as per_example_global_norm_clip,
)
from clipax.tree._per_example import (
    per_example_layer_norm_clip as per_example_layer_norm_clip,
)
from clipax.tree._value import clip_by_value as clip_by_value

__all__ = [
    "clip_by_global_norm",
    "clip_by_norm",
    "clip_by_value",
    "global_norm",
    "group_norms",
    "per_example_global_norm_clip",
    "per_example_layer_norm_clip",
]
