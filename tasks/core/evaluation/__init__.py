"""Evaluation on HF-format artifacts with plain transformers, in the flow process.

- benchmark.py   lm-evaluation-harness scores on local tasks: check, copy, score, compare
- chunked.py     the held-out loss's logits a chunk of positions at a time, bitwise per position
- generation.py  the generation check: greedy replies to held-out prompts stop at the end-of-turn token
- heldout.py     held-out perplexity (pooled and per source) and SFT loss
- lm_eval_progress.py  lm-eval's progress bars drawn as the stage's meter, one metered part per request type
- placement.py   where evaluation puts a model: the CPU, one GPU, or spread over the node's GPUs
- reference.py   the reference model's log-probabilities of every preference pair, once, manifest last
- release.py     one model in memory at a time, given back before the next loads
- sandbox.py     the Jinja sandbox a task's templates render in: bounded work and output of every step
- task_data.py   what pre-flight reads of a task's data, bounded: file sizes and a head sample of each file
- task_rules.py  a benchmark task file as untrusted input: the accepted YAML, the sandbox installed over lm-eval's
- verdict.py     the publish gate's verdict on the held-out metrics, and how they are reported
"""
