"""Hugging Face transformers models: their own init (:mod:`.init_trace`) and their own
checkpoint conversion rules (:mod:`.convert`), through one door to transformers' internals
(:mod:`.upstream`). Nothing here imports transformers: a model can only hold its modules once
the user has imported it.
"""
