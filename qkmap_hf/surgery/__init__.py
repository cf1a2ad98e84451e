"""Model surgery: edits of a loaded model that keep its function, beside ``modeling/`` whose classes they edit.

``input_norm``: the input norm of converted QK-Norm models (its power, the calibration of ``r``, folding it into
the projections), which healing anneals away. ``export_qwen3``: a ``qk_norm`` model saved back as a genuine
Qwen3 checkpoint. Neither converts a checkpoint (``qkmap_hf.conversion``) or trains (``qkmap_hf.training``).
"""

from __future__ import annotations

from .export_qwen3 import save_qk_norm_as_qwen3
from .input_norm import calibrate_reference_scale, fold_input_norm, set_input_norm_power

__all__ = ["calibrate_reference_scale", "fold_input_norm", "save_qk_norm_as_qwen3", "set_input_norm_power"]
