"""Evaluation: held-out perplexity (pooled, and per source of a mixture) and SFT loss, the generation
check (heldout.py, on HF-format artifacts with plain transformers), and the publish gate (verdict.py).
"""
