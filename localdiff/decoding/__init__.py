"""Composable sampler parts working on logits and ids only (DESIGN.md "sampling/"): canvas init and renoising,
temperature schedules, categorical draws, acceptance (entropy bound, confidence locking), Re-Noising correction,
stopping."""
from localdiff.decoding.acceptance import AcceptanceConfig, accept, token_entropy
from localdiff.decoding.canvas import init_canvas, renoise
from localdiff.decoding.correction import CorrectionConfig, correct
from localdiff.decoding.draws import categorical
from localdiff.decoding.schedules import linear_temperature
from localdiff.decoding.stopping import StableAndConfident, finalize_canvas

__all__ = ["AcceptanceConfig", "accept", "token_entropy", "init_canvas", "renoise", "CorrectionConfig", "correct",
           "categorical", "linear_temperature", "StableAndConfident", "finalize_canvas"]
