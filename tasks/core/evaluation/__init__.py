"""Evaluation: held-out perplexity (pooled, and per source of a mixture) and SFT loss, the generation
check (heldout.py, on HF-format artifacts with plain transformers), lm-evaluation-harness scores on
local tasks (benchmark.py), one model in memory at a time (release.py), and the publish gate (verdict.py).
"""
