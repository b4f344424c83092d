"""The mains of every tool (``tools/*.py`` and the ``megatron-boost-*`` commands).

Every entry point imports this package first, so megatron's known import notices are filtered
here, once, before any tool imports megatron (compat.py's ``quiet_known_warnings``).
"""

from megatron_boost.compat import quiet_known_warnings

quiet_known_warnings()
