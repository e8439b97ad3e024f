"""Model adapters: everything that knows about a transformers model rather than about the layout.

``adapter`` (unwrap wrappers, find the decoder, the head's definition, checkpointing), ``support`` (the refusals by
model type and configuration), ``checks`` (what is checked once per model), ``head`` (the chunked exact LM head),
``positions`` (position ids and the modules that number positions themselves), ``multimodal`` (a prompt's
visual inputs), ``streams`` (several token streams per position, MusicGen) and ``router`` (MoE routing and its
load-balancing loss).
"""
