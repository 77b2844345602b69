"""Plug flashattn's attention into other libraries (:mod:`flashattn.integrations.transformers`)."""
