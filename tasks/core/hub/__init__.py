"""The Hugging Face Hub: repo-id rules, where the token comes from, and the model card
that goes with a push.
"""
