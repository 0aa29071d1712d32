"""Evaluation: held-out perplexity and SFT loss, the generation check, and the publish gate,
on HF-format artifacts with plain transformers.
"""
