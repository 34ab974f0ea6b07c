"""Composable sampler parts working on logits and ids only (DESIGN.md "sampling/"): canvas init and renoising,
temperature schedules, categorical draws, acceptance (entropy bound, confidence locking), Re-Noising correction,
stopping."""
from .acceptance import AcceptanceConfig, accept, token_entropy
from .canvas import init_canvas, renoise
from .correction import CorrectionConfig, correct
from .draws import categorical
from .schedules import linear_temperature
from .stopping import StableAndConfident, finalize_canvas

__all__ = ["AcceptanceConfig", "accept", "token_entropy", "init_canvas", "renoise", "CorrectionConfig", "correct",
           "categorical", "linear_temperature", "StableAndConfident", "finalize_canvas"]
