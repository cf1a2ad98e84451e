"""Training, up-training, PEFT and the mode comparison (``qkmap train``, ``qkmap compare``).

Heavy imports (transformers' Trainer, peft, matplotlib) load with the submodule that needs them.
"""

from .presets import PRESETS, SizePreset, count_parameters, get_preset, preset_config

__all__ = ["PRESETS", "SizePreset", "count_parameters", "get_preset", "preset_config"]
