"""Hugging Face drop-ins run by packd (packd/integrations/hf.py): DataCollatorWithFlattening,
the packd_varlen attention, packed_row, per-document state for hybrid families and the leak
probe. docs/client.md describes them."""
from packd.integrations.hf import *  # noqa: F401,F403
from packd.integrations.hf import __all__  # noqa: F401
