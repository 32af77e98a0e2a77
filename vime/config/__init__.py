"""The run's typed config: one frozen section per component, the bottom layer of vime (it imports nothing of it).

`RunConfig` (run_config.py) holds every section; each section module declares its fields with their types and
defaults. The flags' spelling and help stay with the argparse groups of each package (`*arguments.py`), which take
their defaults from here.
"""

from vime.config.run_config import PassThrough, RunConfig
from vime.config.section import Section

__all__ = ["PassThrough", "RunConfig", "Section"]
