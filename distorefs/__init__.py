"""distorefs: RL training data (replay buffers, weights, datasets, checkpoints) as files.

This package is the core: store, namespaces, sampling, tiers, codec, config and errors.
It never imports FUSE; the FUSE layer lives in `distorefs.mount`.
"""

__version__ = "0.1.0"
