"""The cache path: hybrid models whose token mixing is computed inline in their forwards (MiniMax, Zaya), run group
by group from each prompt's cached layer state through the model's own cache-aware forward.

``run`` (one call: prompts once, completion batches from copies of the prompt's cache, the gradient pushed once
through the prompt), ``state`` (reading, repeating and freshly writing the cache's layer states) and ``calls`` (the
public calls' branch: data-parallel checks, DDP's error agreement, deferral). Which model types come here is the
registry's answer (``model.mixers``). ``max_tokens`` bounds every forward (prompt chunks, right-padded completion
batches); a completion longer than it is refused, and so are ``sp.Tree``, ``prompt_inputs``, FSDP2 and gradient
checkpointing.
"""
