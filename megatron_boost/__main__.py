"""``python -m megatron_boost``: the environment report (megatron_boost/cli/env.py)."""

import sys

from megatron_boost.cli.env import main

sys.exit(main())
