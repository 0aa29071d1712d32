"""Models: the family registry, checkpoint -> HF conversion and its proof, HF artifacts,
logits fingerprints, stop tokens, FLOPs per token, and the demo's tiny model.
"""
