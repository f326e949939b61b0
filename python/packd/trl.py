"""TRL's GRPOTrainer on packd (packd/integrations/trl.py, docs/trl.md): change one import.

    from packd.trl import PackedGRPOTrainer        # instead of trl.GRPOTrainer
"""
from packd.integrations.trl import *  # noqa: F401,F403
from packd.integrations.trl import __all__  # noqa: F401
