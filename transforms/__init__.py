"""Ray Data batch transforms: plain functions (run as Ray tasks) or callable classes (run as actors).

Each transform takes a batch (``dict[str, numpy.ndarray]``) plus keyword parameters bound from YAML
and returns a batch. Add one by writing a function here or in any importable module and naming it
in a ``conf/transforms/*.yaml`` file; ``pipeline/`` needs no change.
"""

from transforms.image import decode_image, random_crop, random_flip, random_resized_crop
from transforms.tabular import stack_features

__all__ = ["decode_image", "random_crop", "random_flip", "random_resized_crop", "stack_features"]
